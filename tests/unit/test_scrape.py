"""The Triton statistics scraper against the simulated Triton server, and metered vs served."""

from __future__ import annotations

import threading
from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from marketplace.models import Allocation, ModelDeployment, Order
from marketplace.services import deployments, orders, provisioning
from telemetry import selectors, tasks
from telemetry.models import TritonCounter, TritonServedHourly
from telemetry.services import ingest, scrape
from tenants.roles import Role
from tenants.scoping import Principal, principal_for_key, principal_for_user
from tests.factories import TenantFactory
from tests.fleet_fixtures import make_tier
from tests.worker_process import wait_for

pytestmark = pytest.mark.django_db


def _deploy(owner, tenant, tier, name="tiny-gen"):
    p = principal_for_user(owner)
    alloc = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    provisioning.provision(alloc.pk)
    alloc = Allocation.objects.get(pk=alloc.pk)
    dep = deployments.deploy(p, alloc, name, template="tiny-gen")
    deployments.load(dep.pk)
    return ModelDeployment.objects.select_related("allocation").get(pk=dep.pk)


@pytest.fixture
def two(world, members_a, h100_node, tiers):
    """Two ready deployments of tenant A on two slices of the node, one of tenant B."""
    owner = members_a[Role.OWNER]
    return {"a1": _deploy(owner, world["a"], tiers["1g"]), "a2": _deploy(owner, world["a"], tiers["1g"], "gen2"),
            "b": _deploy(world["owner_b"], world["b"], tiers["1g"]), "node": h100_node}


def infer(dep, n):
    server = deployments.backend_for(dep.allocation)
    for _ in range(n):
        server.infer_text(dep.name, "hello tessera", max_tokens=3)


def served(dep):
    return TritonServedHourly.objects.filter(deployment=dep).aggregate(r=Sum("requests"))["r"] or 0


def test_scrape_counts_what_triton_served(two):
    infer(two["a1"], 5)
    infer(two["b"], 2)
    found = scrape.scrape_node(two["node"].pk)
    assert found == {"deployments": 3, "requests": 7, "failures": 0, "errors": 0, "mismatches": 0}
    assert served(two["a1"]) == 5 and served(two["b"]) == 2 and served(two["a2"]) == 0
    row = TritonServedHourly.objects.get(deployment=two["a1"])
    assert row.tenant_id == two["a1"].tenant_id and row.hour == timezone.now().replace(minute=0, second=0,
                                                                                        microsecond=0)
    assert scrape.scrape_node(two["node"].pk)["requests"] == 0  # nothing new: nothing added
    infer(two["a1"], 3)
    scrape.scrape_node(two["node"].pk)
    assert served(two["a1"]) == 8
    assert TritonCounter.objects.get(deployment=two["a1"]).inference_count == 8


def test_restarted_server_counter_reset(two):
    infer(two["a1"], 6)
    scrape.scrape_node(two["node"].pk)
    server = deployments.backend_for(two["a1"].allocation)
    server.unload_model("tiny-gen")  # a restart: the model comes back with counters at zero
    server.load_model("tiny-gen")
    infer(two["a1"], 2)
    assert server.statistics("tiny-gen")["inference_count"] == 2
    scrape.scrape_node(two["node"].pk)
    assert served(two["a1"]) == 8  # 6 before the restart + 2 after, not 6 + (2 - 6)
    assert TritonCounter.objects.get(deployment=two["a1"]).inference_count == 2
    infer(two["a1"], 1)
    scrape.scrape_node(two["node"].pk)
    assert served(two["a1"]) == 9


def test_one_failing_server_does_not_stop_the_others(two, caplog):
    infer(two["a1"], 1)
    infer(two["a2"], 4)
    infer(two["b"], 3)
    deployments.backend_for(two["a1"].allocation).server_ready = False  # a1's slice server is down
    found = scrape.scrape_node(two["node"].pk)
    assert found["errors"] == 1 and found["deployments"] == 2 and found["requests"] == 7
    assert served(two["a1"]) == 0 and served(two["a2"]) == 4 and served(two["b"]) == 3
    assert "triton scrape failed" in caplog.text
    deployments.backend_for(two["a1"].allocation).server_ready = True
    scrape.scrape_node(two["node"].pk)
    assert served(two["a1"]) == 1  # caught up on the next scrape


