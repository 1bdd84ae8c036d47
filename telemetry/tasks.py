"""Telemetry tasks: thin wrappers around services. The node scrape runs on the node's own queue
(its caller routes it there); the fleet fan-out runs on the control queue from beat."""

from __future__ import annotations

from celery import shared_task

from telemetry.collector_tasks import collect_gpu_fleet, collect_gpu_node, downsample_telemetry
from telemetry.services import scrape

__all__ = ["collect_gpu_fleet", "collect_gpu_node", "consume_usage", "downsample_telemetry", "scrape_triton_fleet",
           "scrape_triton_node"]

NODE_TASK = {"acks_late": True, "reject_on_worker_lost": True, "time_limit": 120, "soft_time_limit": 100}


@shared_task(name="tessera.scrape_triton_node", ignore_result=True, **NODE_TASK)
def scrape_triton_node(node_id: int) -> dict:
    """Read Triton's inference statistics for every ready model on the node; add the increase to the
    current hour of TritonServedHourly. Idempotent enough to replay: a second run adds only what was
    served in between."""
    return scrape.scrape_node(node_id)


@shared_task(name="tessera.scrape_triton_fleet", acks_late=True, time_limit=120)
def scrape_triton_fleet() -> int:
    """Beat (control queue): one scrape per node with active slices, each on its own queue."""
    return scrape.fan_out()


@shared_task(name="tessera.consume_usage", ignore_result=True, acks_late=True, time_limit=60, soft_time_limit=45)
def consume_usage() -> dict:
    """Beat (control queue): write what the gateway served (its usage stream or spool) into the database."""
    from marketplace.gateway import metering  # the gateway package loads Django models

    return metering.consume(budget_s=20)
