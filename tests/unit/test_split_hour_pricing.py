"""Every token served is priced once (issue 29, item 2): an hour in which a plan starts after the hour's start (a
split hour) is priced from its usage events, each at the plan in force at its time; a plan may start in the past
over hours no finalized invoice holds, and the "unpriced" alert it covers resolves with the next rating."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from marketplace.models import BillingAlert, Invoice, PricePlan
from marketplace.services import billing, offers
from marketplace.services.billing import spread
from telemetry.services.ingest import store_rows
from tenants.errors import ServiceError
from tenants.scoping import principal_for_user
from tests.factories import (
    AllocationFactory,
    DeploymentFactory,
    InvoiceFactory,
    OrderFactory,
    PricePlanFactory,
    TenantFactory,
)

pytestmark = pytest.mark.django_db
D = Decimal
H = datetime(2026, 3, 10, 14, tzinfo=UTC)  # the hour in which plans start (a past month: back-dating is possible)
MARCH, APRIL = date(2026, 3, 1), date(2026, 4, 1)
M = 1_000_000
PRICES = {"price_per_slice_hour": "2.0000", "price_per_1m_input_tokens": "0.2000", "price_per_1m_output_tokens":
          "0.6000"}


@pytest.fixture
def served(catalog, tiers):
    """A tier with no plan, a tenant's deployment on it (active from the hour's half), and tokens served at 14:10
    (1M in, 2M out) and at 14:40 (3M in, 4M out), ingested as events (their hourly rollup: one row)."""
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).delete()
    t = TenantFactory(slug="split", currency="USD")
    a = AllocationFactory(order=OrderFactory(tenant=t, tier=tier), tenant=t, tier=tier, state="active",
                          activated_at=H + timedelta(minutes=30))
    dep = DeploymentFactory(allocation=a, tenant=t, name="gen", backend="python", spec={}, memory_mb=10, state="ready")
    store_rows(t.pk, [("before", dep.pk, H + timedelta(minutes=10), 1 * M, 2 * M, 1),
                      ("after", dep.pk, H + timedelta(minutes=40), 3 * M, 4 * M, 1)])
    return tier, t, dep


def token_lines(invoice: Invoice) -> dict[tuple[str, D], D]:
    """(kind, unit price) -> quantity of the invoice's token lines."""
    return {(li.kind, li.unit_price): li.quantity for li in invoice.lines.all()
            if li.kind in (billing.L.INPUT_TOKENS, billing.L.OUTPUT_TOKENS)}


def charted_tokens(tenant, start: datetime, end: datetime, now: datetime) -> D:
    return sum((x for (_t, _c, _tier, part, _b), x in spread.spread_amounts([tenant], start, end, now).money.items()
                if part == billing.TOKENS), D(0))


def test_tokens_of_the_hour_a_first_plan_starts_are_priced_from_its_start_then_by_a_backdated_plan(
        served, operator):
    tier, t, _dep = served
    PricePlanFactory(tier=tier, effective_from=H + timedelta(minutes=30))  # 0.5 in, 1.5 out per 1M
    now = H + timedelta(hours=2)
    invoice = billing.refresh(InvoiceFactory(tenant=t, period_start=MARCH), now)
    # the tokens served after the plan started are priced at it; those before have no price: alerted, not 0
    assert token_lines(invoice) == {("input_tokens", D("0.5000")): D(3), ("output_tokens", D("1.5000")): D(4)}
    assert invoice.total == D("1.50") + D("6.00") + D("3.00")  # 3M in, 4M out, 1.5 slice-hours at 2.00
    open_alert = BillingAlert.objects.get(tenant=t, kind=BillingAlert.Kind.UNPRICED, resolved_at__isnull=True)
    assert "tokens with no USD price" in open_alert.message
    assert charted_tokens(t, H, H + timedelta(hours=1), now) == D("7.5")
    with pytest.raises(billing.FinalizeBlocked):
        billing.finalize(invoice, now=datetime(2026, 4, 2, tzinfo=UTC))

    # the operator covers the unpriced minutes with a plan from the hour's start (no finalized invoice holds them)
    op = principal_for_user(operator)
    offers.add_price_plan(op, tier=tier, currency="USD", effective_from=H, **PRICES)
    invoice = billing.refresh(invoice, now)
    assert token_lines(invoice) == {("input_tokens", D("0.2000")): D(1), ("output_tokens", D("0.6000")): D(2),
                                    ("input_tokens", D("0.5000")): D(3), ("output_tokens", D("1.5000")): D(4)}
    assert invoice.total == D("0.20") + D("1.20") + D("1.50") + D("6.00") + D("3.00")
    assert billing.spend.of(t, now).spend == invoice.total
    assert charted_tokens(t, H, H + timedelta(hours=1), now) == D("0.2") + D("1.2") + D("7.5")
    resolved = BillingAlert.objects.get(pk=open_alert.pk)
    assert resolved.resolved_at is not None and "every use of 2026-03 has a USD price" in resolved.resolution
    assert not BillingAlert.objects.filter(tenant=t, resolved_at__isnull=True).exists()
    final = billing.finalize(invoice, now=datetime(2026, 4, 2, tzinfo=UTC))  # (held until the month's end)
    assert final.status == Invoice.Status.FINALIZED and token_lines(final) == token_lines(invoice)


