"""Catalog pages in a real browser: a tier shows the server platforms it runs on (console tier detail
with sourced specs, portal catalog card)."""

from __future__ import annotations

import pytest

from tenants.roles import Role
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_node, make_tier

pytestmark = pytest.mark.django_db(transaction=True)


def test_tier_shows_its_platform(page, live_server, login, shot, catalog):
    make_node("xe-01", "dell-xe9680-h100")
    tier = make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb", hour="2.7000")
    OperatorFactory(email="ops@msp.example")
    alpha = TenantFactory(slug="alpha", name="Alpha Labs")
    MembershipFactory(tenant=alpha, role=Role.OWNER, user=UserFactory(email="owner@alpha.example"))

    login(page, "ops@msp.example")
    page.goto(f"{live_server.url}/console/tiers/{tier.pk}/")
    section = page.locator("#platforms")
    xe = section.locator('[data-platform="dell-xe9680-h100"]')
    assert "Dell PowerEdge XE9680" in xe.inner_text() and "1 node" in xe.inner_text()
    assert "NVLink" in xe.inner_text() and "19,200 W" in xe.inner_text()
    assert xe.locator("a.source").get_attribute("href").startswith("https://")
    assert section.locator('[data-platform="smc-821ge-tnhr-h100"]').count() == 1  # in the catalog, no node
    shot(page, "console-tier-platforms")

    page.context.clear_cookies()
    login(page, "owner@alpha.example")
    page.goto(f"{live_server.url}/portal/catalog/")
    card = page.locator("#tier-h100-3g")
    assert "Dell PowerEdge XE9680" in card.inner_text()
    assert card.locator('[data-platform="smc-821ge-tnhr-h100"]').count() == 0  # only what the fleet has
    shot(page, "portal-catalog-platforms")


def test_tiers_and_prices_is_a_comparable_table(page, browser, live_server, login, shot, catalog):
    from decimal import Decimal

    from django.utils import timezone

    from marketplace.models import PricePlan

    profiles = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    for name in profiles:
        t = make_tier(f"h100-{name}", "h100-sxm-80gb", name, hour="1.2500")
        for cur in ("EUR", "GBP"):
            PricePlan.objects.create(tier=t, currency=cur, price_per_slice_hour=Decimal("1.1500"),
                                     price_per_1m_input_tokens=Decimal("0.10"),
                                     price_per_1m_output_tokens=Decimal("0.40"),
                                     effective_from=timezone.now())
        PricePlan.objects.create(tier=t, kind="reserved", currency="USD", price_per_slice_hour=Decimal("0.9000"),
                                 price_per_1m_input_tokens=Decimal("0.08"), price_per_1m_output_tokens=Decimal("0.32"),
                                 monthly_commit=Decimal("1500.00"), effective_from=timezone.now())
    OperatorFactory(email="ops@msp.example")
    login(page, "ops@msp.example")
    page.goto(f"{live_server.url}/console/tiers/")
    assert page.locator("table.prices thead th").count() == 4 + 7 + 1
    assert page.locator("tbody.currency").count() == 3
    usd = page.locator('tbody[data-currency="USD"] tr[data-tier="h100-3g.40gb"]')
    assert "1,500.00" in usd.inner_text()
    shot(page, "console-tiers-table")

    phone = browser.new_context(viewport={"width": 390, "height": 844})
    pp = phone.new_page()
    login(pp, "ops@msp.example")
    pp.goto(f"{live_server.url}/console/tiers/?currency=USD")
    assert pp.locator("tbody.currency").count() == 1
    height = pp.evaluate("document.documentElement.scrollHeight")
    width = pp.evaluate("document.documentElement.scrollWidth")
    assert height < 2000, height  # 6 tiers: rows, not a stack of cards
    assert width <= 390, width  # the table scrolls inside its wrapper
    shot(pp, "console-tiers-table-phone")
    phone.close()


def test_model_pages_show_requests_tokens_errors_latency(page, live_server, login, shot, catalog):
    from tests.unit.test_model_traffic import _dep, _traffic

    tier = make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb")
    alpha = TenantFactory(slug="alpha", name="Alpha Labs")
    MembershipFactory(tenant=alpha, role=Role.OWNER, user=UserFactory(email="owner@alpha.example"))
    dep = _dep(alpha, tier, "support-bot")
    _traffic(dep, 0, 42, failures=2, latencies=[180, 220])
    _traffic(dep, 30, 1500, failures=5)
    _dep(alpha, tier, "idle-model")

    login(page, "owner@alpha.example")
    page.goto(f"{live_server.url}/portal/models/")
    row = page.locator("table.data tbody tr", has_text="support-bot")
    assert row.locator(".traffic-requests").inner_text() == "42"
    assert row.locator(".traffic-errors").inner_text() == "2"
    assert "200 ms" in row.inner_text()
    shot(page, "portal-models-traffic")

    page.click("text=support-bot")
    week = page.locator('#model-traffic tr[data-window="7 d"]')
    assert "1,542" in week.inner_text() and "0.5 %" in week.inner_text()  # 7 errors of 1,549
    shot(page, "portal-model-traffic")