def test_only_ready_models_on_active_slices(two):
    infer(two["a1"], 2)
    Allocation.objects.filter(pk=two["a2"].allocation_id).update(state=Allocation.State.RELEASING)
    ModelDeployment.objects.filter(pk=two["b"].pk).update(state=ModelDeployment.State.FAILED)
    assert scrape.scrape_node(two["node"].pk)["deployments"] == 1


def test_metered_vs_served_shows_the_difference(two, world, as_key, as_user, operator):
    infer(two["a1"], 3)
    infer(two["b"], 2)
    scrape.scrape_node(two["node"].pk)
    now = timezone.now()
    events = [{"event_id": f"e{n}", "deployment": two["a1"].pk, "ts": now.isoformat(), "input_tokens": 3,
               "output_tokens": 3} for n in range(5)]
    ingest.ingest_batch(Principal(is_operator=True), world["a"], events)
    since, until = now - timedelta(hours=1), now + timedelta(hours=1)
    rows = {r["deployment"]: r for r in selectors.metered_vs_served(principal_for_key(world["key_a"]), since, until)}
    assert set(rows) == {two["a1"].pk}  # tenant A sees only its own
    r = rows[two["a1"].pk]
    assert (r["metered_requests"], r["served_requests"], r["difference"]) == (5, 3, 2)
    op_rows = {r["deployment"]: r for r in selectors.metered_vs_served(principal_for_user(operator), since, until)}
    assert op_rows[two["b"].pk]["difference"] == -2 and op_rows[two["b"].pk]["tenant"] == "bravo"
    assert set(selectors.metered_vs_served(principal_for_user(operator), since, until, tenant="bravo")[0]) >= {
        "model", "node", "served_failures"}

    resp = as_key(world["secret_a"]).get("/api/v1/usage/metered-vs-served/")
    assert resp.status_code == 200
    assert [(x["deployment"], x["difference"]) for x in resp.json()["results"]] == [(two["a1"].pk, 2)]
    resp = as_user(operator).get("/api/v1/usage/metered-vs-served/", {"tenant": "bravo"})
    assert [(x["tenant"], x["served_requests"]) for x in resp.json()["results"]] == [("bravo", 2)]
    assert as_key(world["secret_b"]).get("/api/v1/usage/metered-vs-served/?tenant=alpha").json()["results"] == []
    assert as_user(operator).get("/api/v1/usage/metered-vs-served/?since=yesterday").status_code == 400


def test_fleet_fan_out_routes_to_node_queues(two):
    with mock.patch.object(tasks.scrape_triton_node, "apply_async") as send:
        assert tasks.scrape_triton_fleet() == 1
    send.assert_called_once_with(args=[two["node"].pk], queue=two["node"].queue)
    assert tasks.scrape_triton_node(two["node"].pk)["deployments"] == 3


@pytest.fixture
def lone_dep(catalog):
    """A ready deployment on an active slice, nothing else (the readings are given by the test)."""
    tenant = TenantFactory()
    tier = make_tier("sc-1g", "h100-sxm-80gb", "1g.10gb")
    alloc = Allocation.objects.create(order=Order.objects.create(tenant=tenant, tier=tier), tenant=tenant, tier=tier,
                                      state=Allocation.State.ACTIVE)
    return ModelDeployment.objects.create(allocation=alloc, tenant=tenant, name="m", backend="python", spec={},
                                          memory_mb=1, state=ModelDeployment.State.READY)


