"""The portal's confirmations, key expiry and copy, reserved plans, usage by hour and a suspended tenant, in a real
browser against the live server (no node worker: nothing here provisions). Every destructive action asks first and
a dismissed dialog changes nothing. Screenshots: portal-members-confirm, portal-key-copied, portal-catalog-reserved,
portal-usage-day, portal-suspended."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from marketplace.models import Allocation, ModelDeployment, Order, PricePlan
from tenants import services as tenant_services
from tenants.models import ApiKey, Invitation, Membership
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_tier

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world(catalog):
    alpha = TenantFactory(slug="alpha", name="Alpha Labs")
    owner = MembershipFactory(tenant=alpha, role=Role.OWNER, user=UserFactory(email="owner@alpha.example")).user
    viewer = MembershipFactory(tenant=alpha, role=Role.VIEWER, user=UserFactory(email="viewer@alpha.example"))
    tier = make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb", hour="2.7000")
    PricePlan.objects.create(tier=tier, kind="reserved", currency="USD", price_per_slice_hour=Decimal("2.0000"),
                             price_per_1m_input_tokens=Decimal("0.08"), price_per_1m_output_tokens=Decimal("0.30"),
                             monthly_commit=Decimal("2000.00"), effective_from=timezone.now() - timedelta(days=1))
    order = Order.objects.create(tenant=alpha, tier=tier)
    alloc = Allocation.objects.create(order=order, tenant=alpha, tier=tier, state="active",
                                      activated_at=timezone.now() - timedelta(days=2))
    dep = ModelDeployment.objects.create(allocation=alloc, tenant=alpha, name="chat", backend="python", spec={},
                                         memory_mb=100, state="ready")
    tenant_services.invite(principal_for_user(owner), tenant=alpha, email="pat@alpha.example", role="member")
    return {"alpha": alpha, "owner": owner, "viewer": viewer, "alloc": alloc, "dep": dep}


def _answer(page, accept: bool, seen: list[str]):
    def handle(dialog):
        seen.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()
    page.once("dialog", handle)


def test_portal_confirmations_key_expiry_reserved_usage_and_suspension(page, shot, login, live_server, world):
    base = live_server.url
    login(page, "owner@alpha.example")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
    viewer = world["viewer"]

    # members: a dismissed role change, removal or revoke changes nothing; an accepted one goes through
    page.goto(f"{base}/portal/members/")
    seen: list[str] = []
    row = page.locator("tr", has_text="viewer@alpha.example")
    row.locator("select[name=role]").select_option("member")
    _answer(page, False, seen)
    row.locator("button:has-text('change')").click()
    _answer(page, False, seen)
    row.locator("button:has-text('remove')").click()
    _answer(page, False, seen)
    page.locator("tr", has_text="pat@alpha.example").locator("button:has-text('revoke')").click()
    assert seen == ["Change the role of viewer@alpha.example? Their access changes at once.",
                    "Remove viewer@alpha.example from Alpha Labs? They lose access at once.",
                    "Revoke the invitation for pat@alpha.example? Its link stops working."]
    viewer.refresh_from_db()
    assert viewer.role == Role.VIEWER and Invitation.objects.get(email="pat@alpha.example").revoked_at is None
    shot(page, "portal-members-confirm")
    _answer(page, True, seen)
    page.locator("tr", has_text="viewer@alpha.example").locator("button:has-text('remove')").click()
    expect(page.locator(".msg.success")).to_contain_text("viewer@alpha.example removed")
    assert not Membership.objects.filter(pk=viewer.pk).exists()

    # removing a model asks too
    page.goto(f"{base}/portal/models/{world['dep'].pk}/")
    _answer(page, False, seen)
    page.click("#remove-model")
    assert seen[-1].startswith("Remove chat? It is unloaded from slice #")
    world["dep"].refresh_from_db()
    assert world["dep"].state == "ready"

    # a key with an expiry; the new secret has a copy button
    day = (timezone.now() + timedelta(days=90)).date()
    page.goto(f"{base}/portal/keys/")
    page.fill("#key-form input[name=name]", "ci")
    page.fill("#key-form input[name=expires_on]", day.isoformat())
    shot(page, "portal-keys-expiry")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-expires")).to_have_text(f"{day:%Y-%m-%d} 00:00 UTC")
    page.click("#copy-secret")
    expect(page.locator("#copy-status")).to_have_text("Copied to the clipboard.")
    assert page.locator("#copy-secret").inner_text() == "Copied"
    shot(page, "portal-key-copied")
    assert ApiKey.objects.get(name="ci").expires_at.date() == day

    # the catalog offers the reserved plan with its monthly estimate
    page.goto(f"{base}/portal/catalog/")
    card = page.locator("#tier-h100-3g")
    assert "2,000.00 USD" in card.locator(".estimate").inner_text()
    shot(page, "portal-catalog-reserved")

    # usage of the last day, by hour, the current hour marked, per model and slice
    from telemetry.models import UsageHourly

    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for h in range(0, 20, 2):
        UsageHourly.objects.create(tenant=world["alpha"], deployment=world["dep"], hour=hour - timedelta(hours=h),
                                   input_tokens=12_000 + 900 * h, output_tokens=3_000 + 100 * h, requests=40 + h,
                                   events=40 + h)
    page.goto(f"{base}/portal/usage/?days=1")
    page.wait_for_selector("#chart .main-svg")
    assert "Hour (UTC)" in page.locator("#usage-table").inner_text()
    assert "partial" in page.locator("#usage-table tbody tr >> nth=0").inner_text()
    assert "chat" in page.locator("#usage-by-model").inner_text()
    shot(page, "portal-usage-day")

    # suspended: the owner reads the operator's reason, not a role message
    op = OperatorFactory(email="ops@msp.example")
    tenant_services.suspend_tenant(principal_for_user(op), world["alpha"], reason="invoice 2026-0042 is overdue")
    page.goto(f"{base}/portal/catalog/")
    expect(page.locator("#suspended-reason")).to_have_text("invoice 2026-0042 is overdue")
    assert "Your role" not in page.locator("main").inner_text()
    shot(page, "portal-suspended")
