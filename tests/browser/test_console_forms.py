"""The console's create forms, audit log and live lists in a real browser: a refused form keeps what was
typed and says what is wrong next to the field; created things show up in the audit log, filterable; the
overview's alerts and the allocations list follow the database (htmx) without a reload."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from marketplace.models import Allocation, Node, Order, Tier
from tenants.models import AuditEvent, Tenant
from tests.factories import OperatorFactory, TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_create_forms_and_audit_log(browser, page, live_server, login, shot, catalog, sim_dir):
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    base = live_server.url
    op = OperatorFactory(email="ops@msp.example")
    TenantFactory(slug="acme", name="Acme AI")
    login(page, op.email)

    page.goto(f"{base}/console/tenants/")
    page.click("#tenant-create")
    page.wait_for_url(f"{base}/console/tenants/new/")
    page.fill("#id_name", "Charlie Labs")
    page.fill("#id_slug", "acme")  # taken
    page.fill("#id_billing_email", "billing@charlie.example")
    page.fill("#id_owner_email", "cto@charlie.example")
    page.click("#create")
    field = page.locator(".field.has-error", has=page.locator("#id_slug"))
    assert "already exists" in field.inner_text()
    assert page.input_value("#id_name") == "Charlie Labs"  # nothing typed is lost
    shot(page, "console-tenant-create-error")
    assert Tenant.objects.count() == 1
    page.fill("#id_slug", "charlie")
    page.click("#create")
    page.wait_for_url(f"{base}/console/tenants/*/")
    assert "Tenant Charlie Labs created" in page.locator(".messages").inner_text()

    page.goto(f"{base}/console/tiers/new/")
    page.fill("#id_key", "h100-2g")
    page.fill("#id_name", "H100 2g.20gb")
    page.select_option("#id_gpu_model", label="H100 SXM 80GB")
    page.select_option("#id_profile", label="h100-sxm-80gb 2g.20gb")
    page.click("#create")
    page.wait_for_url(f"{base}/console/tiers/*/")
    assert Tier.objects.get(key="h100-2g").profile.name == "2g.20gb"

    page.goto(f"{base}/console/nodes/new/")
    page.fill("#id_hostname", "gpu-node-7")
    page.select_option("#id_platform", label="HGX H100 8-GPU (8x H100 SXM 80GB)")
    page.fill("#id_gpus", "GPU 0: NVIDIA H200 (UUID: GPU-00000000-aaaa-bbbb-cccc-000000000000)")
    page.click("#create")
    assert "but hgx-h100-8 has H100 SXM 80GB" in page.locator(".field.has-error").inner_text()
    shot(page, "console-node-create-error")
    page.fill("#id_gpus", "")  # the simulated backend discovers the GPUs
    page.click("#create")
    page.wait_for_url(f"{base}/console/nodes/*")
    assert Node.objects.get(hostname="gpu-node-7").gpus.count() == 8

    page.click("nav.mainnav >> text=Audit log")
    page.wait_for_url(f"{base}/console/audit/")
    rows = page.locator("table.audit tbody tr")
    assert rows.first.locator("code").inner_text() == "node.register"  # newest first
    assert rows.nth(1).locator("code").inner_text() == "tier.create"
    assert page.locator("table.audit", has_text="tenant.create").is_visible()
    shot(page, "console-audit")
    page.select_option("select[name=action]", "tenant.create")
    page.click("form.filters button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert rows.count() == AuditEvent.objects.filter(action="tenant.create").count() == 1
    assert "charlie" in rows.first.inner_text()
    shot(page, "console-audit-filtered")

    # live lists: the overview's alerts and the allocations list follow the database without a reload
    page.goto(f"{base}/console/")
    page.evaluate("window.notReloaded = true")
    alerts = page.locator("#live-alerts")
    assert "No failed allocations." in alerts.inner_text()
    tenant, tier = Tenant.objects.get(slug="charlie"), Tier.objects.get(key="h100-2g")
    failed = Allocation.objects.create(order=Order.objects.create(tenant=tenant, tier=tier), tenant=tenant, tier=tier,
                                       state="failed", failure_reason="GPU fell off the bus")
    expect(alerts).to_contain_text("GPU fell off the bus", timeout=12_000)
    assert page.evaluate("window.notReloaded") is True
    shot(page, "console-overview-live")
    page.goto(f"{base}/console/allocations/")
    page.evaluate("window.notReloaded = true")
    page.select_option("select[name=state]", "failed")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**/console/allocations/?*state=failed*")
    rows = page.locator("#live-list table.data tbody tr")
    expect(rows).to_have_count(1)
    Allocation.objects.filter(pk=failed.pk).update(state="released")
    expect(rows.first).to_contain_text("No allocations match", timeout=12_000)
    assert page.evaluate("window.notReloaded") is True
    shot(page, "console-allocations-live")
    assert [e for e in errors if "status of 400" not in e] == []

    phone = browser.new_context(viewport={"width": 390, "height": 844})
    pp = phone.new_page()
    login(pp, op.email)
    for path in ("tenants/new/", "tiers/new/", "nodes/new/", "audit/", "allocations/"):
        pp.goto(f"{base}/console/{path}")
        width = pp.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, (path, width)  # tables scroll inside their wrapper; forms wrap
        if path == "audit/":
            shot(pp, "console-audit-phone")
    phone.close()  # a refused form answers 400, by design
