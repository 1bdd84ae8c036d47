"""The capacity planner's hourly rollups (issue 15): the planner's figures read through the rollups kept by the
downsampling job are the figures of the direct reads (the reference), for windows that start and end inside
the rolled hours, reach past them, or hold none; late usage for a rolled hour is rolled again; pruned samples
too; the console page's query count does not grow with the fleet."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace.models import Gpu
from marketplace.selectors import capacity_planning as cp
from marketplace.selectors import planner_measures as measures
from marketplace.services import planner_rollup
from telemetry.models import (
    GpuSample,
    PlannerDemandDaily,
    PlannerRollupDay,
    PlannerRollupHour,
    Resolution,
    TritonServedHourly,
    UsageHourly,
)
from telemetry.services import ingest
from tests.factories import AllocationFactory, DeploymentFactory, OrderFactory, TenantFactory
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db
HOUR = timedelta(hours=1)
HOURS = 72  # of history: two whole UTC days at any hour the tests run at (60 held two only before 13:00 UTC)


def _now():
    # a fixed minute past the hour, so that the windows below start and end inside hours
    return timezone.now().replace(minute=37, second=12, microsecond=345678)


@pytest.fixture
def history(catalog, tiers):
    """Two tenants, three deployments (two of one name) on the 1g and 3g tiers, HOURS of usage and Triton
    hours (some without execution time, some without usage), and GPU samples of every resolution."""
    rng = random.Random(15)
    now = _now()
    top = now.replace(minute=0, second=0, microsecond=0)
    deps = []
    for slug, tier, name in (("acme", tiers["1g"], "chat"), ("acme", tiers["3g"], "chat"),
                             ("globex", tiers["3g"], "rag")):
        tenant = TenantFactory(slug=slug) if not deps or slug != "acme" else deps[0].tenant
        deps.append(DeploymentFactory(name=name, tenant=tenant,
                                      allocation=AllocationFactory(order=OrderFactory(tenant=tenant, tier=tier))))
    for k in range(1, HOURS + 1):
        h = top - k * HOUR
        for i, d in enumerate(deps):
            if (k + i) % 5 != 0:
                UsageHourly.objects.create(tenant=d.tenant, deployment=d, hour=h, input_tokens=rng.randint(0, 90_000),
                                           output_tokens=rng.randint(0, 30_000), requests=rng.randint(1, 60),
                                           events=1, updated_at=h + HOUR)
            if (k + 2 * i) % 7 != 0:
                TritonServedHourly.objects.create(tenant=d.tenant, deployment=d, hour=h, requests=rng.randint(1, 60),
                                                  execution_ns=0 if k % 11 == 0 else rng.randint(1, 10**11))
    make_node("node-p")
    gpus = list(Gpu.objects.all()[:4])
    rows = []
    for k in range(HOURS * 60, 0, -7):  # raw every 7 minutes, 5-minute and hourly rows on their buckets
        ts = top - timedelta(minutes=k) + timedelta(seconds=rng.randint(0, 59))
        for g in gpus:
            a = rng.random()
            rows.append(GpuSample(gpu=g, resolution=Resolution.RAW, ts=ts, activity=a,
                                  power_w=80 + 600 * a + rng.random(), memory_used_mb=1, memory_total_mb=80_000,
                                  energy_j=1.0, temperature_c=40, sm_clock_mhz=1500))
    for res, step in ((Resolution.FIVE_MIN, 5), (Resolution.HOUR, 60)):
        for k in range(HOURS * 60, 0, -step):
            for g in gpus:
                a = rng.random()
                rows.append(GpuSample(gpu=g, resolution=res, ts=top - timedelta(minutes=k), activity=a,
                                      power_w=70 + 500 * a, memory_used_mb=1, memory_total_mb=80_000, energy_j=1.0,
                                      temperature_c=40, sm_clock_mhz=1500))
    GpuSample.objects.bulk_create(rows)
    return {"deps": deps, "now": now, "top": top}


def _figures(since, until) -> dict:
    shapes = {f.key: (f.measured_tokens, f.measured_requests, f.served_requests, f.measured_seconds, f.measured_tps,
                      f.peak_tps) for f in cp.shape_figures(since, until)}
    power = {k: (p.source, p.samples, p.idle_w, p.max_w) for k, p in cp.power_figures(since, until).items()}
    return {"shapes": shapes, "power": power, "demand": cp.measured_demand(since, until),
            "mix": cp.token_mix(since, until)}


def _direct(monkeypatch, since, until) -> dict:
    """The reference: the same figures with no rollup read (every hour from the usage, Triton and sample rows)."""
    with monkeypatch.context() as m:
        m.setattr(measures, "split", lambda s, u: measures.Split(s, u))
        return _figures(since, until)


def _same(got: dict, want: dict) -> None:
    assert got["shapes"].keys() == want["shapes"].keys()
    for k, row in want["shapes"].items():  # integers exact; the rates are ratios of them
        assert got["shapes"][k][:3] == row[:3]
        for mine, theirs in zip(got["shapes"][k][3:], row[3:], strict=True):
            assert (mine is None) == (theirs is None) and (mine is None or mine == pytest.approx(theirs, rel=1e-12))
    assert got["demand"] == want["demand"] and got["mix"] == pytest.approx(want["mix"], rel=1e-12)
    assert got["power"].keys() == want["power"].keys()
    for k, (source, n, idle, top) in want["power"].items():  # sums of floats in another order: to rounding
        assert got["power"][k][:2] == (source, n)
        assert got["power"][k][2:] == pytest.approx((idle, top), rel=1e-9)


def _windows(now):
    return [
        (now - timedelta(days=cp.DEFAULT_WINDOW_DAYS), now),  # the default: starts before the first rolled hour
        (now - timedelta(hours=30, minutes=11), now - timedelta(hours=4, minutes=50)),  # starts and ends mid-rollup
        (now - timedelta(hours=52, minutes=3), now - timedelta(hours=3)),  # whole UTC days inside, hour-aligned end
        (now - timedelta(hours=1, minutes=12), now),  # the form's shortest window: nothing rolled in it
        (now - timedelta(days=366), now),
    ]


def test_rolled_figures_are_the_direct_figures(history, monkeypatch):
    now = history["now"]
    want = {w: _direct(monkeypatch, *w) for w in _windows(now)}
    assert want[_windows(now)[0]]["demand"] and any(v[4] for v in want[_windows(now)[0]]["shapes"].values())
    assert want[_windows(now)[0]]["power"]["h100-sxm-80gb"][0] == "measured"
    got = planner_rollup.roll(now, max_hours=1000)
    assert got["hours"] == HOURS and got["days"] >= 2 and PlannerDemandDaily.objects.exists()
    for w in _windows(now):
        where = measures.split(*w)
        assert where.rolled == (w != _windows(now)[3])
        _same(_figures(*w), want[w])
    # again: the recent hours, and those behind the raw samples' retention cutoff (1 day) that still hold some
    again = planner_rollup.roll(now)
    assert again["hours"] == planner_rollup.RECENT + len(planner_rollup.stale_hours(now))
    for w in _windows(now):
        _same(_figures(*w), want[w])


def test_rollup_stops_at_the_last_settled_hour(history):
    now = history["now"]
    planner_rollup.roll(now, max_hours=1000)
    newest = PlannerRollupHour.objects.order_by("-hour").first().hour
    assert newest == history["top"] - HOUR  # 37 minutes past: the previous hour has ended and settled
    where = measures.split(now - timedelta(days=1), now)
    assert where.rolled_hi == history["top"] and where.direct[-1] == (history["top"], now)


def test_late_usage_after_a_roll_is_rolled_again(history, monkeypatch):
    now = history["now"]
    planner_rollup.roll(now, max_hours=1000)
    old_hour = history["top"] - 20 * HOUR  # long rolled, outside the hours rolled again every run
    dep = history["deps"][2]
    window = (now - timedelta(days=2, minutes=5), now)
    before = _figures(*window)
    # a late batch for that hour, through the ingest (it stamps the hour's row)
    later = now + timedelta(minutes=6)
    ingest.store_rows(dep.tenant_id, [("late-1", dep.pk, old_hour + timedelta(minutes=3), 5_000_000, 1_000, 7)],
                      now=later)
    want = _direct(monkeypatch, *window)
    assert want["demand"] != before["demand"] and want["mix"] != before["mix"]
    assert _figures(*window)["mix"] == before["mix"]  # the rollup has not seen it yet
    assert old_hour in planner_rollup.stale_hours(later)
    planner_rollup.roll(later)
    _same(_figures(*window), want)
    # rolled again while the row's stamp is within SKEW of the roll (an ingest that committed late), then no more
    assert old_hour in planner_rollup.stale_hours(later + timedelta(minutes=1))
    planner_rollup.roll(later + planner_rollup.SKEW + timedelta(minutes=1))
    assert old_hour not in planner_rollup.stale_hours(later + timedelta(minutes=12))
    _same(_figures(*window), want)


def test_pruned_samples_are_rolled_again(history, monkeypatch, settings):
    now = history["now"]
    planner_rollup.roll(now, max_hours=1000)
    settings.TESSERA_TELEMETRY_RETENTION_DAYS = {"raw": 1}
    cutoff = now - timedelta(days=1)
    GpuSample.objects.filter(resolution=Resolution.RAW, ts__lt=cutoff).delete()  # what downsample.prune does
    window = (now - timedelta(days=2), now)
    planner_rollup.roll(now)
    with monkeypatch.context() as m:  # the raw resolution alone: the fit the rollup must follow
        m.setattr(measures, "split", lambda s, u: measures.Split(s, u))
        want = measures.power((Resolution.RAW,), *window)
    got = measures.power((Resolution.RAW,), *window)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k]["n"] == want[k]["n"] and got[k]["sy"] == pytest.approx(want[k]["sy"], rel=1e-9)


def _page_queries(client) -> int:
    with CaptureQueriesContext(connection) as q:
        r = client.get("/console/planner/")
    assert r.status_code == 200 and r.context["report"] is not None
    return len(q.captured_queries)


def test_planner_page_queries_do_not_grow_with_the_fleet(client, operator, history):
    planner_rollup.roll(history["now"], max_hours=1000)
    client.force_login(operator)
    client.get("/console/planner/")  # warm
    one = _page_queries(client)
    for host in ("node-q", "node-r", "node-s"):
        make_node(host)
    for i in range(4):
        tenant = TenantFactory(slug=f"more-{i}")
        d = DeploymentFactory(name=f"m{i}", tenant=tenant, allocation=AllocationFactory(order=OrderFactory(
            tenant=tenant, tier=history["deps"][0].allocation.tier)))
        UsageHourly.objects.create(tenant=tenant, deployment=d, hour=history["top"] - 2 * HOUR, input_tokens=10,
                                   output_tokens=1, requests=1)
    planner_rollup.roll(history["now"])
    assert _page_queries(client) == one


def test_the_downsampling_job_rolls_the_planner_up(history, monkeypatch):
    from telemetry.collector_tasks import downsample_telemetry

    monkeypatch.setattr(timezone, "now", lambda: history["now"])
    out = downsample_telemetry()
    assert out["planner"]["hours"] == HOURS
    assert PlannerRollupHour.objects.count() == HOURS
    assert downsample_telemetry()["planner"]["hours"] >= planner_rollup.RECENT  # again: recent (and stale) hours


def test_a_run_stopped_between_its_hours_and_its_days_leaves_no_stale_day(history, monkeypatch, settings):
    settings.TESSERA_TELEMETRY_RETENTION_DAYS = {"raw": 10, "5m": 30, "1h": 365}  # no hour re-rolled for pruning
    now = history["now"]
    planner_rollup.roll(now, max_hours=1000)
    old_hour = measures.floor_day(history["top"] - 30 * HOUR) + 5 * HOUR  # inside a whole rolled UTC day
    day = measures.floor_day(old_hour)
    assert PlannerRollupDay.objects.filter(day=day).exists()
    dep = history["deps"][2]
    window = (now - timedelta(days=2, minutes=5), now)
    later = now + timedelta(minutes=30)
    ingest.store_rows(dep.tenant_id, [("late-x", dep.pk, old_hour + timedelta(minutes=3), 9_000_000, 1, 1)],
                      now=later)
    want = _direct(monkeypatch, *window)["demand"]

    def killed(d, now=None):
        raise RuntimeError("time limit")

    with monkeypatch.context() as m:
        m.setattr(planner_rollup, "roll_day", killed)
        with pytest.raises(RuntimeError):
            planner_rollup.roll(later + timedelta(minutes=10))  # the hours committed, the days not
    # the re-rolled hour took its day's marker with it: the day is read from the usage rows meanwhile
    assert not PlannerRollupDay.objects.filter(day=day).exists()
    assert cp.measured_demand(*window) == want
    assert day in planner_rollup.unmarked_days()
    planner_rollup.roll(later + timedelta(minutes=20))  # the old hour is no longer stale; its day is unmarked
    assert PlannerRollupDay.objects.filter(day=day).exists() and not planner_rollup.unmarked_days()
    assert measures.split(*window).rolled
    assert cp.measured_demand(*window) == want


def test_samples_pruned_after_a_long_outage_of_the_job_are_rolled_again(history, monkeypatch, settings):
    now = history["now"]
    planner_rollup.roll(now, max_hours=1000)
    settings.TESSERA_TELEMETRY_RETENTION_DAYS = {"raw": 1}
    back = now + timedelta(hours=36)  # the job was down a day and a half: the prune deletes far behind its cutoff
    GpuSample.objects.filter(resolution=Resolution.RAW, ts__lt=back - timedelta(days=1)).delete()
    planner_rollup.roll(back)
    window = (now - timedelta(days=2), now)
    with monkeypatch.context() as m:
        m.setattr(measures, "split", lambda s, u: measures.Split(s, u))
        want = measures.power((Resolution.RAW,), *window)
    got = measures.power((Resolution.RAW,), *window)
    assert sum(v["n"] for v in got.values()) == sum(v["n"] for v in want.values()) == 0
    assert not planner_rollup.stale_hours(back)  # rolled again once, then left alone


def test_a_run_rolls_at_most_max_hours_oldest_first(history):
    now = history["now"]
    first = planner_rollup.roll(now, max_hours=10)
    assert first["hours"] == 10
    hours = sorted(PlannerRollupHour.objects.values_list("hour", flat=True))
    assert hours == [hours[0] + k * HOUR for k in range(10)]  # no gap: the next run goes on from the last
    planner_rollup.roll(now, max_hours=1000)
    assert PlannerRollupHour.objects.count() == HOURS
