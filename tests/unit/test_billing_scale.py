"""Charts and billing reads at MSP scale (issue 17): the rating beat fans out one task per tenant, each
retried on its own and counted once, with a summary when all are done; the operator's spend list reads
the rated invoices (paginated, filtered) without rating; fleet charts and billing reads make the same
number of queries at two fleet sizes; charts cap their points."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from unittest import mock

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace import tasks
from marketplace.models import (
    BillingAlert,
    Gpu,
    Invoice,
    InvoiceLine,
    PricePlan,
    RatingRun,
    RatingRunTenant,
)
from marketplace.services import billing
from telemetry import charts
from telemetry.models import GpuSample, MigSample, Resolution, UsageHourly
from tenants.errors import ServiceError
from tenants.models import AuditEvent
from tenants.scoping import principal_for_user
from tests.billing_reference import rate_all
from tests.factories import AllocationFactory, DeploymentFactory, OrderFactory, TenantFactory, UsageHourlyFactory
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db
D = Decimal


def _tenant_with_usage(slug, tier, tokens=1_000_000, limit=None, hours=1):
    """A tenant with one allocation of `tier` held for the month's first hour and `hours` hours of usage."""
    tenant = TenantFactory(slug=slug, currency="USD", monthly_spend_limit=limit)
    start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    dep = DeploymentFactory(name="llm", allocation=AllocationFactory(
        order=OrderFactory(tenant=tenant, tier=tier), activated_at=start, released_at=start + timedelta(hours=1)))
    for h in range(hours):
        UsageHourlyFactory(tenant=tenant, deployment=dep, hour=start + timedelta(hours=h),
                           input_tokens=tokens, output_tokens=0, requests=1)
    return tenant


@pytest.fixture
def priced(catalog, tiers):
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).update(effective_from=timezone.now() - timedelta(days=400),
                                               price_per_slice_hour=D("2.0000"),
                                               price_per_1m_input_tokens=D("0.5000"))
    return tier


def test_rating_beat_fans_out_one_task_per_tenant_and_summarizes_once(priced, django_capture_on_commit_callbacks):
    for slug in ("t1", "t2", "t3"):
        _tenant_with_usage(slug, priced)
    sent = []
    with mock.patch("marketplace.enqueue.app.send_task", lambda name, args, queue: sent.append((name, args, queue))):
        with django_capture_on_commit_callbacks(execute=True):
            run_id = tasks.rate_and_check_spend()
    run = RatingRun.objects.get(pk=run_id)
    assert sorted(a[1] for _n, a, _q in sent) == sorted(run.tenants.values_list("tenant_id", flat=True))
    assert {(n, q) for n, _a, q in sent} == {("tessera.rate_tenant", "control")} and len(sent) == 3
    for i, (_n, args, _q) in enumerate(sent):
        assert tasks.rate_tenant.apply(args=args).get() == "done"
        run.refresh_from_db()
        assert (run.finished_at is None) == (i < 2)  # the last tenant's task finishes the run
    assert run.summary["rated"] == 3 and run.summary["failed"] == []
    assert AuditEvent.objects.filter(action="billing.rating_run", target=f"rating-run:{run.pk}").count() == 1
    # every draft rated: 1M input tokens at 0.50 + 1 slice-hour at 2.00
    assert set(Invoice.objects.values_list("total", flat=True)) == {D("2.50")}
    # a redelivered task counts once and rates nothing again
    before = InvoiceLine.objects.count()
    assert billing.rate_run_tenant(run.pk, sent[0][1][1], final_attempt=False) == "done"
    assert InvoiceLine.objects.count() == before
    assert AuditEvent.objects.filter(action="billing.rating_run").count() == 1


