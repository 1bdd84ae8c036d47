"""Reserved plans' monthly commitment: a "commitment top-up" line when the month's charges at a
reserved plan fall short of its commitment, pro-rated by the time reserved capacity was held
(start, release, price change), once per plan however often a draft is re-rated, settled for good
when the month is finalized, never owed by tenants without reserved capacity.

Expected figures are computed here independently of the rating code: exact fractions of the
month, rounded half-up to the cent once."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest
from django.urls import reverse

from marketplace.models import Invoice, PricePlan
from marketplace.services import billing
from telemetry.models import UsageHourly
from tenants.roles import Role
from tests.factories import (
    AllocationFactory,
    DeploymentFactory,
    MembershipFactory,
    OrderFactory,
    PricePlanFactory,
    TenantFactory,
    UsageHourlyFactory,
    make_key,
)

pytestmark = pytest.mark.django_db
D = Decimal
OCT = date(2026, 10, 1)
NOV = date(2026, 11, 1)
T0 = datetime(2026, 10, 1, tzinfo=UTC)
NOV1 = datetime(2026, 11, 1, tzinfo=UTC)
DEC1 = datetime(2026, 12, 1, tzinfo=UTC)
OCT_HOURS = 31 * 24
TOPUP = "commitment_topup"


def cents(x: Fraction | int) -> Decimal:
    """Round an exact figure half-up to the cent (independent of billing.money)."""
    return (D(x.numerator) / D(x.denominator) if isinstance(x, Fraction) else D(x)).quantize(
        D("0.01"), rounding=ROUND_HALF_UP)


def fraction_of_october(a: datetime, b: datetime) -> Fraction:
    return Fraction(int((b - a).total_seconds()), OCT_HOURS * 3600)


@pytest.fixture
def shop(catalog, tiers):
    """Tier 3g: on-demand at 2.00/h (0.50 / 1.50 per 1M tokens) and reserved at 1.00/h (0.25 / 0.75
    per 1M tokens) with a 1000.00 monthly commitment, both in force since September."""
    tier = tiers["3g"]
    since = T0 - timedelta(days=30)
    PricePlan.objects.filter(tier=tier).update(effective_from=since, price_per_slice_hour=D("2.0000"),
                                               price_per_1m_input_tokens=D("0.5000"),
                                               price_per_1m_output_tokens=D("1.5000"))
    reserved = PricePlanFactory(tier=tier, kind="reserved", currency="USD", effective_from=since,
                                price_per_slice_hour=D("1.0000"), price_per_1m_input_tokens=D("0.2500"),
                                price_per_1m_output_tokens=D("0.7500"), monthly_commit=D("1000.00"))

    def allocation(tenant, kind, active_from, released=None, state="active"):
        order = OrderFactory(tenant=tenant, tier=tier, plan_kind=kind)
        return AllocationFactory(order=order, tenant=tenant, tier=tier, state=state,
                                 activated_at=active_from, released_at=released)

    return tier, reserved, allocation


def deployment(alloc, name="llm"):
    return DeploymentFactory(allocation=alloc, tenant=alloc.tenant, name=name, backend="python",
                             spec={}, memory_mb=10, state="ready")


def usage(tenant, dep, hour, i, o):
    return UsageHourlyFactory(tenant=tenant, deployment=dep, hour=hour, input_tokens=i, output_tokens=o,
                              requests=1)


def rate_october(tenant, now=NOV1 + timedelta(days=4)):
    return billing.refresh(billing.draft_for(tenant, OCT), now=now)


def topups(inv: Invoice):
    return list(inv.lines.filter(kind=TOPUP).order_by("usage_from"))


def test_usage_below_commitment_is_topped_up_to_it(shop, as_key, client, operator):
    tier, reserved, allocation = shop
    tenant = TenantFactory(slug="acme")
    res = allocation(tenant, "reserved", T0)  # held the whole month: 744 h at 1.00 = 744.00
    dep = deployment(res)
    usage(tenant, dep, T0 + timedelta(hours=5), 2_000_000, 1_000_000)  # 0.50 + 0.75 at the reserved rates
    od = allocation(tenant, "on_demand", T0, T0 + timedelta(hours=10))  # 20.00: never counts toward it
    usage(tenant, deployment(od, "od"), T0 + timedelta(hours=1), 1_000_000, 0)  # 0.50 on demand: neither
    inv = rate_october(tenant)
    lines = list(inv.lines.all())
    assert inv.total == sum(li.amount for li in lines)
    [top] = topups(inv)
    charged_reserved = D(OCT_HOURS) * D("1.00") + D("0.50") + D("0.75")
    assert top.amount == D("1000.00") - charged_reserved == D("254.75")
    assert (top.quantity, top.unit, top.unit_price) == (D(1), "top-up", D("254.75"))
    assert top.plan == reserved and top.tier == tier and top.allocation is None and top.deployment is None
    assert (top.usage_from, top.usage_to) == (T0, NOV1)
    assert "1000.00" in top.description and "254.75" not in top.description
    # the reserved plan's lines plus its top-up are exactly the commitment
    assert sum(li.amount for li in lines if li.plan_id == reserved.pk) == D("1000.00")
    assert inv.total == D("1000.00") + D("20.00") + D("0.50")

    # exports and pages show it
    _, key = make_key(tenant, ["billing:read"])
    api = as_key(key)
    text = api.get(f"/api/v1/invoices/{inv.pk}/export/?format=csv").content.decode()
    rows = text.strip().splitlines()
    total = next(i for i, r in enumerate(rows) if r.startswith("total,"))
    assert rows[total - 1].startswith("commitment_topup,h100-3g,,") and ",254.75," in rows[total - 1]  # after usage
    assert "1020.50" in rows[total]
    # then the charges per key: the tokens (no key in this test's usage) and the rest (capacity, the top-up)
    assert rows[total + 1].startswith("by_key,") and rows[-2] == "key,,,3000000,1000000,1.75"
    assert rows[-1] == "not_per_key,,,,,1018.75"
    js = json.loads(api.get(f"/api/v1/invoices/{inv.pk}/export/?format=json").content)
    assert [li["amount"] for li in js["lines"] if li["kind"] == TOPUP] == ["254.75"]
    assert D(js["total"]) == sum(D(li["amount"]) for li in js["lines"])
    client.force_login(operator)
    html = client.get(reverse("console:invoice_detail", args=[inv.pk])).content.decode()
    assert "Commitment top-up" in html and "254.75" in html
    client.force_login(MembershipFactory(tenant=tenant, role=Role.BILLING).user)
    html = client.get(reverse("portal:invoice", args=[inv.pk])).content.decode()
    assert "Commitment top-up" in html and "254.75" in html and "1,020.50 USD" in html  # money: separators, currency


@pytest.mark.parametrize(("commit", "expected"), [("744.00", None), ("700.00", None), ("744.01", "0.01"),
                                                  ("0.00", None)])
def test_no_topup_when_charges_reach_the_commitment(shop, commit, expected):
    tier, reserved, allocation = shop
    PricePlan.objects.filter(pk=reserved.pk).update(monthly_commit=D(commit))
    tenant = TenantFactory()
    allocation(tenant, "reserved", T0)  # 744.00 of reserved slice-hours
    inv = rate_october(tenant)
    assert [li.amount for li in topups(inv)] == ([] if expected is None else [D(expected)])
    assert inv.total == sum(li.amount for li in inv.lines.all()) == max(D("744.00"), D(commit))


def test_mid_month_start_and_release_pro_rated_by_time_held(shop):
    tier, reserved, allocation = shop
    PricePlan.objects.filter(pk=reserved.pk).update(price_per_slice_hour=D("0.5000"))
    tenant = TenantFactory()
    a1_from, a1_to = T0 + timedelta(days=9, hours=12), T0 + timedelta(days=19, hours=18)  # 246 h
    a2_from, a2_to = T0 + timedelta(days=14), T0 + timedelta(days=24)  # 240 h, overlapping a1
    allocation(tenant, "reserved", a1_from, a1_to)
    allocation(tenant, "reserved", a2_from, a2_to, state="released")
    inv = rate_october(tenant)
    # held: the union Oct 10 12:00 -> Oct 25 00:00 (two slices at once owe one commitment)
    held = fraction_of_october(a1_from, a2_to)
    assert held == Fraction(int(14.5 * 24), OCT_HOURS)
    owed = cents(1000 * held)  # 467.74
    charged = cents(Fraction(246 + 240, 2))  # 486 h at 0.50
    [top] = topups(inv)
    assert top.amount == owed - charged == D("224.74")
    assert (top.usage_from, top.usage_to) == (a1_from, a2_to)
    assert inv.total == sum(li.amount for li in inv.lines.all()) == owed


def test_price_change_mid_month_pro_rates_each_plan(shop):
    tier, reserved, allocation = shop
    change = T0 + timedelta(days=15)
    new = PricePlanFactory(tier=tier, kind="reserved", currency="USD", effective_from=change,
                           price_per_slice_hour=D("1.5000"), price_per_1m_input_tokens=D("0.2500"),
                           price_per_1m_output_tokens=D("0.7500"), monthly_commit=D("1240.00"))
    tenant = TenantFactory()
    allocation(tenant, "reserved", T0)
    inv = rate_october(tenant)
    old_owed = cents(1000 * fraction_of_october(T0, change))  # 15 of 31 days: 483.87
    new_owed = cents(1240 * fraction_of_october(change, NOV1))  # 16 of 31 days: 640.00
    old_charged, new_charged = D(15 * 24) * D(1), D(16 * 24) * D("1.5")  # 360.00, 576.00
    by_plan = {li.plan_id: li for li in topups(inv)}
    assert set(by_plan) == {reserved.pk, new.pk}
    assert by_plan[reserved.pk].amount == old_owed - old_charged == D("123.87")
    assert by_plan[new.pk].amount == new_owed - new_charged == D("64.00")
    assert (by_plan[reserved.pk].usage_from, by_plan[reserved.pk].usage_to) == (T0, change)
    assert (by_plan[new.pk].usage_from, by_plan[new.pk].usage_to) == (change, NOV1)
    assert inv.total == sum(li.amount for li in inv.lines.all()) == old_owed + new_owed


def test_rerating_a_draft_keeps_one_topup_per_plan(shop):
    tier, reserved, allocation = shop
    tenant = TenantFactory()
    allocation(tenant, "reserved", T0)
    mid = T0 + timedelta(days=10)
    first = billing.refresh(billing.draft_for(tenant, OCT), now=mid)
    again = billing.refresh(billing.draft_for(tenant, OCT), now=mid)
    [top] = topups(again)
    # month to date: 10 of 31 days held -> 322.58 owed, 240 h at 1.00 charged
    assert top.amount == cents(1000 * Fraction(10, 31)) - D(240) == D("82.58")
    assert again.total == first.total == sum(li.amount for li in again.lines.all()) == D("322.58")
    later = rate_october(tenant)
    assert [li.amount for li in topups(later)] == [D("256.00")]  # the whole month: 1000 - 744
    assert later.lines.count() == 2 and later.total == D("1000.00")


def test_finalized_commitment_is_settled_late_usage_is_charged_and_credited_against_its_top_up(shop):
    tier, reserved, allocation = shop
    PricePlan.objects.filter(pk=reserved.pk).update(price_per_slice_hour=D("0.5000"))
    tenant = TenantFactory()
    dep = deployment(allocation(tenant, "reserved", T0))  # held through October and November
    row = usage(tenant, dep, T0 + timedelta(hours=3), 4_000_000, 0)  # 1.00
    oct_inv = billing.finalize(billing.draft_for(tenant, OCT), now=NOV1 + timedelta(days=1))
    [oct_top] = topups(oct_inv)
    assert oct_top.amount == D(1000) - D(372) - D(1) == D("627.00")
    frozen = sorted(oct_inv.lines.values_list("kind", "amount"))
    # late October tokens, worth 40.00 at October's reserved price, and some November usage
    UsageHourly.objects.filter(pk=row.pk).update(input_tokens=164_000_000)
    usage(tenant, dep, NOV1 + timedelta(hours=2), 8_000_000, 0)  # 2.00
    nov = billing.refresh(billing.draft_for(tenant, NOV), now=DEC1)
    adj = nov.lines.get(kind="adjustment_input")
    assert adj.plan == reserved and adj.amount == D("40.00")  # charged in full, at the hour's price
    [nov_top] = topups(nov)
    # November's commitment against November's own charges only (720 h at 0.50 + 2.00): the
    # adjustment does not reduce it, and October's commitment is not billed again
    assert nov_top.amount == D(1000) - D(360) - D(2) == D("638.00")
    assert nov_top.usage_from == NOV1 and nov_top.usage_to == DEC1
    # ...but October's settled top-up (627.00) would have been 40.00 lower: that is credited (issue 14)
    credit = nov.lines.get(kind="commitment_credit")
    assert credit.amount == D("-40.00") and credit.plan == reserved and credit.usage_from == T0
    assert nov.total == sum(li.amount for li in nov.lines.all()) == D("1000.00")
    oct_inv.refresh_from_db()
    assert sorted(oct_inv.lines.values_list("kind", "amount")) == frozen
    assert oct_inv.total == D("1000.00")
    nov = billing.finalize(nov, now=DEC1 + timedelta(days=1))
    assert nov.total == D("1000.00") and len(topups(nov)) == 1


def test_only_tenants_holding_reserved_capacity_owe_a_commitment(shop):
    tier, reserved, allocation = shop
    on_demand = TenantFactory(slug="od")
    allocation(on_demand, "on_demand", T0)  # the whole month, on demand
    allocation(on_demand, "reserved", None, state="requested")  # ordered reserved, never activated
    allocation(on_demand, "reserved", None, state="failed")  # failed before it was ever active
    inv = rate_october(on_demand)
    assert topups(inv) == [] and inv.total == D(OCT_HOURS * 2)
    holder = TenantFactory(slug="res")
    allocation(holder, "reserved", T0 + timedelta(days=30), NOV1)  # one day held
    assert [li.amount for li in topups(rate_october(holder))] == [cents(1000 * Fraction(1, 31)) - D(24)]


def test_commitment_in_the_tenants_currency(shop):
    tier, reserved, allocation = shop
    PricePlanFactory(tier=tier, kind="reserved", currency="EUR", effective_from=T0 - timedelta(days=30),
                     price_per_slice_hour=D("0.9000"), price_per_1m_input_tokens=D("0.2000"),
                     price_per_1m_output_tokens=D("0.7000"), monthly_commit=D("900.00"))
    tenant = TenantFactory(currency="EUR")
    allocation(tenant, "reserved", T0)
    inv = rate_october(tenant)
    [top] = topups(inv)
    assert inv.currency == "EUR" and top.plan.currency == "EUR"
    assert top.amount == D("900.00") - D(OCT_HOURS) * D("0.90") == D("230.40")
    assert "EUR" in top.description
