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
