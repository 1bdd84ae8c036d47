"""Redis restarted under the broker -> no provisioning task lost.

The machine's own Redis (6379) is configured to keep nothing on disk (--save "" --appendonly no), so a
restart of *that* server loses queued messages by configuration, not by a bug of Tessera. These tests
therefore run their own redis-server (a free port, AOF with appendfsync always, its own directory; see
conftest.PrivateRedis), kill -9 it and restart it on the same directory: the durability that production
Redis must be configured with. The machine's Redis is never touched: the orders' tasks are sent through a
kombu connection to the private server, and the worker subprocess uses it as broker, result backend and
cache (CELERY_BROKER_URL / CELERY_RESULT_BACKEND / REDIS_URL)."""

from __future__ import annotations

import time
import uuid

import pytest
from django.db import connection
from kombu import Connection

from marketplace.models import Allocation, GpuInstance
from marketplace.services import nodes, orders
from marketplace.tasks import provision_allocation
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory
from tests.faults.conftest import needs_real_services
from tests.fleet_fixtures import make_node, make_tier
from tests.worker_process import Worker, wait_for

pytestmark = [needs_real_services, pytest.mark.worker, pytest.mark.django_db(transaction=True)]
S = Allocation.State


@pytest.fixture
def node(catalog, sim_dir):
    return make_node(f"rf-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def owner_principal(db):
    tenant = TenantFactory(max_slices=32, max_slices_per_tier=32, max_memory_gb=5000)
    return principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user), tenant


@pytest.fixture
def broker(private_redis, monkeypatch):
    """Provisioning tasks of this test go to the private Redis (on commit, as create_order does)."""
    conn = Connection(private_redis.url)

    def enqueue(allocation):
        provision_allocation.apply_async(args=[allocation.pk], queue=allocation.node.queue, connection=conn,
                                         ignore_result=True)

    monkeypatch.setattr(orders, "enqueue_provision", enqueue)
    yield private_redis
    conn.release()


@pytest.fixture
def worker(node, sim_dir, tmp_path, broker):
    w = Worker(node.queue, sim_dir / "sim", tmp_path / "worker.log", CELERY_BROKER_URL=broker.url,
               CELERY_RESULT_BACKEND=broker.url, REDIS_URL=broker.url)
    yield w
    w.stop()


def states(ids):
    connection.close()  # see the worker's commits
    return dict(Allocation.objects.filter(pk__in=ids).values_list("pk", "state"))


def gpu_instances_on(node):
    with nodes.nvml_client(node) as c:
        return [(g.index, s.start, s.size) for g in node.gpus.all() for s in c.slices(g.index)]


def test_redis_restart_with_queued_tasks_loses_no_order(node, broker, worker, owner_principal):
    p, tenant = owner_principal
    tier = make_tier("rf-1g", "h100-sxm-80gb", "1g.10gb")
    made = [orders.create_order(p, tenant=tenant, tier=tier, quantity=q) for q in (1, 2, 3)]
    ids = [pk for o in made for pk in o.allocations.values_list("pk", flat=True)]
    assert len(ids) == 6
    assert broker.queued(node.queue) == 6  # no worker yet: all six tasks wait in Redis

    broker.kill9()  # Redis dies with the tasks queued ...
    broker.start()  # ... and comes back from its AOF
    assert broker.queued(node.queue) == 6

    worker.start()
    wait_for(lambda: set(states(ids).values()) == {S.ACTIVE}, 120, "every allocation active", worker)
    assert len(gpu_instances_on(node)) == 6
    for a in Allocation.objects.filter(pk__in=ids):
        assert a.events.filter(to_state=S.ACTIVE).count() == 1
    assert broker.queued(node.queue) == 0


def test_redis_restart_while_worker_holds_unacked_task_redelivers_it(node, broker, worker, owner_principal):
    p, tenant = owner_principal
    tier = make_tier("rf-2g", "h100-sxm-80gb", "2g.20gb")
    worker.start(TESSERA_NVML_SIM_CREATE_LATENCY_S="30")  # the create call hangs after the GI exists
    a = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    wait_for(lambda: len(gpu_instances_on(node)) == 1, 60, "GI created on the GPU", worker)
    assert broker.unacked() == 1  # acks_late: the running task is still Redis' (kombu's unacked hash)

    broker.kill9()
    broker.start()
    worker.kill()  # and the worker dies too: only a redelivery can finish the allocation
    assert broker.unacked() == 1, "the unacked task did not survive the Redis restart"
    assert broker.queued(node.queue) == 0
    assert states([a.pk]) == {a.pk: S.PROVISIONING}

    # A fresh worker, no reconcile: kombu restores an unacked message older than the visibility timeout
    # (CELERY_VISIBILITY_TIMEOUT=5 in tests) when the worker starts polling, and after that only every
    # unacked_restore_interval x unacked_restore_throttle = 10 s x 10 = ~100 s (kombu 5.7 defaults): so the
    # fresh worker is started once the timeout has passed.
    time.sleep(6)
    worker.start()
    wait_for(lambda: states([a.pk]) == {a.pk: S.ACTIVE}, 90, "active after redelivery", worker)
    inst = GpuInstance.objects.get(pk=a.instance_id)
    assert gpu_instances_on(node) == [(inst.gpu.index, inst.start, 2)]  # adopted: one GI, no orphan
    assert Allocation.objects.get(pk=a.pk).events.filter(to_state=S.ACTIVE).count() == 1
    wait_for(lambda: broker.unacked() == 0, 20, "the redelivered task acked", worker)
