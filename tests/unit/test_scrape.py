"""The Triton statistics scraper against the simulated Triton server, and metered vs served."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.db.models import Sum
from django.utils import timezone

from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning
from telemetry import selectors, tasks
from telemetry.models import TritonCounter, TritonServedHourly
from telemetry.services import ingest, scrape
from tenants.roles import Role
from tenants.scoping import principal_for_key, principal_for_user

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
    assert found == {"deployments": 3, "requests": 7, "failures": 0, "errors": 0}
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
    ingest.ingest_batch(principal_for_key(world["key_a"]), world["a"], events)
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
