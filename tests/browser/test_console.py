"""The operator console in a real browser: overview, slot maps, allocation history, release, suspend."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from marketplace.models import Allocation
from marketplace.services import orders
from tenants.models import Tenant
from tenants.scoping import principal_for_user
from tests.factories import OperatorFactory, TenantFactory
from tests.fleet_fixtures import make_tier
from tests.worker_process import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fleet(node_worker):
    """Two tenants with slices made active by the real node worker."""
    node, worker = node_worker
    op = OperatorFactory(email="ops@msp.example")
    t1 = make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb")
    t3 = make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb")
    acme = TenantFactory(slug="acme", name="Acme AI")
    blue = TenantFactory(slug="bluefin", name="Bluefin Labs")
    p = principal_for_user(op)
    orders.create_order(p, tenant=acme, tier=t1, quantity=3)
    orders.create_order(p, tenant=acme, tier=t3)
    orders.create_order(p, tenant=blue, tier=t1, quantity=2)
    wait_for(lambda: Allocation.objects.filter(state="active").count() == 6, 90, "6 active allocations", worker)
    return {"node": node, "worker": worker, "op": op, "acme": acme, "blue": blue}


def test_operator_console(page, live_server, login, shot, fleet):
    base = live_server.url
    login(page, fleet["op"].email)
    page.goto(f"{base}/console/")
    assert page.locator("h1").inner_text() == "Fleet overview"
    assert page.get_by_role("heading", name="Occupancy").is_visible()
    assert "9 / 64" in page.content()  # 3x1g + 3g (4 memory slices) + 2x1g on one H100 node
    shot(page, "console-overview")

    page.click("nav.mainnav >> text=Nodes & GPUs")
    page.wait_for_url(f"{base}/console/nodes/")
    assert page.locator(".slotmap").count() == 8
    assert page.locator(".slotmap span.used").count() == 6  # one cell per instance, spanning its slices
    assert page.locator(".slotmap span.used", has_text="acme").count() == 4
    assert page.locator(".slotmap span.used", has_text="3g.40gb").count() == 1
    servers = page.locator("table.servers tbody tr")  # one Triton server per active slice
    assert servers.count() == 6 and servers.filter(has_text="Running").count() == 6
    assert "127.0.0.1 http 20000" in page.locator("table.servers").inner_text()
    shot(page, "console-nodes")

    page.click("nav.mainnav >> text=Allocations")
    page.select_option("select[name=tenant]", "bluefin")
    page.click("form.filters button[type=submit]")  # htmx: the list alone is redrawn, the URL follows
    page.wait_for_url("**/console/allocations/?*tenant=bluefin*")
    expect(page.locator("table.data tbody tr")).to_have_count(2)
    shot(page, "console-allocations")

    target = Allocation.objects.filter(tenant=fleet["blue"]).order_by("pk").first()
    page.click(f"text=#{target.pk}")
    page.wait_for_url(f"{base}/console/allocations/{target.pk}/")
    history = page.locator("table.history").inner_text()
    for state in ("requested", "placed", "provisioning", "ready", "active"):
        assert state in history
    assert "its Triton server answers ready" in history
    assert page.locator("table.servers").inner_text().count("Running") == 1
    page.click("table.servers summary")  # the log tail
    assert "simulated tritonserver started" in page.locator("pre.log").inner_text()
    shot(page, "console-allocation")
    page.once("dialog", lambda d: d.accept())
    page.fill("input[name=reason]", "console test")
    page.click("#release")
    page.wait_for_url(f"{base}/console/allocations/{target.pk}/")
    assert "being released" in page.locator(".messages").inner_text()
    wait_for(lambda: Allocation.objects.get(pk=target.pk).state == "released", 60, "released", fleet["worker"])
    page.reload()
    assert page.locator("#alloc-state").inner_text() == "released"
    assert "console test" in page.locator("table.history").inner_text()
    shot(page, "console-allocation-released")

    page.click("nav.mainnav >> text=Tenants")
    page.wait_for_url(f"{base}/console/tenants/")
    shot(page, "console-tenants")
    page.click("text=Acme AI")
    page.fill("input[name=reason]", "unpaid invoice")
    page.once("dialog", lambda d: d.accept())
    page.click("#suspend")
    page.wait_for_load_state("networkidle")
    assert page.locator("#tenant-status").inner_text() == "suspended"
    assert Tenant.objects.get(pk=fleet["acme"].pk).status == "suspended"
    # a bad quota value: error shown, nothing saved
    page.fill("#id_max_slices_per_tier", "999")
    page.click("#save-quotas")
    page.wait_for_load_state("networkidle")
    assert "cannot exceed max_slices" in page.locator(".errorlist").inner_text()
    shot(page, "console-tenant")

    for name, path in (("invoices", "invoices/"), ("deployments", "deployments/"), ("charts", "charts/"),
                       ("tiers", "tiers/")):
        page.goto(f"{base}/console/{path}")
        assert page.locator("h1").is_visible()
        shot(page, f"console-{name}")
    page.click("a:text-is('h100-1g')")
    page.wait_for_load_state("networkidle")
    assert page.get_by_text("in force").first.is_visible()
    page.fill("#id_price_per_slice_hour", "-1")  # refused next to its field, nothing stored
    page.click("#add-plan")
    page.wait_for_load_state("networkidle")
    assert "greater than or equal to 0" in page.content()
    shot(page, "console-tier")


def test_capacity_planner(page, live_server, login, shot, catalog):
    op = OperatorFactory(email="planner@msp.example")
    make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb")
    make_tier("h200-whole", "h200-sxm-141gb", None)
    base = live_server.url
    login(page, op.email)
    page.click("nav.mainnav >> text=Planner")
    page.wait_for_url(f"{base}/console/planner/")
    assert "No demand measured in the window yet" in page.content()
    rows = [("chat-70b", "30000", "75"), ("embed", "2500", "8")]
    for i, (name, tps, gib) in enumerate(rows):
        page.fill(f"#id_w-{i}-name", name)
        page.fill(f"#id_w-{i}-tokens_per_s", tps)
        page.fill(f"#id_w-{i}-min_memory_gib", gib)
    page.select_option("#id_w-1-gpu_model", "h100-sxm-80gb")
    page.click("#run-plan")
    page.wait_for_load_state("networkidle")
    assert page.locator("#best-cost").inner_text().endswith("USD")
    assert page.locator("#scenarios tbody tr").count() == 4
    assert page.locator("#assignments tbody tr").count() == 2
    embed = page.locator("#assignments tbody tr", has_text="embed").inner_text()
    assert "h100-sxm-80gb/" in embed
    page.wait_for_selector("#plan-chart svg.main-svg")  # Plotly drew the figure (CSP allowed the script)
    assert page.locator("#plan-chart .bars path").count() >= 4
    shot(page, "console-planner")
    # a workload no GPU can hold: said plainly, the form kept
    page.fill("#id_w-0-min_memory_gib", "500")
    page.click("#run-plan")
    page.wait_for_load_state("networkidle")
    assert "chat-70b needs 500 GiB per replica" in page.locator(".msg.error").inner_text()
    assert page.locator("#id_w-0-name").input_value() == "chat-70b"
