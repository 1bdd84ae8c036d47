"""Provisioning through a REAL Celery worker process consuming the node's queue (not eager mode):
Redis in CI, the embedded filesystem broker on a laptop."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from marketplace.models import Allocation, GpuInstance
from marketplace.services import nodes, orders
from marketplace.tasks import provision_allocation, reconcile_node
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory
from tests.fleet_fixtures import make_node, make_tier
from tests.worker_process import Worker, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]
S = Allocation.State


@pytest.fixture
def node(catalog, sim_dir):
    return make_node(f"wk-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def worker(node, sim_dir, tmp_path):
    w = Worker(node.queue, sim_dir / "sim", tmp_path / "worker.log")
    yield w
    w.stop()


@pytest.fixture
def owner_principal(db):
    tenant = TenantFactory(max_slices=32, max_slices_per_tier=32, max_memory_gb=5000)
    return principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user), tenant


def state_of(pk):
    connection.close()  # see the worker's commits
    return Allocation.objects.get(pk=pk).state


def gpu_instances_on(node):
    with nodes.nvml_client(node) as c:
        return [(g.index, s.start, s.size) for g in node.gpus.all() for s in c.slices(g.index)]


def test_order_becomes_active_through_the_node_worker(node, worker, owner_principal):
    p, tenant = owner_principal
    worker.start()
    tier = make_tier("wk-3g", "h100-sxm-80gb", "3g.40gb")
    order = orders.create_order(p, tenant=tenant, tier=tier, quantity=2)
    ids = list(order.allocations.values_list("pk", flat=True))
    for pk in ids:
        wait_for(lambda pk=pk: state_of(pk) == S.ACTIVE, 60, f"allocation {pk} active", worker)
    assert len(gpu_instances_on(node)) == 2
    for a in Allocation.objects.filter(pk__in=ids):
        assert a.mig_uuid.startswith("MIG-")
        assert [e.to_state for e in a.events.all()] == ["requested", "placed", "provisioning", "ready", "active"]
    # release goes through the same queue
    orders.request_release(p, Allocation.objects.get(pk=ids[0]))
    wait_for(lambda: state_of(ids[0]) == S.RELEASED, 60, "released", worker)
    assert len(gpu_instances_on(node)) == 1


def test_replayed_task_makes_one_gpu_instance(node, worker, owner_principal):
    p, tenant = owner_principal
    tier = make_tier("wk-1g", "h100-sxm-80gb", "1g.10gb")
    a = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    for _ in range(3):  # the same task delivered three more times, before and after it ran
        provision_allocation.apply_async(args=[a.pk], queue=node.queue)
    worker.start()
    wait_for(lambda: state_of(a.pk) == S.ACTIVE, 60, "active", worker)
    provision_allocation.apply_async(args=[a.pk], queue=node.queue)
    reconcile_node.apply_async(args=[node.pk], queue=node.queue)
    wait_for(lambda: "reconcile_node" in worker.log_tail(200) and "succeeded" in worker.log_tail(5), 30,
             "reconcile ran", worker)
    assert gpu_instances_on(node) == [(a.instance.gpu.index, a.instance.start, 1)]
    assert Allocation.objects.get(pk=a.pk).events.filter(to_state=S.ACTIVE).count() == 1


def test_worker_killed_mid_provision_converges_without_orphans(node, worker, owner_principal):
    p, tenant = owner_principal
    tier = make_tier("wk-2g", "h100-sxm-80gb", "2g.20gb")
    worker.start(TESSERA_NVML_SIM_CREATE_LATENCY_S="30")  # the create call hangs after the GI exists
    a = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    wait_for(lambda: len(gpu_instances_on(node)) == 1, 60, "GI created on the GPU", worker)
    worker.kill()
    connection.close()
    a.refresh_from_db()
    assert a.state == S.PROVISIONING
    assert GpuInstance.objects.get(pk=a.instance_id).state == GpuInstance.State.RESERVED  # never recorded
    worker.start()  # a fresh worker; the unacked task comes back (acks_late) and beat's reconcile runs
    reconcile_node.apply_async(args=[node.pk], queue=node.queue)
    wait_for(lambda: state_of(a.pk) == S.ACTIVE, 90, "active after restart", worker)
    inst = GpuInstance.objects.get(pk=a.instance_id)
    assert gpu_instances_on(node) == [(inst.gpu.index, inst.start, 2)]  # adopted: one GI, no orphan
    assert inst.state == GpuInstance.State.CREATED and inst.mig_uuid