def test_a_failing_tenant_is_retried_on_its_own_then_alerted(priced):
    good, bad = _tenant_with_usage("good", priced), _tenant_with_usage("bad", priced)
    with mock.patch("marketplace.enqueue.send"):
        run = billing.start_rating_run()
    real = billing.rate_tenant

    def flaky(t, now=None):
        if t.slug == "bad":
            raise RuntimeError("price book unavailable")
        return real(t, now)

    with mock.patch.object(billing.runs, "rate_tenant", flaky):
        with pytest.raises(RuntimeError):  # not the last attempt: the task retries it
            billing.rate_run_tenant(run.pk, bad.pk, final_attempt=False)
        item = RatingRunTenant.objects.get(run=run, tenant=bad)
        assert item.status == "pending" and item.attempts == 1
        assert billing.rate_run_tenant(run.pk, good.pk, final_attempt=False) == "done"
        run.refresh_from_db()
        assert run.finished_at is None  # still waiting for the failing tenant
        assert billing.rate_run_tenant(run.pk, bad.pk, final_attempt=True) == "failed"
    run.refresh_from_db()
    assert run.finished_at is not None and run.summary["failed"] == ["bad"] and run.summary["rated"] == 1
    assert BillingAlert.objects.get(tenant=bad, kind="rating_failed").message.endswith("price book unavailable")
    assert Invoice.objects.get(tenant=good).total == D("2.50")
    assert Invoice.objects.get(tenant=bad).rated_at is None  # its draft was not touched


def test_rating_twice_never_bills_twice(priced):
    t = _tenant_with_usage("twice", priced)
    rate_all()
    rate_all()
    inv = Invoice.objects.get(tenant=t)
    assert inv.total == D("2.50") and inv.lines.count() == 2


def _last_month_usage(slug, tier, tokens=1_000_000):
    """Usage in the last hour of last month: a draft to finalize at month end (1 slice-hour + 1M tokens)."""
    tenant = TenantFactory(slug=slug, currency="USD")
    hour = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0) - timedelta(hours=1)
    dep = DeploymentFactory(name="llm", allocation=AllocationFactory(
        order=OrderFactory(tenant=tenant, tier=tier), activated_at=hour, released_at=hour + timedelta(hours=1)))
    UsageHourlyFactory(tenant=tenant, deployment=dep, hour=hour, input_tokens=tokens, output_tokens=0,
                       requests=1)
    return tenant


def _frozen(tenant):
    inv = Invoice.objects.get(tenant=tenant, period_start__lt=billing.month_of(timezone.now()))
    return inv.status, inv.number, inv.total, inv.finalized_at, sorted(inv.lines.values_list("pk", "amount"))


def test_month_end_is_finalized_by_each_tenants_own_task(priced, django_capture_on_commit_callbacks):
    m1, m2 = _last_month_usage("m1", priced), _last_month_usage("m2", priced)
    t3 = _tenant_with_usage("t3", priced)
    sent = []
    with mock.patch("marketplace.enqueue.app.send_task", lambda name, args, queue: sent.append((name, args, queue))):
        with django_capture_on_commit_callbacks(execute=True):
            run = billing.start_rating_run()
    # a tenant with only an ended month's draft gets its own task too
    assert sorted(a[1] for _n, a, _q in sent) == sorted([m1.pk, m2.pk, t3.pk])
    by_tenant = {a[1]: a for _n, a, _q in sent}
    assert tasks.rate_tenant.apply(args=by_tenant[m1.pk]).get() == "done"
    assert _frozen(m1)[0] == "finalized" and _frozen(m2)[0] == "draft"  # m1's task finalized only m1
    assert _frozen(m1)[2] == D("2.50")
    m1_final = _frozen(m1)
    for t in (m2, t3):
        assert tasks.rate_tenant.apply(args=by_tenant[t.pk]).get() == "done"
    run.refresh_from_db()
    numbers = sorted(Invoice.objects.filter(status="finalized").values_list("number", flat=True))
    assert len(numbers) == 2 and run.summary["finalized"] == numbers and run.summary["rated"] == 3
    assert AuditEvent.objects.filter(action="billing.rating_run", target=f"rating-run:{run.pk}").count() == 1
    # redelivered, re-run and a whole new run: a finalized invoice never changes, nothing billed twice
    assert billing.rate_run_tenant(run.pk, m1.pk, final_attempt=False) == "done"
    assert billing.finalize_tenant_due(m1.pk) == []
    with mock.patch("marketplace.enqueue.send"):
        again = billing.start_rating_run()
    assert set(again.tenants.values_list("tenant_id", flat=True)) == {t3.pk}  # no ended draft is left
    assert billing.rate_run_tenant(again.pk, t3.pk, final_attempt=True) == "done"
    assert _frozen(m1) == m1_final and Invoice.objects.filter(status="finalized").count() == 2


