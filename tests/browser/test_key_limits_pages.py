"""Gateway limits in a real browser: an operator sets a tenant's key ceiling and concurrency on the console's tenant
page; the tenant's admin sees the ceiling on the portal's API keys page and saves a key's limits in its row."""

from __future__ import annotations

import pytest

from tenants.models import ApiKey, Tenant
from tenants.roles import Role
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_operator_sets_ceilings_and_a_tenant_admin_sets_a_key(page, shot, login, live_server):
    alpha = TenantFactory(slug="alpha", name="Alpha Labs")
    admin = MembershipFactory(tenant=alpha, role=Role.ADMIN, user=UserFactory(email="admin@alpha.example")).user
    OperatorFactory(email="op@msp.example")
    key, _ = make_key(alpha, ["inference"], created_by=admin, name="team-a")
    base = live_server.url

    login(page, "op@msp.example")
    page.goto(f"{base}/console/tenants/{alpha.pk}/")
    page.fill("#id_max_concurrent_requests", "12")
    page.fill("#id_max_key_requests_per_minute", "90")
    page.click("form:has(#id_max_concurrent_requests) button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert "Quotas and limits saved" in page.content()
    shot(page, "console-tenant-limits")
    alpha.refresh_from_db()
    assert (alpha.max_concurrent_requests, alpha.max_key_requests_per_minute) == (12, 90)
    assert ApiKey.objects.get(pk=key.pk).requests_per_minute == 90  # an empty key, the ceiling below the default

    page.context.clear_cookies()
    login(page, "admin@alpha.example")
    page.goto(f"{base}/portal/keys/")
    assert "at most 90" in page.locator("#key-form").inner_text()
    row = page.locator("table.data tr", has_text="team-a")
    row.locator("input[name=requests_per_minute]").fill("45")
    row.locator("input[name=tokens_per_minute]").fill("20000")
    row.locator("button:has-text('save')").click()
    page.wait_for_load_state("networkidle")
    assert "Limits of team-a" in page.content()
    shot(page, "portal-key-limits")
    key.refresh_from_db()
    assert (key.requests_per_minute, key.tokens_per_minute) == (45, 20000)
    assert Tenant.objects.get(pk=alpha.pk).max_concurrent_requests == 12
