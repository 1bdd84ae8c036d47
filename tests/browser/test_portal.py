"""The tenant portal in a real browser, against the live server and a real node worker: order a
slice and watch it become active, deploy tiny-gen and see it ready, create and revoke an API key,
see the usage chart, and find that another tenant's URLs are 404. Screenshots of each main page."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from marketplace.models import Allocation, ModelDeployment
from marketplace.services import billing
from tenants.roles import Role
from tests.billing_reference import rate_all
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_tier

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def portal_world(node_worker):
    alpha = TenantFactory(slug="alpha", name="Alpha Labs", monthly_spend_limit="500.00")
    bravo = TenantFactory(slug="bravo", name="Bravo")
    owner = MembershipFactory(tenant=alpha, role=Role.OWNER, user=UserFactory(email="owner@alpha.example")).user
    MembershipFactory(tenant=bravo, role=Role.OWNER, user=UserFactory(email="owner@bravo.example"))
    tiers = [make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb", hour="0.9000"),
             make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb", hour="2.7000"),
             make_tier("h100-7g", "h100-sxm-80gb", "7g.80gb", hour="6.5000")]
    # a slice and an invoice of the other tenant (to type their URLs)
    from marketplace.models import Order

    o = Order.objects.create(tenant=bravo, tier=tiers[0])
    b_slice = Allocation.objects.create(order=o, tenant=bravo, tier=tiers[0], state="failed")
    b_invoice = billing.current_invoice(bravo)
    return {"alpha": alpha, "owner": owner, "tiers": tiers, "b_slice": b_slice, "b_invoice": b_invoice}


def test_tenant_owner_journey(page, shot, login, live_server, portal_world, node_worker):
    base = live_server.url
    login(page, "owner@alpha.example")
    assert page.url.endswith("/portal/")
    shot(page, "portal-home")

    page.goto(f"{base}/portal/catalog/")
    card = page.locator("#tier-h100-3g")
    assert "2.70 USD" in card.inner_text()  # a unit price: the digits it needs, at least the cents
    assert card.locator(".availability").inner_text().strip() == "10+"  # 2 starts x 8 GPUs, shown up to 10
    shot(page, "portal-catalog")
    card.locator("button[type=submit]").click()
    page.wait_for_url(re.compile(r"/portal/slices/\d+/$"))
    # expect() polls from Playwright's own world: the page's CSP forbids wait_for_function's string eval.
    expect(page.locator("#slice-state")).to_have_text("active", timeout=60_000)
    page.wait_for_load_state("networkidle")
    page.locator("#slice-state").wait_for()
    assert page.locator("#slice-state").inner_text() == "active"
    history = page.locator("table.events").inner_text()
    for s in ["requested", "placed", "provisioning", "ready", "active"]:
        assert s in history
    shot(page, "portal-slice")

    # deploy tiny-gen from the slice page, see it become ready
    page.fill("#deploy-form input[name=name]", "tiny-gen")
    page.click("#deploy-form button[type=submit]")
    page.wait_for_url(re.compile(r"/portal/models/\d+/$"))
    dep_id = int(page.url.rstrip("/").split("/")[-1])
    expect(page.locator(f"#dep-state-{dep_id}")).to_have_text("ready", timeout=60_000)
    page.goto(f"{base}/portal/models/")
    assert "ready" in page.locator("table.data").inner_text()
    shot(page, "portal-models")

    # API key: the secret once, then revoke
    page.goto(f"{base}/portal/keys/")
    page.fill("#key-form input[name=name]", "ci pipeline")
    page.check("#key-form input[value='billing:read']")
    page.click("#key-form button[type=submit]")
    secret = page.locator(".secret").inner_text().strip()
    assert len(secret) > 20
    shot(page, "portal-key-created")
    page.click("text=Done")
    assert secret not in page.content()
    page.once("dialog", lambda d: d.accept())
    page.click("table.data button:has-text('revoke')")
    page.wait_for_load_state("networkidle")
    assert "revoked" in page.locator("table.data").inner_text()
    shot(page, "portal-keys")

    # usage: a day of hourly rows for the model, then the chart
    from telemetry.models import UsageHourly

    dep = ModelDeployment.objects.get(pk=dep_id)
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    for h in range(1, 49, 3):
        UsageHourly.objects.create(tenant=portal_world["alpha"], deployment=dep, hour=now - timedelta(hours=h),
                                   input_tokens=10_000 + 300 * h, output_tokens=4_000 + 50 * h,
                                   requests=40 + h, events=40 + h)
    page.goto(f"{base}/portal/usage/")
    page.wait_for_selector("#chart .main-svg")
    assert "No usage" not in page.locator("#usage-table").inner_text()
    shot(page, "portal-usage")

    rate_all()  # the rating beat: it opens and rates the month's draft (reads never write it)
    for name in ["slices", "members", "invoices"]:
        page.goto(f"{base}/portal/{name}/")
        shot(page, f"portal-{name}")
    page.click("table.data tbody a >> nth=0")  # the current draft invoice
    assert "Draft invoice" in page.locator("h1").inner_text()
    shot(page, "portal-invoice")

    # another tenant's objects: 404
    for url in [f"/portal/slices/{portal_world['b_slice'].pk}/", f"/portal/invoices/{portal_world['b_invoice'].pk}/",
                f"/portal/invoices/{portal_world['b_invoice'].pk}/csv/"]:
        resp = page.goto(base + url)
        assert resp.status == 404, url