def test_a_tenant_whose_month_end_fails_holds_back_only_itself(priced):
    good, bad = _last_month_usage("good", priced), _last_month_usage("bad", priced)
    with mock.patch("marketplace.enqueue.send"):
        run = billing.start_rating_run()
    real = billing.finalize

    def flaky(inv, **kw):
        if inv.tenant_id == bad.pk:
            raise ServiceError("no price in EUR")
        return real(inv, **kw)

    with mock.patch.object(billing.invoices, "finalize", flaky):
        for t in (bad, good):
            assert billing.rate_run_tenant(run.pk, t.pk, final_attempt=False) == "done"
    assert _frozen(good)[0] == "finalized" and _frozen(bad)[0] == "draft"
    assert BillingAlert.objects.get(tenant=bad, kind="finalize_failed").message.endswith("no price in EUR")
    assert not BillingAlert.objects.filter(tenant=good).exists()
    run.refresh_from_db()
    assert run.finished_at is not None and run.summary["finalized"] == [_frozen(good)[1]]


def test_a_tenants_month_end_task_makes_the_same_queries_for_more_tenants(priced):
    def task_queries(prefix, n):
        ts = [_last_month_usage(f"{prefix}{i}", priced) for i in range(n)]
        for t in ts:  # this month's usage too: the task finalizes one month and rates the next
            _tenant_usage_now(t, priced)
        with mock.patch("marketplace.enqueue.send"):
            run = billing.start_rating_run()
        billing.rate_run_tenant(run.pk, ts[0].pk, final_attempt=False)  # the year's invoice sequence exists
        return _queries(lambda: billing.rate_run_tenant(run.pk, ts[1].pk, final_attempt=False))

    small = task_queries("s", 3)
    assert task_queries("b", 12) == small


def _tenant_usage_now(tenant, tier):
    start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    dep = tenant.deployments.first()
    UsageHourlyFactory(tenant=tenant, deployment=dep, hour=start, input_tokens=1_000_000, output_tokens=0,
                       requests=1)


def test_spend_list_is_paginated_filtered_and_does_not_rate(priced, as_user, operator):
    # 1M tokens (0.50) + 1 slice-hour (2.00) = 2.50 each; limits make one blocked, one warned, one fine
    _tenant_with_usage("blocked", priced, limit=D("2.00"))
    _tenant_with_usage("warned", priced, limit=D("3.00"))
    _tenant_with_usage("fine", priced, limit=D("100.00"))
    _tenant_with_usage("nolimit", priced)
    rate_all()
    rated_at = dict(Invoice.objects.values_list("tenant__slug", "rated_at"))
    api = as_user(operator)
    r = api.get("/api/v1/billing/spend/?page_size=2")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["count"] == 4 and body["next"] and [x["tenant"] for x in body["results"]] == ["blocked", "fine"]
    assert body["results"][0] | {"rated_at": None} == {
        "tenant": "blocked", "spend": "2.50", "currency": "USD", "limit": "2.00", "ratio": 1.25, "warn": True,
        "blocked": True, "period_start": billing.month_of(datetime.now(UTC)).isoformat(), "status": "draft",
        "rated_at": None}
    assert [x["tenant"] for x in api.get(body["next"]).json()["results"]] == ["nolimit", "warned"]
    assert [x["tenant"] for x in api.get("/api/v1/billing/spend/?over_limit=true").json()["results"]] == ["blocked"]
    assert [x["tenant"] for x in api.get("/api/v1/billing/spend/?warning=true").json()["results"]] == [
        "blocked", "warned"]
    assert [x["tenant"] for x in api.get("/api/v1/billing/spend/?warning=false").json()["results"]] == [
        "fine", "nolimit"]
    assert api.get("/api/v1/billing/spend/?warning=maybe").status_code == 400
    # more usage after the rating: the list shows the rated figure (a read never rates)
    UsageHourly.objects.filter(tenant__slug="fine").update(input_tokens=9_000_000)
    fine = api.get("/api/v1/billing/spend/?tenant=fine").json()["results"]
    assert fine[0]["spend"] == "2.50"
    assert dict(Invoice.objects.values_list("tenant__slug", "rated_at")) == rated_at


def _queries(fn) -> int:
    with CaptureQueriesContext(connection) as q:
        fn()
    return len(q.captured_queries)


