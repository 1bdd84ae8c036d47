"""The charts' money (billing.spread_amounts: token money priced from the database's sums per plan in force and
piece, slice-hours and commitment top-ups from the month rating) equals the invoices' own lines
(billing.rated_lines_many: rate_month per deployment line) spread over the same range and buckets, whatever the
usage, the price changes, the plan kinds, the currencies and the range's edges (property test)."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from django.db.models.functions import TruncHour
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.models import Allocation, Order, PricePlan
from marketplace.services import billing
from telemetry.models import UsageDaily, UsageEvent, UsageHourly
from telemetry.services.ingest import store_rows
from tests.billing_reference import rated_lines_many
from tests.factories import (
    AllocationFactory,
    DeploymentFactory,
    OrderFactory,
    PricePlanFactory,
    TenantFactory,
    UsageHourlyFactory,
)

pytestmark = pytest.mark.django_db
D = Decimal
T0 = datetime(2026, 10, 1, tzinfo=UTC)  # a month boundary: ranges cross it
TINY = D("1e-18")
PART = {billing.L.SLICE_HOURS: billing.SLICES, billing.L.COMMITMENT_TOPUP: billing.COMMITMENT,
        billing.L.INPUT_TOKENS: billing.TOKENS, billing.L.OUTPUT_TOKENS: billing.TOKENS}


@pytest.fixture
def fleet(catalog, tiers):
    """Three tenants on one tier: on demand in USD, reserved in USD, on demand in EUR (its plans below)."""
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).delete()
    for kind, currency in (("on_demand", "USD"), ("reserved", "USD"), ("on_demand", "EUR")):  # changed by examples
        PricePlanFactory(tier=tier, kind=kind, currency=currency, effective_from=T0 - timedelta(days=60),
                         price_per_slice_hour=D("1.2345"), price_per_1m_input_tokens=D("0.3333"),
                         price_per_1m_output_tokens=D("0.7777"),
                         monthly_commit=D("900.00") if kind == "reserved" else None)
    out = []
    for slug, currency, kind in (("od", "USD", "on_demand"), ("resv", "USD", "reserved"), ("eur", "EUR", "on_demand")):
        t = TenantFactory(slug=slug, currency=currency)
        order = OrderFactory(tenant=t, tier=tier, plan_kind=kind)
        a = AllocationFactory(order=order, tenant=t, tier=tier, state="active", activated_at=T0)
        deps = [DeploymentFactory(allocation=a, tenant=t, name=f"{slug}{i}", backend="python", spec={},
                                  memory_mb=10, state="ready") for i in range(2)]
        out.append((t, a, deps))
    return tier, out


minutes = st.integers(min_value=-3 * 24 * 60, max_value=4 * 24 * 60)  # around T0
price = st.integers(min_value=1, max_value=3_000_000).map(lambda n: D(n) / 10_000)
plans = st.lists(st.tuples(st.sampled_from([("on_demand", "USD"), ("reserved", "USD"), ("on_demand", "EUR")]),
                           minutes, price, price, price, st.integers(0, 5000)), min_size=1, max_size=6)
#: (tenant, deployment, hour: from the range's first hour less one, adapter, input tokens, output tokens, second
#: of the hour)
usage = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(0, 125), st.sampled_from(["", "x"]),
                           st.integers(0, 5_000_000), st.integers(0, 900_000), st.integers(0, 3599)), max_size=25)
#: per plan: usage this many seconds before and after its start (plans start mid-hour: tokens on both sides)
around = st.tuples(st.integers(1, 3599), st.integers(0, 3599), st.integers(1, 900_000))
spans = st.lists(st.tuples(minutes, st.one_of(st.none(), st.integers(1, 5 * 24 * 60)), st.booleans()),
                 min_size=3, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(plans=plans, usage=usage, spans=spans, start=minutes, length=st.integers(1, 5 * 24 * 60),
       seconds_off=st.integers(0, 59), now_after=st.integers(-600, 40 * 24 * 60), around=around)
def test_spread_amounts_equal_the_invoices_lines(fleet, plans, usage, spans, start, length, seconds_off, now_after,
                                                 around):
    """The usage is ingested as events (their hourly rollups kept by ingest); plans start at any minute, and
    tokens are served just before and after each plan's start, often inside the same hour (a split hour: priced
    from its events, each at the plan in force at its time)."""
    tier, tenants = fleet
    served: list[tuple[int, int, datetime, str, int, int]] = []  # (tenant, deployment, ts, adapter, in, out)
    with transaction.atomic():
        for i, ((kind, currency), at, hour, ins, outs, commit) in enumerate(plans):
            starts = T0 + timedelta(minutes=at)
            who = [0, 1, 0, 2][i % 4] if currency == "USD" else 2
            served += [(who, 0, starts - timedelta(seconds=around[0]), "", around[2], around[2] // 3),
                       (who, 1, starts + timedelta(seconds=around[1]), "", around[2] // 2, around[2])]
            PricePlan.objects.get_or_create(
                tier=tier, kind=kind, currency=currency, effective_from=T0 + timedelta(minutes=at),
                defaults={"price_per_slice_hour": hour, "price_per_1m_input_tokens": ins,
                          "price_per_1m_output_tokens": outs,
                          "monthly_commit": D(commit) if kind == "reserved" else None})
        for (_t, a, _), (on, held, failed) in zip(tenants, spans, strict=True):
            a.activated_at = T0 + timedelta(minutes=on)
            stop = None if held is None else a.activated_at + timedelta(minutes=held, seconds=seconds_off)
            a.state, a.released_at = ("failed", None) if failed and stop else ("active", stop)
            a.save()
            if a.state == "failed":  # a failed allocation stops at its last change
                Allocation.objects.filter(pk=a.pk).update(updated_at=stop)
        a = T0 + timedelta(minutes=start, seconds=seconds_off)
        b = a + timedelta(minutes=length)
        first = a.replace(minute=0, second=0) - timedelta(hours=1)
        last = b.replace(minute=0, second=0)
        edges = [(who, 0, h, "", 1_234_567, 89_123, 1799) for who in range(3)
                 for h in (1, (last - first) // timedelta(hours=1))]
        for who, dep, h, adapter, ins, outs, sec in edges + usage:  # always the range's edge hours, and random ones
            served.append((who, dep, min(first + timedelta(hours=h), last + timedelta(hours=1))
                           + timedelta(seconds=sec), adapter, ins, outs))
        for n, (who, dep, ts, adapter, ins, outs) in enumerate(served):
            t, _, deps = tenants[who]
            store_rows(t.pk, [(f"e{n}", deps[dep].pk, ts, ins, outs, 3, None, adapter)])
        now = b + timedelta(minutes=now_after)
        people = [t for t, _, _ in tenants]
        for step in (None, 3600, 86400):
            exact = rated_lines_many(people, a, b, now, step=step or 10**9)
            want: dict[tuple, Decimal] = defaultdict(Decimal)
            for tid, lines in exact.items():
                for d, cur in lines:
                    if step is None:
                        want[(tid, cur, d.tier.pk, PART[d.kind], None)] += billing.amount_between(d, a, b)
                    else:
                        for bucket, x in billing.amount_by_bucket(d, a, b, timedelta(seconds=step)).items():
                            want[(tid, cur, d.tier.pk, PART[d.kind], bucket)] += x
            spread = billing.spread_amounts(people, a, b, now, step=step)
            got = spread.money
            if now >= b:  # the tokens and requests charted: the rollups' hours in [a, b), by bucket
                used: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
                for r in UsageHourly.objects.filter(hour__gte=a, hour__lt=b):
                    u = used[(r.tenant_id, r.tenant.currency, tier.pk, billing.spread._bucket_start(r.hour, step)
                              if step else None)]
                    u[0] += r.input_tokens + r.output_tokens
                    u[1] += r.requests
                assert {k: v for k, v in spread.used.items() if v != [0, 0]} == used
            if now >= b:  # (the range's first hour always has tokens, at some price)
                assert any(x for (_t, _c, _tier, part, _b), x in want.items() if part == billing.TOKENS)
            for key in set(want) | set(got):
                assert abs(got.get(key, D(0)) - want.get(key, D(0))) < TINY, (key, got.get(key), want.get(key))
            untiered: dict[tuple, Decimal] = defaultdict(Decimal)  # by_tier=False: the same, summed over tiers
            for (tid, cur, _tier, part, bucket), x in want.items():
                untiered[(tid, cur, None, part, bucket)] += x
            got = billing.spread_amounts(people, a, b, now, step=step, by_tier=False).money
            for key in set(untiered) | set(got):
                assert abs(got.get(key, D(0)) - untiered.get(key, D(0))) < TINY, (key, got.get(key), untiered.get(key))
        transaction.set_rollback(True)


def test_allocations_held_over_the_same_span_count_each(fleet):
    """spread_amounts reads the allocations clipped and counted per (tenant, tier, plan kind, span) by the
    database: allocations with the same span (three of them, one failed at the same time as another's release)
    each cost their slice-hours, as on the invoice's lines, and a span outside the range costs nothing."""
    tier, tenants = fleet
    t, a, _deps = tenants[0]
    a.activated_at, a.released_at = T0 + timedelta(hours=1), T0 + timedelta(hours=30, minutes=7)
    a.save()
    order = Order.objects.get(tenant=t)
    for state, released in (("active", a.released_at), ("failed", None), ("active", None)):
        b = AllocationFactory(order=order, tenant=t, tier=tier, state=state, activated_at=a.activated_at,
                              released_at=released)
        if state == "failed":  # stopped at its last change, the others' release
            Allocation.objects.filter(pk=b.pk).update(updated_at=a.released_at)
    AllocationFactory(order=order, tenant=t, tier=tier, state="active", activated_at=T0,
                      released_at=T0 + timedelta(minutes=20))  # this month's, released before the range
    start, end, now = T0 + timedelta(minutes=30), T0 + timedelta(days=2, minutes=45), T0 + timedelta(days=3)
    for step in (None, 3600, 86400):
        want: dict[tuple, Decimal] = defaultdict(Decimal)
        for d, cur in rated_lines_many([t], start, end, now, step=step or 10**9)[t.pk]:
            if d.kind == billing.L.SLICE_HOURS:
                if step is None:
                    want[(t.pk, cur, None, billing.SLICES, None)] += billing.amount_between(d, start, end)
                else:
                    for bucket, x in billing.amount_by_bucket(d, start, end, timedelta(seconds=step)).items():
                        want[(t.pk, cur, None, billing.SLICES, bucket)] += x
        got = {k: x for k, x in billing.spread_amounts([t], start, end, now, step=step, by_tier=False).money.items()
               if k[3] == billing.SLICES}
        assert sum(want.values()) > 0 and set(got) == {k for k, x in want.items() if x}
        assert all(abs(got[k] - want[k]) < TINY for k in got), step
    # three allocations over [01:00, 30:07) and one from 01:00 on, at 1.2345 per slice-hour (inside the range)
    total = sum(billing.spread_amounts([t], start, end, now).money.values())
    held = 3 * (D(30 * 60 + 7) - 60) / 60 + (D(48 * 60 + 45) - 60) / 60
    assert abs(total - held * D("1.2345")) < TINY


def test_spread_amounts_for_a_tenant_billed_in_a_currency_without_plans(catalog, tiers):
    """A tenant billed in a currency no plan is priced in (its invoice alerts 'no CHF price in force'): the
    charts' money has nothing to add for it, and its tokens still count. token_money's CASE has no WHEN then:
    an untyped NULL made PostgreSQL refuse the SUM ("function sum(unknown) is not unique"), failing the
    tenant-usage chart and the portal for every tenant rated in the same call (found in review)."""
    tier = tiers["3g"]
    assert not PricePlan.objects.filter(currency="CHF").exists()
    t = TenantFactory(slug="swiss", currency="CHF")
    order = OrderFactory(tenant=t, tier=tier, plan_kind="on_demand")
    a = AllocationFactory(order=order, tenant=t, tier=tier, state="active", activated_at=T0)
    dep = DeploymentFactory(allocation=a, tenant=t, name="d", backend="python", spec={}, memory_mb=10,
                            state="ready")
    UsageHourlyFactory(tenant=t, deployment=dep, hour=T0 + timedelta(hours=2), input_tokens=1000,
                       output_tokens=500, requests=3)
    out = billing.spread_amounts([t], T0, T0 + timedelta(days=1), T0 + timedelta(days=2), step=3600)
    assert not any(out.money.values())
    assert sum(u[0] for u in out.used.values()) == 1500


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(usage=usage, step=st.sampled_from([3600, 86400, 10**9]), by_tier=st.booleans(),
       edges=st.tuples(st.integers(0, 60), st.integers(1, 100)))
def test_raw_rows_are_the_querysets_own_rows(fleet, usage, step, by_tier, edges):
    """spread._raw_rows reads the token sums (spread.token_sums) without Django's per-value converters: a second
    copy of Django's row reading, for that query shape only; its rows are the queryset's own, number for number."""
    from marketplace.services.billing.plans import PlanBook
    from marketplace.services.billing.rating import piece_case
    from marketplace.services.billing.spread import _raw_rows, token_sums
    from telemetry.sqlbuckets import EpochBucket

    tier, tenants = fleet
    with transaction.atomic():
        first = T0 - timedelta(hours=1)
        for n, (who, dep, h, adapter, ins, outs, sec) in enumerate(usage):
            t, _, deps = tenants[who]
            store_rows(t.pk, [(f"e{n}", deps[dep].pk, first + timedelta(hours=h, seconds=sec), ins, outs, 2, None,
                               adapter)])
        lo = T0 + timedelta(hours=edges[0])
        pieces = (step, lo, lo + timedelta(hours=edges[1]))
        for currency in ("USD", "EUR"):
            qs, _ = token_sums(UsageHourly.objects.all(), PlanBook(currency), piece_case(pieces), by_tier)
            assert _numbers(_raw_rows(qs)) == _numbers(qs)
            events = UsageEvent.objects.annotate(hour=TruncHour("ts", tzinfo=UTC))  # (split hours: their events)
            ev, _ = token_sums(events, PlanBook(currency), piece_case(pieces), by_tier, at="ts")
            assert _numbers(_raw_rows(ev)) == _numbers(ev)
            assert sorted(r[:-1] for r in _numbers(ev)) == sorted(r[:-1] for r in _numbers(qs))  # same pieces, sums
            daily, _ = token_sums(UsageDaily.objects.all(), PlanBook(currency), EpochBucket("day", step), by_tier,
                                  at="day")
            assert _numbers(_raw_rows(daily)) == _numbers(daily)
            assert usage == [] or len(_numbers(daily)) > 0
        transaction.set_rollback(True)


def _numbers(rows) -> list[tuple]:
    return sorted(tuple(None if v is None else Decimal(str(v)) for v in r) for r in rows)
