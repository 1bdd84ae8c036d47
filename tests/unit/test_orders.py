"""Orders -> allocations: state machine, quotas, placement, provisioning and release on the
simulated NVML, idempotency, reconcile. Tasks' bodies are called in-process here; the real-worker
tests are in tests/integration/test_worker.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection  # used by the skipif conditions
from django.utils import timezone

from marketplace.models import Allocation, DriftEvent, GpuInstance, GpuSlot, Order, PricePlan
from marketplace.services import allocations, nodes, offers, orders, provisioning, reconcile
from marketplace.services.fleet import NoCapacityError
from tenants.errors import Forbidden
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import InvoiceFactory, InvoiceLineFactory, MembershipFactory, TenantFactory, make_key

pytestmark = pytest.mark.django_db
S = Allocation.State


@pytest.fixture
def owner(db):
    m = MembershipFactory(role=Role.OWNER, tenant=TenantFactory(slug="acme"))
    return m.user


@pytest.fixture
def p(owner):
    return principal_for_user(owner)


def gi_count(node):
    with nodes.nvml_client(node) as c:
        return sum(len(c.slices(g.index)) for g in node.gpus.all())


def test_order_to_active_with_history(h100_node, tiers, owner, p):
    tenant = owner.memberships.get().tenant
    order = orders.create_order(p, tenant=tenant, tier=tiers["3g"])
    a = order.allocations.get()
    assert a.state == S.PLACED and a.node == h100_node and a.size == 4 and a.placement_reason
    assert provisioning.provision(a.pk) == "activated"
    a.refresh_from_db()
    assert a.state == S.ACTIVE and a.mig_uuid.startswith("MIG-") and a.activated_at
    assert [e.to_state for e in a.events.all()] == ["requested", "placed", "provisioning", "ready", "active"]
    assert {e.actor for e in a.events.all()} >= {f"user:{owner.email}", "task:provision"}
    assert gi_count(h100_node) == 1


def test_provision_replayed_makes_one_gpu_instance(h100_node, tiers, owner, p):
    a = orders.create_order(p, tenant=owner.memberships.get().tenant, tier=tiers["1g"]).allocations.get()
    provisioning.provision(a.pk)
    assert provisioning.provision(a.pk).startswith("nothing to do")
    # a task that died after creating the GI but before recording it: the state says provisioning
    a.refresh_from_db()
    Allocation.objects.filter(pk=a.pk).update(state=S.PROVISIONING)
    GpuInstance.objects.filter(pk=a.instance_id).update(state=GpuInstance.State.RESERVED, gi_id=None)
    assert provisioning.provision(a.pk) == "activated"
    assert gi_count(h100_node) == 1


def test_illegal_transitions_are_refused(h100_node, tiers, owner, p):
    a = orders.create_order(p, tenant=owner.memberships.get().tenant, tier=tiers["1g"]).allocations.get()
    with pytest.raises(allocations.IllegalTransition):
        allocations.activate(a, "test")  # placed -> active skips provisioning
    with pytest.raises(allocations.IllegalTransition):
        allocations.mark_released(a, "test")
    provisioning.provision(a.pk)
    orders.request_release(p, a)
    provisioning.release_allocation(a.pk)
    a.refresh_from_db()
    for move in (allocations.begin_provisioning, allocations.begin_release, allocations.activate):
        with pytest.raises(allocations.IllegalTransition):
            move(a, "test")
    assert a.state == S.RELEASED


def test_release_destroys_the_slice_and_returns_slots(h100_node, tiers, owner, p):
    a = orders.create_order(p, tenant=owner.memberships.get().tenant, tier=tiers["3g"]).allocations.get()
    provisioning.provision(a.pk)
    orders.request_release(p, Allocation.objects.get(pk=a.pk))
    assert Allocation.objects.get(pk=a.pk).state == S.RELEASING
    assert provisioning.release_allocation(a.pk) == "released"
    assert provisioning.release_allocation(a.pk) == "already released"  # replay is harmless
    a.refresh_from_db()
    assert a.state == S.RELEASED and a.instance is None and a.released_at
    assert gi_count(h100_node) == 0 and not GpuSlot.objects.exists()


@pytest.mark.parametrize(("field", "value", "quantity"), [
    ("max_slices", 2, 3), ("max_slices_per_tier", 1, 2), ("max_memory_gb", 30, 1),
])
def test_quota_refusal_reserves_nothing(h100_node, tiers, owner, p, field, value, quantity):
    tenant = owner.memberships.get().tenant
    if field == "max_slices_per_tier":
        tenant.max_slices_per_tier = value
    else:
        setattr(tenant, field, value)
        tenant.max_slices_per_tier = min(tenant.max_slices_per_tier, tenant.max_slices)
    tenant.save()
    with pytest.raises(orders.QuotaExceeded) as err:
        orders.create_order(p, tenant=tenant, tier=tiers["3g"], quantity=quantity)
    assert "quota" in err.value.message
    assert not Order.objects.exists() and not Allocation.objects.exists() and not GpuInstance.objects.exists()


def test_the_memory_quota_counts_slices_and_whole_gpus_in_one_query(h100_node, tiers, owner, p,
                                                                    django_assert_num_queries):
    from tests.factories import AllocationFactory, OrderFactory
    from tests.fleet_fixtures import make_tier

    tenant = owner.memberships.get().tenant
    tenant.max_slices, tenant.max_slices_per_tier, tenant.max_memory_gb = 10, 10, 100
    tenant.save()
    whole = make_tier("h100-whole", "h100-sxm-80gb", None)
    for tier in (whole, tiers["1g"]):  # 80 GB + 10 GB in use; a released slice counts for nothing
        AllocationFactory(order=OrderFactory(tenant=tenant, tier=tier))
    AllocationFactory(order=OrderFactory(tenant=tenant, tier=tiers["3g"]), state=S.RELEASED)
    with django_assert_num_queries(1):
        orders.check_quota(tenant, tiers["1g"], 1)  # 100 GB: fits
    with pytest.raises(orders.QuotaExceeded, match="90 GB of 100 GB"):
        orders.check_quota(tenant, tiers["1g"], 2)
    with pytest.raises(orders.QuotaExceeded, match="1 of 1 slices of h100-1g"):
        tenant.max_slices_per_tier = 1
        orders.check_quota(tenant, tiers["1g"], 1)


def test_no_capacity_rolls_back_the_whole_order(h100_node, tiers, owner, p):
    tenant = owner.memberships.get().tenant
    tenant.max_slices, tenant.max_slices_per_tier, tenant.max_memory_gb = 64, 64, 10_000
    tenant.save()
    orders.create_order(p, tenant=tenant, tier=tiers["7g"], quantity=7)
    with pytest.raises(NoCapacityError):
        orders.create_order(p, tenant=tenant, tier=tiers["3g"], quantity=3)  # room for 2 only
    assert Order.objects.count() == 1 and Allocation.objects.count() == 7
    assert GpuInstance.objects.count() == 7


def test_roles_and_suspension_gate_orders(h100_node, tiers, owner):
    tenant = owner.memberships.get().tenant
    viewer = MembershipFactory(tenant=tenant, role=Role.VIEWER).user
    with pytest.raises(Forbidden):
        orders.create_order(principal_for_user(viewer), tenant=tenant, tier=tiers["1g"])
    tenant.status = tenant.Status.SUSPENDED
    tenant.save()
    with pytest.raises(Forbidden):
        orders.create_order(principal_for_user(owner), tenant=tenant, tier=tiers["1g"])
    assert not Allocation.objects.exists()


def test_idempotency_key_returns_the_first_order(h100_node, tiers, owner, p):
    tenant = owner.memberships.get().tenant
    first = orders.create_order(p, tenant=tenant, tier=tiers["1g"], idempotency_key="k1")
    again = orders.create_order(p, tenant=tenant, tier=tiers["1g"], idempotency_key="k1")
    assert first.pk == again.pk and Allocation.objects.count() == 1


def test_orphan_blocking_placement_fails_then_reconcile_fixes(h100_node, tiers, owner, p, operator):
    a = orders.create_order(p, tenant=owner.memberships.get().tenant, tier=tiers["3g"]).allocations.get()
    inst = a.instance
    with nodes.nvml_client(h100_node) as c:  # something not in the database holds those slices
        c.create_slice(inst.gpu.index, 14, inst.start)  # a 2g.20gb at the same start
    with pytest.raises(provisioning.TransientProvisioningError):
        provisioning.provision(a.pk)
    assert provisioning.provision(a.pk, final_attempt=True) == "failed"
    a.refresh_from_db()
    assert a.state == S.FAILED and "InsufficientResources" in a.failure_reason
    assert a.instance is None and not GpuSlot.objects.exists()  # nothing was created: slots returned
    found = reconcile.reconcile_node(h100_node.pk)
    assert found["orphans_destroyed"] == 1
    assert DriftEvent.objects.filter(kind=DriftEvent.Kind.ORPHAN_DESTROYED).count() == 1
    orders.retry(principal_for_user(operator), a)
    assert provisioning.provision(a.pk) == "activated"
    assert gi_count(h100_node) == 1


def test_reconcile_recreates_missing_and_requeues_stuck(h100_node, tiers, owner, p, settings, monkeypatch):
    tenant = owner.memberships.get().tenant
    a = orders.create_order(p, tenant=tenant, tier=tiers["1g"]).allocations.get()
    provisioning.provision(a.pk)
    a.refresh_from_db()
    with nodes.nvml_client(h100_node) as c:  # the GPU lost it (reset)
        c.destroy_slice(a.instance.gpu.index, a.instance.gi_id)
    stuck = orders.create_order(p, tenant=tenant, tier=tiers["1g"]).allocations.get()
    Allocation.objects.filter(pk=stuck.pk).update(updated_at=timezone.now() - timedelta(hours=1))
    sent = []
    monkeypatch.setattr(orders, "enqueue_provision", lambda alloc: sent.append(alloc.pk))
    found = reconcile.reconcile_node(h100_node.pk)
    assert found["recreated"] == 1 and found["requeued"] == 1 and sent == [stuck.pk]
    assert gi_count(h100_node) == 1
    assert Allocation.objects.get(pk=a.pk).mig_uuid == GpuInstance.objects.get(pk=a.instance_id).mig_uuid


def test_price_changes_never_rewrite_the_past(tiers, operator):
    """A plan may start in the past only over hours no finalized invoice holds (of that tier, kind, currency)."""
    op = principal_for_user(operator)
    tier = tiers["1g"]
    in_force = PricePlan.objects.get(tier=tier)
    held = InvoiceFactory(status="finalized", number="TSR-2026-000042")
    InvoiceLineFactory(invoice=held, tier=tier, plan=in_force, usage_from=timezone.now() - timedelta(hours=3),
                       usage_to=timezone.now() - timedelta(hours=2))
    with pytest.raises(Exception, match="finalized invoices hold: TSR-2026-000042"):
        offers.add_price_plan(op, tier=tier, currency="USD", price_per_slice_hour="2",
                              price_per_1m_input_tokens="0.1", price_per_1m_output_tokens="0.4",
                              effective_from=timezone.now() - timedelta(hours=4))
    # after the finalized usage (a correction of the last two hours): allowed, and in force from then
    back = offers.add_price_plan(op, tier=tier, currency="USD", price_per_slice_hour="3",
                                 price_per_1m_input_tokens="0.1", price_per_1m_output_tokens="0.4",
                                 effective_from=timezone.now() - timedelta(hours=1))
    assert orders.plan_in_force(tier, "USD", "on_demand") == back
    back.delete()
    later = timezone.now() + timedelta(days=3)
    new = offers.add_price_plan(op, tier=tier, currency="USD", price_per_slice_hour="2",
                                price_per_1m_input_tokens="0.1", price_per_1m_output_tokens="0.4",
                                effective_from=later)
    assert str(orders.plan_in_force(tier, "USD", "on_demand").price_per_slice_hour) == "1.0000"
    assert orders.plan_in_force(tier, "USD", "on_demand", at=later + timedelta(hours=1)) == new
    old = PricePlan.objects.exclude(pk=new.pk).get(tier=tier)
    with pytest.raises(Exception, match="in force"):
        offers.withdraw_price_plan(op, old)


def test_orders_api(api, as_key, as_user, h100_node, tiers, owner, world):
    tenant = owner.memberships.get().tenant
    _, deployer = make_key(tenant, ["deployments:write", "read"])
    r = as_key(deployer).post("/api/v1/orders/", {"tier": "h100-1g", "quantity": 2, "idempotency_key": "a1"})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["tenant"] == "acme" and len(body["allocations"]) == 2
    assert all(al["state"] == "placed" for al in body["allocations"])
    _, reader = make_key(tenant, ["read"])
    assert as_key(reader).post("/api/v1/orders/", {"tier": "h100-1g"}).status_code == 403
    before = Allocation.objects.count()
    for bad, field in [({"tier": "nope"}, "tier"), ({"tier": "h100-1g", "quantity": 0}, "quantity"),
                       ({"tier": "h100-1g", "plan_kind": "free"}, "plan_kind"), ({}, "tier")]:
        r = as_key(deployer).post("/api/v1/orders/", bad)
        assert r.status_code == 400 and field in r.json(), (bad, r.content)
    assert Allocation.objects.count() == before
    # another tenant's allocation is a 404, on read and on release
    alloc_id = body["allocations"][0]["id"]
    other = as_key(world["secret_a"])
    assert other.get(f"/api/v1/allocations/{alloc_id}/").status_code == 404
    assert other.post(f"/api/v1/allocations/{alloc_id}/release/").status_code == 404
    assert other.get("/api/v1/orders/").json()["count"] == 0
    r = as_key(deployer).post(f"/api/v1/allocations/{alloc_id}/release/")
    assert r.status_code == 202 and r.json()["state"] == "releasing"
    assert [e["to_state"] for e in r.json()["events"]] == ["requested", "placed", "releasing"]


def test_tiers_api_shows_prices_and_operators_write(api, as_user, tiers, owner, operator):
    r = as_user(owner).get("/api/v1/tiers/")
    assert r.status_code == 200
    row = next(t for t in r.json()["results"] if t["key"] == "h100-3g")
    assert row["profile"] == "3g.40gb" and row["memory_gb"] == 40
    assert row["current_prices"][0]["per_slice_hour"] == "1.0000"
    new = {"key": "h200-x", "name": "H200 x", "gpu_model": "h200-sxm-141gb", "profile": "3g.71gb"}
    assert as_user(owner).post("/api/v1/tiers/", new).status_code == 403
    assert as_user(operator).post("/api/v1/tiers/", {**new, "profile": "3g.40gb"}).status_code == 400
    assert as_user(operator).post("/api/v1/tiers/", new).status_code == 201


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="concurrent writers need PostgreSQL")
@pytest.mark.django_db(transaction=True)
def test_two_concurrent_orders_for_the_last_placement_one_wins(h100_node, tiers, monkeypatch):
    import threading

    from marketplace.models import Gpu

    monkeypatch.setattr(orders, "enqueue_provision", lambda a: None)  # no broker needed here
    Gpu.objects.filter(node=h100_node).exclude(index=0).update(state=Gpu.State.MAINTENANCE)
    t1, t2 = (TenantFactory(max_slices=20, max_slices_per_tier=20) for _ in range(2))
    p1 = principal_for_user(MembershipFactory(tenant=t1, role=Role.OWNER).user)
    p2 = principal_for_user(MembershipFactory(tenant=t2, role=Role.OWNER).user)
    orders.create_order(p1, tenant=t1, tier=tiers["3g"])  # one 3g half left on the only GPU
    barrier = threading.Barrier(2)
    results = []

    def order(p, t):
        try:
            barrier.wait(timeout=10)
            results.append(orders.create_order(p, tenant=t, tier=tiers["3g"]).pk)
        except NoCapacityError as exc:
            results.append(exc.message)
        finally:
            connection.close()

    threads = [threading.Thread(target=order, args=args) for args in ((p1, t1), (p2, t2))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sum(isinstance(r, int) for r in results) == 1, results
    loser = next(r for r in results if isinstance(r, str))
    assert "3g.40gb" in loser  # a clear reason: which profile had no free placement
    assert Order.objects.count() == 2 and Allocation.objects.count() == 2 and GpuInstance.objects.count() == 2


def _order_at_once(calls, timeout=60):
    """Run each (principal, tenant, tier) order in its own thread, all released at once; returns each one's
    order id or the refusal (its message)."""
    import threading

    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def order(i, p, t, tier):
        try:
            barrier.wait(timeout=10)
            results[i] = orders.create_order(p, tenant=t, tier=tier).pk
        except (NoCapacityError, orders.QuotaExceeded) as exc:
            results[i] = exc.message
        finally:
            connection.close()

    threads = [threading.Thread(target=order, args=(i, *c)) for i, c in enumerate(calls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    return results


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="concurrent writers need PostgreSQL")
@pytest.mark.django_db(transaction=True)
def test_concurrent_orders_of_many_tenants_all_placed_when_the_fleet_has_room(h100_node, tiers, monkeypatch):
    """Every order plans on the same best GPU; the placement lock makes each plan on what the previous one
    committed, so none is refused with "capacity changed" (before: 5 re-plans, then a refusal) and no slot
    is taken twice."""
    monkeypatch.setattr(orders, "enqueue_provision", lambda a: None)
    tenants = [TenantFactory(max_slices=8, max_slices_per_tier=8) for _ in range(4)]
    principals = [principal_for_user(MembershipFactory(tenant=t, role=Role.OWNER).user) for t in tenants]
    calls = [(principals[i % 4], tenants[i % 4], tiers["1g"]) for i in range(16)]
    results = _order_at_once(calls)
    assert all(isinstance(r, int) for r in results), results
    assert Allocation.objects.filter(state=S.PLACED).count() == 16
    assert GpuSlot.objects.count() == 16 == GpuInstance.objects.count()
    # best fit still packs: 16 1g slices on 3 GPUs (7 + 7 + 2), not one per GPU
    assert GpuInstance.objects.values("gpu").distinct().count() == 3


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="concurrent writers need PostgreSQL")
@pytest.mark.django_db(transaction=True)
def test_concurrent_orders_of_one_tenant_never_exceed_its_quota(h100_node, tiers, monkeypatch):
    monkeypatch.setattr(orders, "enqueue_provision", lambda a: None)
    tenant = TenantFactory(max_slices=3, max_slices_per_tier=3)
    p = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    results = _order_at_once([(p, tenant, tiers["1g"])] * 8)
    assert sum(isinstance(r, int) for r in results) == 3, results
    assert all("quota" in r for r in results if isinstance(r, str))
    assert Allocation.objects.filter(tenant=tenant).count() == 3 == GpuSlot.objects.count()


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="concurrent writers need PostgreSQL")
@pytest.mark.django_db(transaction=True)
def test_the_same_idempotency_key_sent_twice_at_once_makes_one_order(h100_node, tiers, monkeypatch):
    import threading

    monkeypatch.setattr(orders, "enqueue_provision", lambda a: None)
    tenant = TenantFactory(max_slices=8, max_slices_per_tier=8)
    p = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    barrier, results = threading.Barrier(2), []

    def order():
        try:
            barrier.wait(timeout=10)
            results.append(orders.create_order(p, tenant=tenant, tier=tiers["1g"], idempotency_key="same").pk)
        finally:
            connection.close()

    threads = [threading.Thread(target=order) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert len(results) == 2 and results[0] == results[1]
    assert Order.objects.count() == 1 and Allocation.objects.count() == 1