def test_billing_reads_make_the_same_queries_for_more_tenants(priced, as_user, operator):
    api = as_user(operator)
    reads = ("/api/v1/billing/spend/", "/api/v1/invoices/?page_size=500", "/api/v1/billing/usage/?group_by=tenant")
    for slug in ("a1", "a2"):
        _tenant_with_usage(slug, priced, hours=3)
    rate_all()
    small = {u: _queries(lambda u=u: api.get(u)) for u in reads}
    for i in range(6):
        _tenant_with_usage(f"b{i}", priced, hours=6)
    rate_all()
    assert Invoice.objects.count() == 8
    big = {u: _queries(lambda u=u: api.get(u)) for u in reads}
    assert big == small


def _samples(start, hours=2):
    rows, mig = [], []
    for g in Gpu.objects.all():
        for m in range(0, hours * 60, 5):
            ts = start + timedelta(minutes=m)
            rows.append(GpuSample(gpu=g, resolution=Resolution.RAW, ts=ts, activity=0.5, memory_used_mb=1,
                                  memory_total_mb=2, power_w=500, energy_j=1e6 + m * 150_000, temperature_c=50,
                                  sm_clock_mhz=1900))
            mig.append(MigSample(gpu=g, mig_uuid=f"MIG-{g.pk}", gi_id=1, compute_slices=3, resolution=Resolution.RAW,
                                 ts=ts, memory_used_mb=1, memory_total_mb=2))
    GpuSample.objects.bulk_create(rows, ignore_conflicts=True)
    MigSample.objects.bulk_create(mig, ignore_conflicts=True)


FLEET_CHARTS = ("fleet-utilization", "gpu-heatmap", "mig-slots", "power-cost")


def test_fleet_charts_make_the_same_queries_at_two_fleet_sizes(h100_node, operator):
    op = principal_for_user(operator)
    params = {"hours": "3"}
    start = (timezone.now() - timedelta(hours=2)).replace(second=0, microsecond=0)
    _samples(start)
    small = {n: _queries(lambda n=n: charts.figure_json(n, op, params)) for n in FLEET_CHARTS}
    for i in range(2):
        make_node(f"node-b{i}")
    _samples(start)
    assert Gpu.objects.count() == 24
    big = {n: _queries(lambda n=n: charts.figure_json(n, op, params)) for n in FLEET_CHARTS}
    assert big == small
    util = charts.figure_json("fleet-utilization", op, params)["data"]
    assert util["fleet"] and set(util["fleet"]) == {50.0}
    power = charts.figure_json("power-cost", op, params)["data"]
    # 24 GPUs x 23 increments of 750 kJ (5 minutes apart) each over the window; 3 of 7 compute slices held
    assert power["total_kwh"] == pytest.approx(24 * 23 * 750_000 / 3_600_000)
    assert power["unallocated_kwh"] == pytest.approx(power["total_kwh"])  # the samples name no allocation


def test_charts_cap_their_points_and_bucket_the_heatmap(h100_node, operator, settings):
    op = principal_for_user(operator)
    _samples((timezone.now() - timedelta(hours=6)).replace(second=0, microsecond=0) + timedelta(minutes=1), hours=6)
    util = charts.figure_json("fleet-utilization", op, {"hours": "6", "resolution": "raw"})["data"]
    assert util["step_s"] == 60 and len(util["ts"]) == 6 * 12  # one sample every 5 minutes, each its own minute
    wide = charts.figure_json("fleet-utilization", op, {"hours": str(24 * 30), "resolution": "raw"})["data"]
    assert len(wide["ts"]) <= charts.MAX_POINTS and wide["step_s"] >= 7200
    heat = charts.figure_json("gpu-heatmap", op, {"hours": "6"})["data"]
    assert len(heat["ts"]) <= charts.HEATMAP_COLUMNS and len(heat["gpus"]) == 8 and not heat["per_node"]
    with mock.patch.object(charts, "HEATMAP_ROWS", 4):
        per_node = charts.figure_json("gpu-heatmap", op, {"hours": "6"})["data"]
    assert per_node["per_node"] and per_node["gpus"] == ["node-a (8 GPUs)"]
    assert {v for row in per_node["z"] for v in row if v is not None} == {50.0}


def test_an_empty_chart_says_no_data(h100_node, operator):
    fig = charts.figure_json("fleet-utilization", principal_for_user(operator), {"hours": "1"})["figure"]
    assert [a["text"] for a in fig["layout"]["annotations"]] == ["no data yet"]


MONEY_CHARTS = ("cost-per-tier", "h100-vs-h200", "tenant-usage")


