"""UsageDaily, the second copy of the hourly usage rollups kept for speed: the database's triggers hold it equal to
the hourly rows summed per (tenant, deployment, UTC day) whatever writes them (property test), and the charts'
money read from it (billing.spread_amounts over whole days) is the money read from the hourly rows alone."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.db.models import F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.models import PricePlan
from marketplace.services import billing
from marketplace.services.billing import spread as spread_module
from telemetry.models import UsageDaily, UsageHourly
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
T0 = datetime(2026, 10, 1, tzinfo=UTC)


def _days_from_hours() -> dict[tuple, tuple]:
    out: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for r in UsageHourly.objects.all():
        day = r.hour.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        acc = out[(r.tenant_id, r.deployment_id, day)]
        for i, v in enumerate((r.input_tokens, r.output_tokens, r.requests, r.events, 1)):
            acc[i] += v
    return {k: tuple(v) for k, v in out.items()}


def _days() -> dict[tuple, tuple]:
    return {(d.tenant_id, d.deployment_id, d.day.astimezone(UTC)):
            (d.input_tokens, d.output_tokens, d.requests, d.events, d.hours) for d in UsageDaily.objects.all()}


@pytest.fixture
def deps(catalog, tiers):
    out = []
    for slug in ("a", "b"):
        t = TenantFactory(slug=f"daily-{slug}")
        a = AllocationFactory(order=OrderFactory(tenant=t, tier=tiers["3g"]), tenant=t, tier=tiers["3g"],
                              state="active", activated_at=T0 - timedelta(days=10))
        out += [DeploymentFactory(allocation=a, tenant=t, name=f"{slug}{i}", backend="python", spec={}, memory_mb=10,
                                  state="ready") for i in range(2)]
    return out


hours = st.integers(0, 24 * 4)  # hours after T0 - 1 day: five days, month boundary inside
op = st.one_of(
    st.tuples(st.just("create"), st.integers(0, 3), hours, st.sampled_from(["", "x"]), st.integers(0, 10**9),
              st.integers(0, 10**6)),
    st.tuples(st.just("add"), st.integers(0, 50), st.integers(-1000, 10**6)),
    st.tuples(st.just("billed"), st.integers(0, 50), st.integers(0, 10**6)),
    st.tuples(st.just("move"), st.integers(0, 50), hours),
    st.tuples(st.just("delete"), st.integers(0, 50)),
    st.tuples(st.just("ingest"), st.integers(0, 3), st.lists(st.tuples(hours, st.integers(0, 3599),
                                                                        st.integers(0, 5000)), max_size=6)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=12), bulk=st.booleans())
def test_the_daily_rows_are_the_hourly_rows_summed_whatever_writes_them(deps, ops, bulk):
    base = T0 - timedelta(days=1)
    with transaction.atomic():
        if bulk:  # bulk_create (fixtures, the benches) fires the same triggers
            UsageHourly.objects.bulk_create([UsageHourly(tenant=d.tenant, deployment=d, hour=base + timedelta(hours=h),
                                                         input_tokens=7 * h, output_tokens=h, requests=1, events=1)
                                             for d in deps[:2] for h in (0, 5, 23, 24, 30)])
        n = 0
        for o in ops:
            rows = list(UsageHourly.objects.order_by("pk"))
            if o[0] == "create":
                _, k, h, adapter, i, out = o
                UsageHourly.objects.get_or_create(tenant=deps[k].tenant, deployment=deps[k], adapter=adapter,
                                                  hour=base + timedelta(hours=h),
                                                  defaults={"input_tokens": i, "output_tokens": out, "requests": 1})
            elif o[0] == "ingest":
                _, k, events = o
                n += 1
                store_rows(deps[k].tenant_id, [(f"e{n}-{j}", deps[k].pk, base + timedelta(hours=h, seconds=s), x, 2 * x,
                                                1) for j, (h, s, x) in enumerate(events)])
            elif rows:
                r = rows[o[1] % len(rows)]
                if o[0] == "add":  # as ingest's upsert and the ORM's F() updates do
                    UsageHourly.objects.filter(pk=r.pk).update(input_tokens=F("input_tokens") + max(o[2], 0),
                                                               output_tokens=F("output_tokens") + 1,
                                                               requests=F("requests") + 1)
                elif o[0] == "billed":  # the rating marks what it charged: the day's sums do not move
                    UsageHourly.objects.filter(pk=r.pk).update(billed_input_tokens=o[2])
                elif o[0] == "move":
                    if not UsageHourly.objects.filter(tenant=r.tenant_id, deployment=r.deployment_id, adapter=r.adapter,
                                                      hour=base + timedelta(hours=o[2])).exists():
                        r.hour = base + timedelta(hours=o[2])
                        r.save()
                else:
                    r.delete()
            assert _days() == _days_from_hours(), o
        transaction.set_rollback(True)


def test_a_day_goes_with_its_last_hour(deps):
    d = deps[0]
    first = UsageHourlyFactory(deployment=d, hour=T0, input_tokens=5)
    second = UsageHourlyFactory(deployment=d, hour=T0 + timedelta(hours=3), input_tokens=7)
    assert _days() == {(d.tenant_id, d.pk, T0): (12, 0, 0, 0, 2)}
    first.delete()
    assert _days() == {(d.tenant_id, d.pk, T0): (7, 0, 0, 0, 1)}
    second.delete()
    assert not UsageDaily.objects.exists()


def _spread(people, a, b, now, step):
    got = billing.spread_amounts(people, a, b, now, step=step)
    return ({k: v for k, v in got.money.items() if v}, {k: tuple(v) for k, v in got.used.items() if any(v)})


@pytest.mark.parametrize("step", [None, 86400])
def test_the_charts_read_whole_days_from_the_daily_rows_and_say_the_same(catalog, tiers, monkeypatch, step):
    """Six days of usage every hour, a price change at midnight and one mid-day: the money and tokens from the daily
    rows (whole days without a mid-day price change) equal those from the hourly rows alone, and the invoices' own
    lines spread over the same range."""
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).delete()
    for at, p_in in ((T0 - timedelta(days=40), "0.3333"), (T0 + timedelta(days=1), "0.5"),
                     (T0 + timedelta(days=3, hours=9, minutes=20), "1.25")):
        PricePlanFactory(tier=tier, kind="on_demand", currency="USD", effective_from=at, price_per_slice_hour=D("1"),
                         price_per_1m_input_tokens=D(p_in), price_per_1m_output_tokens=D("0.7777"))
    t = TenantFactory(slug="daily", currency="USD")
    a = AllocationFactory(order=OrderFactory(tenant=t, tier=tier, plan_kind="on_demand"), tenant=t, tier=tier,
                          state="active", activated_at=T0 - timedelta(days=3))
    dep = DeploymentFactory(allocation=a, tenant=t, name="d", backend="python", spec={}, memory_mb=10, state="ready")
    UsageHourly.objects.bulk_create([UsageHourly(tenant=t, deployment=dep, hour=T0 - timedelta(days=1, hours=-h),
                                                 input_tokens=1_000_003 * (h % 7 + 1), output_tokens=999 * h,
                                                 requests=h % 3 + 1, events=1) for h in range(24 * 8)])
    start, end = T0 - timedelta(hours=7, minutes=13), T0 + timedelta(days=5, hours=4, minutes=50)
    now = end + timedelta(days=1)
    read: list[str] = []

    def spy(execute, sql, params, many, context):
        read.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(spy):
        daily = _spread([t], start, end, now, step)
    assert any("telemetry_usagedaily" in sql for sql in read), "whole days were read from the hourly rows"
    monkeypatch.setattr(spread_module, "DAILY_FROM_DAYS", 10**6)  # hourly rows only
    assert daily == _spread([t], start, end, now, step)
    want: dict[tuple, Decimal] = defaultdict(Decimal)
    for d, cur in rated_lines_many([t], start, end, now, step=step or 10**9)[t.pk]:
        if step is None:
            want[(t.pk, cur, tier.pk, billing.spread.PART_OF.get(d.kind, billing.TOKENS), None)] += \
                billing.amount_between(d, start, end)
        else:
            for bucket, x in billing.amount_by_bucket(d, start, end, timedelta(seconds=step)).items():
                want[(t.pk, cur, tier.pk, billing.spread.PART_OF.get(d.kind, billing.TOKENS), bucket)] += x
    assert want and set(daily[0]) == {k for k, v in want.items() if v}
    for key, x in want.items():
        assert abs(daily[0].get(key, D(0)) - x) < D("1e-18"), (key, daily[0].get(key), x)


def test_daily_spans_skip_days_a_price_changes_in_and_short_ranges():
    from marketplace.services.billing.plans import PlanBook

    book = PlanBook("USD")
    book.by_pk = {1: PricePlan(effective_from=T0 + timedelta(days=2, hours=5)),
                  2: PricePlan(effective_from=T0 + timedelta(days=4))}
    spans = spread_module._daily_spans(book, T0 - timedelta(hours=3), T0 + timedelta(days=6, hours=1), None)
    assert spans == [(T0, T0 + timedelta(days=2)), (T0 + timedelta(days=3), T0 + timedelta(days=6))]
    assert spread_module._daily_spans(book, T0, T0 + timedelta(days=6), 3600) == []  # hourly buckets
    assert spread_module._daily_spans(book, T0 + timedelta(hours=1), T0 + timedelta(days=2), None) == []  # one day


@pytest.mark.parametrize("table, prefix", [("telemetry_usagehourly", "telemetry_usage_daily_"),
                                           ("telemetry_gpusample", "telemetry_node_activity_")])
def test_the_copies_triggers_survive_every_migration(table, prefix):
    """SQLite rebuilds a table to alter it, and the rebuilt table has no triggers: a later migration that alters the
    hourly rollups or the GPU samples must make them again (as telemetry 0015 does), or the copies stop following."""
    with connection.cursor() as c:
        if connection.vendor == "postgresql":
            c.execute("SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal", [table])
        else:
            c.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s", [table])
        names = {r[0] for r in c.fetchall()}
    assert {f"{prefix}{op}" for op in ("ins", "upd", "del")} <= names
