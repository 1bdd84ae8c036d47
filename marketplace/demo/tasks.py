"""The demo's Celery tasks (registered only when the demo app is installed: TESSERA_DEMO_TRAFFIC=1)."""

from __future__ import annotations

from celery import shared_task

from marketplace.demo import traffic
from marketplace.models import Node


@shared_task(name="tessera.demo_gateway_node", acks_late=True, time_limit=120)
def demo_gateway_node(node_id: int) -> int:
    return traffic.gateway_tick(node_id)


@shared_task(name="tessera.demo_gateway_fleet", time_limit=60)
def demo_gateway_fleet() -> int:
    nodes = list(Node.objects.filter(state=Node.State.READY))
    for node in nodes:
        demo_gateway_node.apply_async(args=[node.pk], queue=node.queue)
    return len(nodes)