def test_money_charts_make_the_same_queries_for_more_tenants(priced, operator):
    op = principal_for_user(operator)
    start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    params = {"start": start.isoformat(), "end": (start + timedelta(days=1)).isoformat()}
    for slug in ("a1", "a2"):
        _tenant_with_usage(slug, priced, hours=2)
    small = {n: _queries(lambda n=n: charts.figure_json(n, op, params)) for n in MONEY_CHARTS}
    for i in range(5):
        _tenant_with_usage(f"b{i}", priced, hours=4)
    big = {n: _queries(lambda n=n: charts.figure_json(n, op, params)) for n in MONEY_CHARTS}
    assert big == small
    tiers = charts.figure_json("cost-per-tier", op, params)["data"]["tiers"]
    # 7 tenants: 2 x 2 h + 5 x 4 h of 1M tokens at 0.50, and 7 slice-hours at 2.00
    assert tiers[priced.key]["amount"] == str(D(24 * 0.5 + 7 * 2).quantize(D("0.000001")))
    usage = charts.figure_json("tenant-usage", op, params)["data"]["tenants"]
    assert usage["b0"]["tokens"][:4] == [1_000_000] * 4 and usage["b0"]["total"] == "4.00"


def test_chart_page_has_a_time_range_picker_auto_refresh_and_readable_dates(h100_node, operator, client):
    client.force_login(operator)
    r = client.get("/charts/cost-per-tier/?hours=168&refresh=60&currency=EUR")
    assert r.status_code == 200
    html = r.content.decode()
    for value, label in (("1", "last 1 h"), ("24", "last 24 h"), ("720", "last 30 days")):
        assert f'<option value="{value}">{label}</option>' in html
    assert '<option value="168" selected>last 7 days</option>' in html
    assert '<option value="60" selected>1 min</option>' in html and '<option value="EUR" selected>EUR</option>' in html
    period = html.split('id="period">')[1].split("</span>")[0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d – \d{4}-\d\d-\d\d \d\d:\d\d UTC", period), period
    assert 'href="/charts/fleet-utilization/"' in html
    custom = client.get("/charts/fleet-utilization/?start=2026-11-01T00:00&end=2026-11-02T00:00")
    assert custom.status_code == 200 and "2026-11-01 00:00 – 2026-11-02 00:00 UTC" in custom.content.decode()
    assert '<option value="custom" selected>' in custom.content.decode()
    fig = charts.figure_json("cost-per-tier", principal_for_user(operator), {"hours": "24"})["figure"]
    assert all(ax.get("exponentformat") == "none" for k, ax in fig["layout"].items() if k.startswith("yaxis"))


def test_a_tenant_sees_only_its_own_spend_row(priced, as_key):
    from tests.factories import make_key

    mine, _other = _tenant_with_usage("mine", priced), _tenant_with_usage("other", priced, limit=D("1.00"))
    rate_all()
    _, secret = make_key(mine, ["billing:read"])
    api = as_key(secret)
    assert [r["tenant"] for r in api.get("/api/v1/billing/spend/").json()["results"]] == ["mine"]
    assert api.get("/api/v1/billing/spend/?tenant=other").json() == {
        "count": 0, "next": None, "previous": None, "results": []}
    assert api.get("/api/v1/billing/spend/?over_limit=true").json()["count"] == 0  # other's state does not leak


def test_energy_rollup_sums_to_the_samples_and_serves_long_ranges(h100_node, priced, django_assert_max_num_queries):
    from telemetry.models import EnergyHourly
    from telemetry.services import energy

    t0 = (timezone.now() - timedelta(hours=12)).replace(minute=0, second=0, microsecond=0)
    gpus = list(Gpu.objects.order_by("index")[:2])
    alloc = AllocationFactory(order=OrderFactory(tier=priced))
    rows, mig = [], []
    for i, g in enumerate(gpus):
        for m in range(0, 10 * 60 + 1, 5):
            ts = t0 + timedelta(minutes=m)
            rows.append(GpuSample(gpu=g, resolution=Resolution.RAW, ts=ts, activity=0.5, memory_used_mb=1,
                                  memory_total_mb=2, power_w=500, energy_j=1e6 + m * (150_000 + i * 50_000),
                                  temperature_c=50, sm_clock_mhz=1900))
            if i == 0 and m % 10 == 0:  # a 3g slice on GPU 0 half of the time
                mig.append(MigSample(gpu=g, mig_uuid="MIG-a", gi_id=1, compute_slices=3, allocation=alloc,
                                     tenant=alloc.tenant, resolution=Resolution.RAW, ts=ts, memory_used_mb=1,
                                     memory_total_mb=2))
    GpuSample.objects.bulk_create(rows)
    MigSample.objects.bulk_create(mig)
    assert energy.rollup_hours(now=t0 + timedelta(hours=10, minutes=15)) == 10
    assert energy.rollup_hours(now=t0 + timedelta(hours=10, minutes=15)) == 0  # nothing new: idempotent
    assert EnergyHourly.objects.filter(gpu__isnull=True, allocation=alloc).count() == 10
    start, end = t0 + timedelta(minutes=30), t0 + timedelta(hours=9, minutes=20)
    direct = energy.apportion(start, end)
    # the rollup's markers and sums, and both edges from the samples in two statements, not every sample
    with django_assert_max_num_queries(4):
        rolled = energy.apportion_range(start, end)
    assert rolled.total_kwh == pytest.approx(direct.total_kwh) and direct.total_kwh > 0
    assert rolled.unallocated_kwh == pytest.approx(direct.unallocated_kwh)
    assert rolled.allocation_kwh[alloc.pk] == pytest.approx(direct.allocation_kwh[alloc.pk])
    assert direct.allocation_kwh[alloc.pk] > 0
    assert rolled.tenant_kwh[alloc.tenant_id] == pytest.approx(direct.tenant_kwh[alloc.tenant_id])
    for g in gpus:
        assert rolled.gpu_kwh[g.pk] == pytest.approx(direct.gpu_kwh[g.pk])
    # with 5-minute rollups, the hours, both edges and a direct apportioning all read them, and still agree
    from telemetry.services import downsample

    downsample.downsample(now=t0 + timedelta(hours=10, minutes=15))
    EnergyHourly.objects.all().delete()
    energy.rollup_hours(now=t0 + timedelta(hours=10, minutes=15))
    assert set(energy.choose_resolutions(start, end, coarsest=Resolution.FIVE_MIN).values()) == {Resolution.FIVE_MIN}
    five = energy.apportion(start, end, coarsest=Resolution.FIVE_MIN)
    rolled = energy.apportion_range(start, end, coarsest=Resolution.FIVE_MIN)
    assert five.total_kwh == pytest.approx(direct.total_kwh) and rolled.total_kwh == pytest.approx(five.total_kwh)
    assert rolled.unallocated_kwh == pytest.approx(five.unallocated_kwh)
    assert five.allocation_kwh[alloc.pk] > 0
    assert rolled.allocation_kwh[alloc.pk] == pytest.approx(five.allocation_kwh[alloc.pk])
    for g in gpus:
        assert rolled.gpu_kwh[g.pk] == pytest.approx(five.gpu_kwh[g.pk])
    GpuSample.objects.exclude(resolution=Resolution.RAW).delete()  # raw samples only again
    MigSample.objects.exclude(resolution=Resolution.RAW).delete()
    # an hour with no samples is rolled up too (a marker row), so a range across it still reads the rollup
    GpuSample.objects.filter(ts__gte=t0 + timedelta(hours=4), ts__lt=t0 + timedelta(hours=5)).delete()
    EnergyHourly.objects.all().delete()
    energy.rollup_hours(now=t0 + timedelta(hours=10, minutes=15))
    assert EnergyHourly.objects.filter(hour=t0 + timedelta(hours=4), gpu__isnull=True, allocation__isnull=True,
                                       tenant__isnull=True).exists()
    expected = energy.apportion(start, end).total_kwh
    with django_assert_max_num_queries(4):
        assert energy.apportion_range(start, end).total_kwh == pytest.approx(expected)
    # a range the rollup does not cover reads the samples
    assert energy.apportion_range(t0 - timedelta(hours=5), end).total_kwh == pytest.approx(
        energy.apportion(t0 - timedelta(hours=5), end).total_kwh)


def test_energy_daily_rollup_stands_for_its_hours_in_long_ranges(h100_node, priced, django_assert_max_num_queries):
    from telemetry.models import EnergyDaily, EnergyHourly
    from telemetry.services import energy

    day0 = (timezone.now() - timedelta(days=3)).replace(hour=0, minute=0, second=0, microsecond=0)
    t0 = day0 - timedelta(hours=5)  # the hourly rollup starts mid-day: that day is never complete
    gpu = Gpu.objects.order_by("index").first()
    alloc = AllocationFactory(order=OrderFactory(tier=priced))
    rows, mig = [], []
    for m in range(0, 60 * 60 + 1, 10):  # 60 hours, a sample every 10 minutes
        ts = t0 + timedelta(minutes=m)
        rows.append(GpuSample(gpu=gpu, resolution=Resolution.RAW, ts=ts, activity=0.5, memory_used_mb=1,
                              memory_total_mb=2, power_w=500, energy_j=1e6 + m * 120_000 + (m // 600) * 7_000,
                              temperature_c=50, sm_clock_mhz=1900))
        if m % 20 == 0:  # a 3g slice a third of the time
            mig.append(MigSample(gpu=gpu, mig_uuid="MIG-a", gi_id=1, compute_slices=3, allocation=alloc,
                                 tenant=alloc.tenant, resolution=Resolution.RAW, ts=ts, memory_used_mb=1,
                                 memory_total_mb=2))
    GpuSample.objects.bulk_create(rows)
    MigSample.objects.bulk_create(mig)
    assert energy.rollup_hours(now=t0 + timedelta(hours=60, minutes=15), max_hours=100) == 60
    assert energy.rollup_days() == 2  # day0 and day0 + 1: the first and last days are partial
    assert energy.rollup_days() == 0  # nothing new: idempotent
    assert sorted(EnergyDaily.objects.filter(energy.MARKER).values_list("day", flat=True)) == [
        day0, day0 + timedelta(days=1)]
    start, end = t0 + timedelta(minutes=30), t0 + timedelta(hours=59, minutes=40)
    direct = energy.apportion(start, end)
    # the days' rows stand for their hours: without the hours' own rows (their markers stay) the answer holds
    EnergyHourly.objects.filter(hour__gte=day0, hour__lt=day0 + timedelta(days=2)).exclude(energy.MARKER).delete()
    with django_assert_max_num_queries(6):  # markers of hours and days, days, hours, the two edges (two statements)
        rolled = energy.apportion_range(start, end)
    assert direct.total_kwh > 0 and direct.allocation_kwh[alloc.pk] > 0
    assert rolled.total_kwh == pytest.approx(direct.total_kwh)
    assert rolled.unallocated_kwh == pytest.approx(direct.unallocated_kwh)
    assert rolled.gpu_kwh[gpu.pk] == pytest.approx(direct.gpu_kwh[gpu.pk])
    assert rolled.allocation_kwh[alloc.pk] == pytest.approx(direct.allocation_kwh[alloc.pk])
    assert rolled.tenant_kwh[alloc.tenant_id] == pytest.approx(direct.tenant_kwh[alloc.tenant_id])
    # a gap in the daily rollup: the hours are read instead (here: missing, so less than the samples)
    EnergyDaily.objects.filter(day=day0).delete()
    assert energy.apportion_range(start, end).total_kwh < direct.total_kwh


def test_every_billing_read_makes_the_same_queries_for_more_tenants(priced, as_user, operator):
    """Beyond the lists above: filtered spend pages, the credit-note list, every usage grouping, and one
    invoice's detail and exports (JSON, CSV) — at 2 and 8 tenants."""
    api = as_user(operator)
    reads = ["/api/v1/billing/spend/?warning=true", "/api/v1/billing/spend/?over_limit=false&page_size=1",
             "/api/v1/credit-notes/", "/api/v1/invoices/?page_size=1"] + [
        f"/api/v1/billing/usage/?group_by={g}" for g in ("deployment", "tier", "hour", "day")]

    def measure():
        inv = Invoice.objects.order_by("-pk").first()
        one = [f"/api/v1/invoices/{inv.pk}/", f"/api/v1/invoices/{inv.pk}/export/?format=json",
               f"/api/v1/invoices/{inv.pk}/export/?format=csv"]
        out = {}
        for u in reads + one:
            with CaptureQueriesContext(connection) as q:
                r = api.get(u)
            assert r.status_code == 200, (u, r.content[:200])
            out[u.replace(str(inv.pk), "ID")] = len(q.captured_queries)
        return out

    for slug in ("a1", "a2"):
        _tenant_with_usage(slug, priced, hours=3, limit=D("1.00"))
    rate_all()
    small = measure()
    for i in range(6):
        _tenant_with_usage(f"b{i}", priced, hours=6, limit=D("1.00"))
    rate_all()
    assert measure() == small
