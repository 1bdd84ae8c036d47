"""One rating (issue 14): the tenant-usage and per-tier charts and the planner's list price use the
invoices' own rating: a reserved commitment's top-up is in the chart as on the invoice, and a tenant
billed in EUR is charted in EUR at its EUR prices, not on a USD axis."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from marketplace.models import ModelDeployment, PricePlan
from marketplace.services import billing
from telemetry import charts
from tenants.scoping import Principal
from tests.billing_reference import rated_lines_many
from tests.factories import (
    AllocationFactory,
    DeploymentFactory,
    InvoiceFactory,
    OrderFactory,
    PricePlanFactory,
    TenantFactory,
    UsageHourlyFactory,
)

pytestmark = pytest.mark.django_db
D = Decimal
T0 = datetime(2026, 10, 1, tzinfo=UTC)
NOV1 = datetime(2026, 11, 1, tzinfo=UTC)
OPERATOR = Principal(is_operator=True)
TINY = D("1e-20")


@pytest.fixture
def reserved_tenant(catalog, tiers):
    tier = tiers["3g"]
    since = T0 - timedelta(days=30)
    PricePlan.objects.filter(tier=tier).update(effective_from=since, price_per_slice_hour=D("2.0000"))
    PricePlanFactory(tier=tier, kind="reserved", currency="USD", effective_from=since,
                     price_per_slice_hour=D("1.0000"), price_per_1m_input_tokens=D("0.2500"),
                     price_per_1m_output_tokens=D("0.7500"), monthly_commit=D("1000.00"))
    PricePlanFactory(tier=tier, kind="on_demand", currency="EUR", effective_from=since,
                     price_per_slice_hour=D("1.8000"), price_per_1m_input_tokens=D("0.4000"),
                     price_per_1m_output_tokens=D("1.2000"))
    t = TenantFactory(slug="resv", currency="USD")
    order = OrderFactory(tenant=t, tier=tier, plan_kind="reserved")
    a = AllocationFactory(order=order, tenant=t, tier=tier, state="active", activated_at=T0,
                          released_at=T0 + timedelta(days=10))
    dep = DeploymentFactory(allocation=a, tenant=t, name="llm", backend="python", spec={},
                            memory_mb=10, state="ready")
    UsageHourlyFactory(tenant=t, deployment=dep, hour=T0 + timedelta(hours=5), input_tokens=4_000_000,
                       output_tokens=1_000_000, requests=10)
    return t, tier


def test_tenant_usage_chart_equals_the_invoice_with_a_reserved_commitment(reserved_tenant):
    t, _ = reserved_tenant
    inv = billing.finalize(billing.draft_for(t, date(2026, 10, 1)), now=datetime(2026, 11, 2, tzinfo=UTC))
    assert inv.lines.filter(kind="commitment_topup").exists()
    _, numbers = charts.tenant_usage(charts.period({"start": T0.isoformat(), "end": NOV1.isoformat()}), OPERATOR,
                                     {"bucket": "day"})
    row = numbers["tenants"]["resv"]
    assert row["total"] == inv.total and row["currency"] == "USD"
    assert sum(row["spend"]) == pytest.approx(inv.total, abs=D("0.01") * len(row["spend"]))


def test_a_eur_tenant_is_charted_in_eur_at_eur_prices(reserved_tenant):
    _, tier = reserved_tenant
    eur = TenantFactory(slug="euro", currency="EUR")
    order = OrderFactory(tenant=eur, tier=tier)
    AllocationFactory(order=order, tenant=eur, tier=tier, state="active", activated_at=T0,
                      released_at=T0 + timedelta(hours=10))
    InvoiceFactory(tenant=eur, period_start=date(2026, 10, 1), period_end=date(2026, 11, 1), currency="EUR")
    per = charts.period({"start": T0.isoformat(), "end": NOV1.isoformat()})
    _, numbers = charts.tenant_usage(per, OPERATOR, {"bucket": "day", "tenant": "euro"})
    row = numbers["tenants"]["euro"]
    assert row["currency"] == "EUR" and numbers["currency"] == "EUR"
    assert row["total"] == D("18.00")  # 10 h x 1.80 EUR
    fig, both = charts.tenant_usage(per, OPERATOR, {"bucket": "day"})
    # amounts in different currencies never share an axis: one spend panel each, the lines in their own
    assert both["currencies"] == ["EUR", "USD"] and both["currency"] is None
    assert [a["text"] for a in fig["layout"]["annotations"]] == ["tokens", "spend (EUR)", "spend (USD)"]
    lines = {t["name"]: t["yaxis"] for t in fig["data"] if t["type"] == "scatter"}
    assert lines["euro"] == "y2" and lines[next(n for n in lines if n != "euro")] == "y3"
    bars = {t["name"]: t["marker"]["color"] for t in fig["data"] if t["type"] == "bar"}
    assert all(t["line"]["color"] == bars[t["name"]] for t in fig["data"] if t["type"] == "scatter")
    usd = charts.tier_spend(per)
    eur_per = charts.period({"start": T0.isoformat(), "end": NOV1.isoformat(), "currency": "EUR"})
    assert charts.tier_spend(eur_per)[tier.pk]["slice_amount"] == D("18.00")
    assert usd[tier.pk]["commitment_amount"] > 0  # the reserved tenant's top-up counts in USD only


def test_planner_list_price_is_the_ratings_prices(reserved_tenant):
    _, tier = reserved_tenant
    plan = billing.PlanBook("USD").at(tier.pk, "on_demand", datetime.now(UTC))
    # 2 slices for an hour + 1M tokens (half input at 0.10, half output at 0.40 per 1M): 4.00 + 0.25
    assert billing.list_price_per_hour(plan, 2, 1_000_000, 0.5) == pytest.approx(4.25)


def test_charts_spread_the_same_money_as_the_invoices_lines(reserved_tenant, tiers):
    """spread_amounts (the charts': token money priced from the database's sums, slice-hours swept per tenant)
    gives every range and bucket the same amounts as rated_lines_many (the invoices' lines, each deployment's):
    with a price change inside the range, a reserved plan's top-up, a tenant billed in EUR, and ranges cutting
    hours at both edges."""
    t, tier = reserved_tenant
    other = TenantFactory(slug="ondemand", currency="USD")
    on_demand = OrderFactory(tenant=other, tier=tier, plan_kind="on_demand")
    a = AllocationFactory(order=on_demand, tenant=other, tier=tier, state="active", activated_at=T0)
    # a price change inside the range
    base = PricePlan.objects.get(tier=tier, kind="on_demand", currency="USD")
    PricePlanFactory(tier=tier, kind="on_demand", currency="USD", effective_from=T0 + timedelta(hours=30),
                     price_per_slice_hour=D("2.5000"), price_per_1m_input_tokens=D("0.7000"),
                     price_per_1m_output_tokens=base.price_per_1m_output_tokens + D("0.0300"))
    deps = [DeploymentFactory(allocation=a, tenant=other, name=f"m{i}", backend="python", spec={},
                              memory_mb=10, state="ready") for i in range(3)]
    resv_dep = ModelDeployment.objects.get(tenant=t)
    for h in range(0, 60):
        for i, dep in enumerate(deps):
            if (h + i) % 3:
                UsageHourlyFactory(tenant=other, deployment=dep, hour=T0 + timedelta(hours=h),
                                   adapter="chat" if i == 2 and h % 2 else "",
                                   input_tokens=1_000 * (h + 1) + 17 * i, output_tokens=333 * (i + 1) + h,
                                   requests=3)
        if h % 4 == 2:
            UsageHourlyFactory(tenant=t, deployment=resv_dep, hour=T0 + timedelta(hours=h),
                               input_tokens=70_001 + h, output_tokens=9_999, requests=1)
    # a tenant billed in EUR (its October invoice's currency), at the EUR plan
    eur = TenantFactory(slug="eur-od", currency="USD")
    InvoiceFactory(tenant=eur, period_start=date(2026, 10, 1), period_end=date(2026, 11, 1), currency="EUR")
    eur_alloc = AllocationFactory(order=OrderFactory(tenant=eur, tier=tier), tenant=eur, tier=tier,
                                  state="active", activated_at=T0 + timedelta(hours=1, minutes=7))
    eur_dep = DeploymentFactory(allocation=eur_alloc, tenant=eur, name="e", backend="python", spec={},
                                memory_mb=10, state="ready")
    for h in range(1, 50, 3):
        UsageHourlyFactory(tenant=eur, deployment=eur_dep, hour=T0 + timedelta(hours=h),
                           input_tokens=123_457 * h, output_tokens=5_003, requests=2)
    tenants = [t, other, eur]
    now = T0 + timedelta(days=40)
    for start, end in ((T0 + timedelta(hours=2, minutes=20), T0 + timedelta(hours=41, minutes=35)),
                       (T0 - timedelta(days=3), T0 + timedelta(days=33)),
                       (T0 + timedelta(hours=29), T0 + timedelta(hours=31)),
                       # the edge hour before the range is a day bucket's first hour: still its own piece
                       (T0 + timedelta(minutes=30), T0 + timedelta(days=1, minutes=30))):
        exact = rated_lines_many(tenants, start, end, now)
        spread = billing.spread_amounts(tenants, start, end, now)  # what tier_spend and tenant_usage read
        for tid in (t.pk, other.pk, eur.pk):
            want = sum(billing.amount_between(d, start, end) for d, _ in exact[tid])
            assert want != 0
            assert abs(sum(x for k, x in spread.money.items() if k[0] == tid) - want) < TINY
            assert {cur for d, cur in exact[tid]} == {k[1] for k in spread.money if k[0] == tid}
        for step in (timedelta(hours=1), timedelta(days=1)):
            exact = rated_lines_many(tenants, start, end, now, step=int(step.total_seconds()))
            spread = billing.spread_amounts(tenants, start, end, now, step=int(step.total_seconds()), by_tier=False)
            for tid in (t.pk, other.pk, eur.pk):
                want: dict[datetime, Decimal] = defaultdict(Decimal)
                for d, _ in exact[tid]:
                    for b, x in billing.amount_by_bucket(d, start, end, step).items():
                        want[b] += x
                assert any(want.values())
                charted: dict[datetime, Decimal] = defaultdict(Decimal)
                for (who, _cur, _tier, _part, b), x in spread.money.items():
                    if who == tid:
                        charted[b] += x
                assert all(abs(charted[b] - want[b]) < TINY for b in set(want) | set(charted))
