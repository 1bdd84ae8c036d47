"""Price in force, one rule (billing.plans.in_force) and its copies kept for speed, held equal whatever the plans and
the times (property test): PlanBook.at and PlanBook.spans (the rating's), PlanBook.case (the SECOND COPY in SQL the
database groups the hourly rollups by), and orders.plan_in_force (the ORM's, when an order is placed)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.models import Allocation, PricePlan
from marketplace.services.billing.plans import PlanBook, in_force
from marketplace.services.orders import plan_in_force
from tests.factories import AllocationFactory, OrderFactory, PricePlanFactory, TenantFactory

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 10, 1, tzinfo=UTC)
KINDS, CURRENCIES = ("on_demand", "reserved"), ("USD", "EUR")

minutes = st.integers(min_value=-600, max_value=600)
#: plans: (tier 0 or 1, kind, currency, start in minutes from T0); duplicates of a (tier, kind, currency, start) are
#: one plan (the database's unique constraint)
plans = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(KINDS), st.sampled_from(CURRENCIES), minutes),
                 min_size=0, max_size=10)
#: times asked about: minutes from T0, and a plan's start exactly (index into the plans) or a microsecond before it
times = st.lists(st.one_of(minutes.map(lambda m: ("at", m)),
                           st.tuples(st.sampled_from(["start", "before"]), st.integers(0, 9))), min_size=1, max_size=8)


@pytest.fixture
def two_tiers(catalog, tiers):
    PricePlan.objects.all().delete()
    return [tiers["1g"], tiers["3g"]]


def _when(t, made: list[PricePlan]) -> datetime:
    how, n = t
    if how == "at" or not made:
        return T0 + timedelta(minutes=n if how == "at" else 0)
    start = made[n % len(made)].effective_from
    return start if how == "start" else start - timedelta(microseconds=1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=plans, times=times, span=st.tuples(minutes, st.integers(1, 900)))
def test_every_copy_of_price_in_force_is_the_rule(two_tiers, plans, times, span):
    with transaction.atomic():
        made: list[PricePlan] = []
        for tier_i, kind, currency, start in dict.fromkeys(plans):
            made.append(PricePlanFactory(tier=two_tiers[tier_i], kind=kind, currency=currency,
                                         effective_from=T0 + timedelta(minutes=start)))
        tenant = TenantFactory()
        asked = [_when(t, made) for t in times]
        # rows for the SQL copy: an allocation per tier, kind and time asked (tier, its order's plan kind, a time)
        rows = {}
        for tier in two_tiers:
            for kind in KINDS:
                order = OrderFactory(tenant=tenant, tier=tier, plan_kind=kind)
                for at in asked:
                    rows[AllocationFactory(order=order, activated_at=at).pk] = (tier, kind, at)
        for currency in CURRENCIES:
            book = PlanBook(currency)
            sql = dict(Allocation.objects.filter(pk__in=rows).annotate(
                plan_id=book.case("tier_id", "order__plan_kind", "activated_at")).values_list("pk", "plan_id"))
            for pk, (tier, kind, at) in rows.items():
                rule = in_force(made_of(made, tier), at).get((kind, currency))
                want = rule.pk if rule else None
                assert sql[pk] == want, ("SQL", tier.key, kind, currency, at)
                got = book.at(tier.pk, kind, at)
                assert (got.pk if got else None) == want, ("PlanBook.at", tier.key, kind, currency, at)
                orm = plan_in_force(tier, currency, kind, at)
                assert (orm.pk if orm else None) == want, ("orders.plan_in_force", tier.key, kind, currency, at)
            # spans: [a, b) cut where the plan in force changes, each part's plan the rule's at its every instant
            a = T0 + timedelta(minutes=span[0])
            b = a + timedelta(minutes=span[1])
            for tier in two_tiers:
                for kind in KINDS:
                    parts = book.spans(tier.pk, kind, a, b)
                    edges = sorted({a, b, *(p.effective_from for p in made_of(made, tier) if a < p.effective_from < b)})
                    for lo, hi in zip(edges, edges[1:], strict=False):
                        rule = in_force(made_of(made, tier), lo).get((kind, currency))
                        covering = [(p, x, y) for p, x, y in parts if x <= lo and hi <= y]
                        assert [p.pk for p, _, _ in covering] == ([rule.pk] if rule else []), (tier.key, kind, lo)
                    assert all(x < y for _, x, y in parts)
                    assert all(p1[2] <= p2[1] for p1, p2 in zip(parts, parts[1:], strict=False))
        transaction.set_rollback(True)


def made_of(made: list[PricePlan], tier) -> list[PricePlan]:
    return [p for p in made if p.tier_id == tier.pk]


def test_in_force_takes_plans_in_any_order_and_says_nothing_before_the_first():
    tier_id = 1
    old = PricePlan(pk=1, tier_id=tier_id, kind="on_demand", currency="USD", effective_from=T0,
                    price_per_slice_hour=Decimal(1))
    new = PricePlan(pk=2, tier_id=tier_id, kind="on_demand", currency="USD", effective_from=T0 + timedelta(days=1),
                    price_per_slice_hour=Decimal(2))
    for order in ([old, new], [new, old]):
        assert in_force(order, T0 - timedelta(seconds=1)) == {}
        assert in_force(order, T0) == {("on_demand", "USD"): old}
        assert in_force(order, new.effective_from) == {("on_demand", "USD"): new}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=plans, late_before=st.integers(-12, 12))
def test_split_hours_and_the_rollups_plan_are_the_rule(two_tiers, plans, late_before):
    """An hour outside `PlanBook.split_hours` has one plan in force at its every instant (its rollup stands for its
    events); `PlanBook.rollup_case` (SQL) gives a rollup the plan in force at its hour's start, and a late one (before
    `late_before`) of a split hour the plan in force at the hour's end."""
    from telemetry.models import UsageHourly
    from tests.factories import DeploymentFactory

    with transaction.atomic():
        made = [PricePlanFactory(tier=two_tiers[tier_i], kind=kind, currency=currency,
                                 effective_from=T0 + timedelta(minutes=start))
                for tier_i, kind, currency, start in dict.fromkeys(plans)]
        tenant = TenantFactory()
        hours = [T0 + timedelta(hours=h) for h in range(-11, 12)]
        rows = {}
        for tier in two_tiers:
            for kind in KINDS:
                a = AllocationFactory(order=OrderFactory(tenant=tenant, tier=tier, plan_kind=kind), tenant=tenant)
                dep = DeploymentFactory(allocation=a, tenant=tenant, backend="python", spec={}, memory_mb=10)
                for h in hours:
                    rows[UsageHourly.objects.create(tenant=tenant, deployment=dep, hour=h).pk] = (tier, kind, h)
        cut = T0 + timedelta(hours=late_before)
        for currency in CURRENCIES:
            book = PlanBook(currency)
            split = set(book.split_hours())
            starts = {p.effective_from for p in made if p.currency == currency}
            assert split == {h for h in hours if any(h < s < h + timedelta(hours=1) for s in starts)}
            sql = dict(UsageHourly.objects.filter(pk__in=rows).annotate(
                plan_id=book.rollup_case("deployment__allocation__tier_id", "deployment__allocation__order__plan_kind",
                                         cut)).values_list("pk", "plan_id"))
            for pk, (tier, kind, h) in rows.items():
                end = h + timedelta(hours=1) - timedelta(microseconds=1)
                at_start, at_end = (in_force(made_of(made, tier), t).get((kind, currency)) for t in (h, end))
                if h not in split:  # one plan the whole hour (at its start, its end, and each plan start inside)
                    assert at_start == at_end
                want = at_end if h in split and h < cut else at_start
                assert sql[pk] == (want.pk if want else None), (tier.key, kind, currency, h, cut)
        transaction.set_rollback(True)