def test_a_scrape_that_dies_before_its_commit_leaves_nothing_and_its_replay_counts_once(lone_dep):
    dep = lone_dep
    with mock.patch.object(TritonServedHourly.objects, "create", side_effect=RuntimeError("worker died")), \
            pytest.raises(RuntimeError):
        scrape.record_counters(dep, lambda: (5, 1))  # the counter row was created and moved, then it died
    assert not TritonCounter.objects.filter(deployment=dep).exists() and served(dep) == 0
    assert scrape.record_counters(dep, lambda: (7, 1)) == (7, 1)  # the replay reads Triton again
    assert scrape.record_counters(dep, lambda: (7, 1)) == (0, 0)  # a replay after the commit adds nothing
    assert served(dep) == 7 and TritonCounter.objects.get(deployment=dep).fail_count == 1


def _blocked_by_me() -> bool:
    """Another backend waits for a lock this connection holds (PostgreSQL)."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")  # pg_stat_activity is cached per transaction
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))")
        return cur.fetchone()[0] > 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="needs PostgreSQL's row locks and pg_blocking_pids")
@pytest.mark.parametrize("earlier", [None, 10], ids=["first-scrape", "later-scrape"])
def test_concurrent_scrapes_fold_their_readings_in_the_order_taken(lone_dep, earlier):
    """Two scrapes of one deployment at once (two workers on the node queue, -c 2, a replay next to the
    scheduled run): A takes its reading (11), B takes a newer one (12). When readings were taken before
    the counter row was locked, B could fold 12 and commit before A folded 11; A then saw the counter go
    down, took it for a server restart and added its 11 again (23 served for 12). Now Triton is read with
    the row locked, so B waits for A and reads after it."""
    dep = lone_dep
    if earlier is not None:
        scrape.record_counters(dep, lambda: (earlier, 0))
    seen: list = []
    b_done = threading.Event()

    def scrape_b():
        def read_b():
            seen.append("B reads 12")
            return 12, 0
        try:
            seen.append(("B adds", scrape.record_counters(dep, read_b)))
        finally:
            connection.close()
            b_done.set()

    b = threading.Thread(target=scrape_b)

    def read_a():
        b.start()  # B starts while A is reading; it must wait for A's lock (or it finished: the bug)
        wait_for(lambda: b_done.is_set() or _blocked_by_me(), 30, "scrape B to wait for A or finish")
        seen.append("A reads 11")
        return 11, 0

    added_a = scrape.record_counters(dep, read_a)
    b.join(30)
    assert not b.is_alive()
    assert served(dep) == 12 and TritonCounter.objects.get(deployment=dep).inference_count == 12
    assert added_a == (11 - (earlier or 0), 0)
    assert seen == ["A reads 11", "B reads 12", ("B adds", (1, 0))]


def test_execution_time_is_folded_like_the_counters(two):
    dep = two["a1"]
    hour_row = lambda: TritonServedHourly.objects.get(deployment=dep)  # noqa: E731
    assert scrape.record_counters(dep, lambda: (2, 0, 500)) == (2, 0)
    assert hour_row().execution_ns == 500
    scrape.record_counters(dep, lambda: (5, 0, 1_700))
    assert hour_row().execution_ns == 1_700 and TritonCounter.objects.get(deployment=dep).execution_ns == 1_700
    scrape.record_counters(dep, lambda: (5, 0, 1_700))  # nothing new
    assert hour_row().execution_ns == 1_700
    scrape.record_counters(dep, lambda: (1, 0, 100))  # restarted: all of it is new
    assert hour_row().execution_ns == 1_800 and served(dep) == 6


def test_what_was_served_before_removal_is_counted(two, members_a):
    dep = two["a1"]
    infer(dep, 4)
    scrape.scrape_node(two["node"].pk)
    infer(dep, 3)  # served after the last scrape, then the tenant removes the model
    deployments.remove(principal_for_user(members_a[Role.OWNER]), dep)
    deployments.unload(dep.pk)
    assert ModelDeployment.objects.get(pk=dep.pk).state == ModelDeployment.State.REMOVED
    assert served(dep) == 7