def test_a_price_change_inside_an_hour_prices_each_token_at_its_time_and_late_tokens_at_the_hours_end(
        served, operator, as_user):
    tier, t, dep = served
    PricePlanFactory(tier=tier, effective_from=H - timedelta(days=3), **PRICES)
    PricePlanFactory(tier=tier, effective_from=H + timedelta(minutes=30))  # 0.5 in, 1.5 out
    invoice = billing.refresh(InvoiceFactory(tenant=t, period_start=MARCH), H + timedelta(hours=2))
    assert token_lines(invoice) == {("input_tokens", D("0.2000")): D(1), ("output_tokens", D("0.6000")): D(2),
                                    ("input_tokens", D("0.5000")): D(3), ("output_tokens", D("1.5000")): D(4)}
    month_end = datetime(2026, 4, 1, tzinfo=UTC)
    assert charted_tokens(t, datetime(2026, 3, 1, tzinfo=UTC), month_end, month_end) == D("8.9")
    final = billing.finalize(invoice, now=datetime(2026, 4, 2, tzinfo=UTC))
    assert token_lines(final) == token_lines(invoice)
    assert final.total == D("8.90") + D("2.00") * D("513.5")  # 513.5 slice-hours from 14:30 on the 10th

    # tokens of that hour arriving after March was finalized: on April's invoice, at the plan in force at the
    # hour's end (the events already billed and the late ones cannot be told apart in the hourly rollup)
    store_rows(t.pk, [("late", dep.pk, H + timedelta(minutes=5), 2 * M, 0, 1)])
    april = billing.refresh(InvoiceFactory(tenant=t, period_start=APRIL), datetime(2026, 4, 2, tzinfo=UTC))
    late = [li for li in april.lines.all() if li.kind == billing.L.ADJUSTMENT_INPUT]
    assert [(li.quantity, li.unit_price) for li in late] == [(D(2), D("0.5000"))]

    # a plan starting back over March's hours is refused, naming the finalized invoice; over April's it is not
    op_api = as_user(operator)
    body = {"tier": tier.key, "currency": "USD", **PRICES}
    r = op_api.post("/api/v1/price-plans/", {**body, "effective_from": (H - timedelta(days=1)).isoformat()})
    assert r.status_code == 400, r.content
    assert final.number in r.content.decode() and "finalized" in r.content.decode()
    r = op_api.post("/api/v1/price-plans/", {**body, "effective_from": "2026-04-01T00:00:00Z"})
    assert r.status_code == 201, r.content
    assert PricePlan.objects.filter(tier=tier).count() == 3


def test_backdating_is_refused_only_over_finalized_hours_of_that_tier_kind_and_currency(served, operator):
    tier, t, _dep = served
    PricePlanFactory(tier=tier, effective_from=H - timedelta(days=20), **PRICES)
    final = billing.finalize(billing.refresh(InvoiceFactory(tenant=t, period_start=MARCH), H + timedelta(hours=2)),
                             now=datetime(2026, 4, 2, tzinfo=UTC))
    op = principal_for_user(operator)
    with pytest.raises(ServiceError, match=final.number):
        offers.add_price_plan(op, tier=tier, currency="USD", effective_from=H - timedelta(days=1), **PRICES)
    # another currency, another kind, or hours after the finalized usage: nothing finalized is repriced
    offers.add_price_plan(op, tier=tier, currency="EUR", effective_from=H - timedelta(days=1), **PRICES)
    offers.add_price_plan(op, tier=tier, kind="reserved", monthly_commit=D("10.00"), currency="USD",
                          effective_from=H - timedelta(days=1), **PRICES)
    offers.add_price_plan(op, tier=tier, currency="USD", effective_from=datetime(2026, 4, 1, 0, 30, tzinfo=UTC),
                          **PRICES)
    assert PricePlan.objects.filter(tier=tier).count() == 4


def test_the_admin_shows_a_tiers_plans_read_only(client, tiers):
    """Plans are added where the back-dating rule is checked (console, API): the admin cannot add, edit or delete
    one (it could have moved a plan over finalized hours)."""
    from tests.factories import UserFactory

    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    tier = tiers["1g"]
    html = client.get(f"/admin/marketplace/tier/{tier.pk}/change/").content.decode()
    assert "0.1000" in html  # the plan's input price, shown
    assert 'name="plans-0-effective_from' not in html and 'name="plans-0-DELETE"' not in html
