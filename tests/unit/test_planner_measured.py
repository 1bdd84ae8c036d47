"""The capacity planner on stored data: throughput measured from metering + Triton execution time
(end to end through the simulated Triton and the scraper), the power curve fitted to GPU samples,
demand from the deployments, the console page and the API (operators only)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace import formatting, planner
from marketplace.models import Gpu, MigProfile
from marketplace.selectors import capacity_planning
from marketplace.selectors.catalog import modelled_tokens_per_s
from marketplace.services import deployments
from telemetry.models import GpuSample, TritonServedHourly, UsageHourly
from telemetry.services import ingest, scrape
from tenants.roles import Role
from tenants.scoping import Principal, principal_for_user
from tests.factories import make_key
from tests.unit.test_scrape import _deploy

pytestmark = pytest.mark.django_db
H100 = "h100-sxm-80gb"
SHAPE_3G = f"{H100}/3g.40gb"


def _hour():
    return timezone.now().replace(minute=0, second=0, microsecond=0)


@pytest.fixture
def busy(world, members_a, h100_node, tiers):
    """A ready tiny-gen on an H100 3g.40gb slice of tenant A."""
    return {"dep": _deploy(members_a[Role.OWNER], world["a"], tiers["3g"]), "node": h100_node, **world}


def serve(dep, n: int, words: int = 400, max_tokens: int = 100) -> tuple[int, int]:
    """n requests through the slice's (simulated) Triton; the tokens reported are metered, as a gateway does."""
    server = deployments.backend_for(dep.allocation)
    prompt = " ".join(["token"] * words)
    events, total = [], 0
    for i in range(n):
        out = server.infer_text(dep.name, prompt, max_tokens=max_tokens)
        total += out["input_tokens"] + out["output_tokens"]
        events.append({"event_id": f"t-{dep.pk}-{i}-{timezone.now().timestamp()}", "deployment": dep.pk,
                       "ts": timezone.now().isoformat(), "input_tokens": out["input_tokens"],
                       "output_tokens": out["output_tokens"], "requests": 1})
    ingest.ingest_batch(Principal(is_operator=True), dep.tenant, events)
    return total, n


def shape(key: str, figures) -> capacity_planning.ShapeFigures:
    return next(f for f in figures if f.key == key)


def test_simulated_triton_runs_at_the_slices_modelled_rate(busy):
    dep = busy["dep"]
    rate = modelled_tokens_per_s(dep.allocation.tier.gpu_model, dep.allocation.tier.profile)
    server = deployments.backend_for(dep.allocation)
    before = server.statistics(dep.name)["execution_ns"]
    out = server.infer_text(dep.name, " ".join(["w"] * 500), max_tokens=200)
    spent = server.statistics(dep.name)["execution_ns"] - before
    assert out["input_tokens"] == 500 and out["output_tokens"] == 200
    assert spent == pytest.approx(700 / rate * 1e9, rel=1e-6)


def test_measured_throughput_from_metering_and_execution_time(busy):
    dep = busy["dep"]
    tokens, _ = serve(dep, 300)  # 300 x 500 tokens on a 3g (~4,307 tok/s): ~35 s of execution
    scrape.scrape_node(busy["node"].pk)
    row = TritonServedHourly.objects.get(deployment=dep)
    assert row.requests == 300 and row.execution_ns > 0
    since, until = capacity_planning.window(1)
    f = shape(SHAPE_3G, capacity_planning.shape_figures(since, until))
    assert f.measured_tokens == tokens
    assert f.measured_seconds == pytest.approx(row.execution_ns / 1e9)
    assert f.measured_seconds < capacity_planning.MIN_MEASURED_SECONDS  # not enough yet: the model is used
    assert f.measured_tps is None and f.source == "modelled" and f.tokens_per_s == f.modelled_tps
    assert f.peak_tps == pytest.approx(tokens / 3600)

    more, _ = serve(dep, 300)
    scrape.scrape_node(busy["node"].pk)
    f = shape(SHAPE_3G, capacity_planning.shape_figures(since, until))
    assert f.measured_seconds >= capacity_planning.MIN_MEASURED_SECONDS
    assert f.source == "measured"
    # the simulator executes at the modelled rate, so the measurement recovers it
    assert f.measured_tps == pytest.approx((tokens + more) / f.measured_seconds)
    assert f.measured_tps == pytest.approx(f.modelled_tps, rel=1e-3)
    assert f.tier.key == "h100-3g" and f.plan is not None
    other = shape(f"{H100}/1g.10gb", capacity_planning.shape_figures(since, until))
    assert other.measured_tps is None and other.measured_tokens == 0


def test_scrape_lag_does_not_bias_the_measurement(busy):
    dep = busy["dep"]
    tokens, n = serve(dep, 600)
    scrape.scrape_node(busy["node"].pk)
    late, m = serve(dep, 200)  # metered at once; Triton's side waits for the next scrape
    f = shape(SHAPE_3G, capacity_planning.shape_figures(*capacity_planning.window(1)))
    assert f.measured_requests == n + m and f.served_requests == n
    assert f.measured_tps == pytest.approx(f.modelled_tps, rel=1e-3)  # not (tokens + late) / seconds
    assert (tokens + late) / f.measured_seconds > 1.3 * f.modelled_tps


def test_hours_without_execution_time_are_not_measured(busy):
    dep = busy["dep"]
    # Usage reported for an hour Triton has no execution time for (e.g. backfilled): not a measurement.
    UsageHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=_hour() - timedelta(hours=3),
                               input_tokens=10**9, output_tokens=0, requests=1, events=1)
    TritonServedHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=_hour() - timedelta(hours=2),
                                      requests=5, execution_ns=120 * 10**9)  # execution without metering
    f = shape(SHAPE_3G, capacity_planning.shape_figures(*capacity_planning.window(1)))
    assert f.measured_tokens == 0 and f.measured_seconds == 0 and f.measured_tps is None
    TritonServedHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=_hour() - timedelta(hours=3),
                                      requests=5, execution_ns=100 * 10**9)
    f = shape(SHAPE_3G, capacity_planning.shape_figures(*capacity_planning.window(1)))
    # 10^9 tokens per metered request x 5 requests per 100 s of execution
    assert f.measured_tps == pytest.approx(10**9 / 1 * 5 / 100)


def test_power_line_fitted_to_samples(catalog, h100_node):
    gpus = list(Gpu.objects.all())
    now = timezone.now()
    for i in range(40):
        act = (i % 10) / 10
        for g in gpus[:2]:
            GpuSample.objects.create(gpu=g, resolution="5m", ts=now - timedelta(minutes=5 * i + g.index),
                                     activity=act, memory_used_mb=1, memory_total_mb=2, power_w=90 + 500 * act,
                                     energy_j=0, temperature_c=40, sm_clock_mhz=1000)
    p = capacity_planning.power_figures(now - timedelta(days=1), now + timedelta(minutes=1))
    assert p[H100].source == "measured" and p[H100].samples == 80
    assert p[H100].idle_w == pytest.approx(90) and p[H100].max_w == pytest.approx(590)
    assert p["h200-sxm-141gb"].source == "modelled"
    assert p["h200-sxm-141gb"].max_w == 700


def test_flat_activity_keeps_the_modelled_power(catalog, h100_node):
    g = Gpu.objects.first()
    now = timezone.now()
    for i in range(30):
        GpuSample.objects.create(gpu=g, resolution="5m", ts=now - timedelta(minutes=5 * i), activity=0.3,
                                 memory_used_mb=1, memory_total_mb=2, power_w=300, energy_j=0, temperature_c=40,
                                 sm_clock_mhz=1000)
    assert capacity_planning.power_figures(now - timedelta(days=1), now)[H100].source == "modelled"


def test_demand_is_each_tenant_models_busiest_hour(busy, tiers, members_a):
    dep = busy["dep"]
    second = _deploy(members_a[Role.OWNER], busy["a"], tiers["1g"])  # same model name on another slice
    h = _hour()
    UsageHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=h - timedelta(hours=2), input_tokens=3600,
                               output_tokens=3600, requests=1, events=1)
    UsageHourly.objects.create(tenant=dep.tenant, deployment=second, hour=h - timedelta(hours=2), input_tokens=3600,
                               requests=1, events=1)
    UsageHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=h - timedelta(hours=5), input_tokens=720,
                               requests=1, events=1)
    (row,) = capacity_planning.measured_demand(*capacity_planning.window(1))
    assert row["name"] == f"{busy['a'].slug}/tiny-gen"
    assert row["tokens_per_s"] == pytest.approx(3.0)  # (3600 + 3600 + 3600) / 3600 in the busiest hour
    assert row["min_memory_gib"] == 0.063  # 64 MiB, rounded up
    assert row["now_on"] == ["h100-1g", "h100-3g"]


def test_build_plan_uses_overrides_and_prices(busy):
    req = capacity_planning.PlanRequest(workloads=[planner.Workload("llm", 8_000, 30)], gpu_models=(H100,),
                          throughput={SHAPE_3G: 100_000.0}, gpu_hour_cost={H100: 2.0}, price_per_kwh=0.0)
    report = capacity_planning.build_plan(req)
    best = report.best.result
    assert best.feasible and best.gpus == {H100: 1}
    (a,) = best.assignments
    assert a.shape == SHAPE_3G and a.slices == 1  # the given 100k tok/s makes one 3g enough
    assert shape(SHAPE_3G, report.shapes).source == "given"
    # revenue at list price: 1 slice-hour at 1.00 plus 8,000 tok/s x 3600 at the input/output mix
    share = report.input_share
    tokens_m = 8_000 * 3600 / 1e6
    assert report.best.revenue_per_hour == pytest.approx(1.0 + tokens_m * (0.10 * share + 0.40 * (1 - share)))
    assert report.best.margin_per_hour == pytest.approx(report.best.revenue_per_hour - 2.0)
    assert report.best.price_per_1k_tokens == pytest.approx(report.best.revenue_per_hour / (8_000 * 3.6))
    body = capacity_planning.report_dict(report)
    assert body["scenarios"][0]["gpus"] == {H100: 1}


@pytest.mark.parametrize("kw, field", [
    ({"throughput": {"h100-sxm-80gb/9g.1tb": 5.0}}, "throughput"),
    ({"gpu_hour_cost": {"a100": 1.0}}, "gpu_hour_cost"),
    ({"gpu_models": ("a100",)}, "gpu_models"),
    ({"growth": 0}, "growth"),
])
def test_build_plan_refuses_bad_input(catalog, kw, field):
    with pytest.raises(planner.PlanError) as exc:
        capacity_planning.build_plan(capacity_planning.PlanRequest(workloads=[planner.Workload("w", 10, 1)], **kw))
    assert exc.value.field == field


# --- console page ---------------------------------------------------------------------------------

def _page_params(**extra):
    params = {"plan": "1", "w-TOTAL_FORMS": "2", "w-INITIAL_FORMS": "0", "w-MIN_NUM_FORMS": "0",
              "w-MAX_NUM_FORMS": "40", "w-0-name": "chat", "w-0-tokens_per_s": "20000", "w-0-min_memory_gib": "70",
              "w-0-gpu_model": "", "w-1-name": "", "w-1-tokens_per_s": "", "w-1-min_memory_gib": "",
              "w-1-gpu_model": "", "target_utilization": "70", "growth": "1", "window_days": "7",
              "price_per_kwh": "0.12", "currency": "USD", "gpu_models": [H100, "h200-sxm-141gb"],
              f"cost_{H100}": "1.89", "cost_h200-sxm-141gb": "2.50"}
    params.update(extra)
    return params


def test_console_planner_page(client, operator, catalog, tiers):
    client.force_login(operator)
    r = client.get("/console/planner/")
    assert r.status_code == 200
    assert b"No demand measured in the window yet" in r.content
    r = client.get("/console/planner/", _page_params())
    assert r.status_code == 200, r.content[:500]
    report = r.context["report"]
    best = report.best.result
    assert best.feasible
    assert sum(a.slices * shape(a.shape, report.shapes).tokens_per_s * 0.7 for a in best.assignments) >= 20_000
    assert b'id="plan-chart"' in r.content and b"Optimal layouts" in r.content
    assert formatting.unit_price_4(best.cost_per_1m_tokens, "USD").encode() in r.content  # per 1M, as the charts
    assert b"per 1K" not in r.content
    # only layouts of what tiers sell (tiers: H100 1g, 3g, 7g): no slice nobody can buy
    sold = {"1g.10gb", "3g.40gb", "7g.80gb"}
    assert best.layouts and all(set(u.counts) <= sold for u in best.layouts), best.layouts
    for s in r.context["report"].scenarios:
        assert all(set(u.counts) <= sold for u in s.result.layouts if u.gpu_model == H100), (s.key, s.result.layouts)
    assert b"solved now" in r.content
    again = client.get("/console/planner/", _page_params())  # the same inputs: not solved again
    assert again.context["report"].cached and b"solved" in again.content and b"ago for the same inputs" in again.content


def test_console_planner_form_errors(client, operator, catalog, tiers):
    client.force_login(operator)
    r = client.get("/console/planner/", _page_params(**{"w-0-tokens_per_s": "", "target_utilization": "150"}))
    assert r.status_code == 200 and r.context["report"] is None
    assert b"give the name, tokens/s and memory" in r.content
    assert "target_utilization" in r.context["settings_form"].errors
    r = client.get("/console/planner/", _page_params(**{"w-0-min_memory_gib": "500"}))
    assert r.status_code == 200
    assert b"chat needs 500 GiB per replica" in r.content  # infeasible: said, not a 500


def test_console_planner_with_nothing_on_sale_says_so(client, operator, catalog):
    client.force_login(operator)
    r = client.get("/console/planner/", _page_params())
    assert b"nothing is on sale on the GPU models allowed" in r.content


def test_console_planner_is_for_operators(client, world, members_a):
    client.force_login(members_a[Role.OWNER])
    assert client.get("/console/planner/").status_code == 403
    client.logout()
    assert client.get("/console/planner/").status_code == 302


# --- API ------------------------------------------------------------------------------------------

BODY = {"workloads": [{"name": "chat", "tokens_per_s": 40_000, "min_memory_gib": 75},
                      {"name": "embed", "tokens_per_s": 3_000, "min_memory_gib": 8, "gpu_models": [H100]}]}


def test_api_plan_for_operators(api, operator, catalog, tiers):
    _, secret = make_key(None, ["read"], created_by=operator)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    r = api.post("/api/v1/planner/?figure=1", BODY, format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    best = body["scenarios"][0]
    assert best["key"] == "optimal" and best["feasible"]
    assert {a["workload"] for a in best["assignments"]} == {"chat", "embed"}
    embed = next(a for a in best["assignments"] if a["workload"] == "embed")
    assert embed["gpu_model"] == H100
    assert best["cost_per_1k_tokens"] == pytest.approx(best["cost_per_hour"] / (43_000 * 3.6), rel=1e-4)
    assert [s["key"] for s in body["scenarios"]] == ["optimal", f"only-{H100}", "only-h200-sxm-141gb", "whole-gpus"]
    assert body["figure"]["data"]
    r = api.get("/api/v1/planner/inputs/")
    assert r.status_code == 200
    assert {s["shape"] for s in r.json()["shapes"]} >= {SHAPE_3G, f"{H100}/whole"}


@pytest.mark.parametrize("body, field", [
    ({"workloads": []}, "workloads"),
    ({"workloads": [{"name": "a", "tokens_per_s": -1, "min_memory_gib": 1}]}, "workloads"),
    ({**BODY, "target_utilization": 2}, "target_utilization"),
    ({**BODY, "throughput": {"h100-sxm-80gb/2g.99gb": 100}}, "throughput"),
    ({"workloads": [BODY["workloads"][0], BODY["workloads"][0]]}, "workloads"),
])
def test_api_plan_bad_input(api, operator, catalog, body, field):
    api.force_authenticate(operator)
    r = api.post("/api/v1/planner/", body, format="json")
    assert r.status_code == 400 and field in r.json()


def test_api_plan_refused_to_tenants(api, world, members_a, catalog):
    _, secret = make_key(world["a"], ["read", "billing:read", "usage:write", "deployments:write"])
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert api.post("/api/v1/planner/", BODY, format="json").status_code == 403
    assert api.get("/api/v1/planner/inputs/").status_code == 403
    api.credentials()
    api.force_authenticate(members_a[Role.OWNER])
    assert api.post("/api/v1/planner/", BODY, format="json").status_code == 403
    api.force_authenticate(None)
    assert api.post("/api/v1/planner/", BODY, format="json").status_code in (401, 403)


def test_profiles_left_out_are_the_media_extension_ones(catalog):
    keys = {f.key for f in capacity_planning.shape_figures(*capacity_planning.window(1))}
    me = MigProfile.objects.filter(media_extensions=True).values_list("gpu_model__key", "name")
    assert me.exists() and not any(f"{m}/{n}" in keys for m, n in me)
    assert len(keys) == 14  # 6 MIG profiles + whole GPU, for each of the two models
    assert principal_for_user(None).is_operator is False


def test_console_planner_queries_do_not_grow_with_deployments(client, operator, busy):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from marketplace.models import ModelDeployment

    dep = busy["dep"]

    def add_usage(d):
        UsageHourly.objects.create(tenant=d.tenant, deployment=d, hour=_hour() - timedelta(hours=1),
                                   input_tokens=36_000, output_tokens=0, requests=1, events=1)

    add_usage(dep)
    client.force_login(operator)

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            r = client.get("/console/planner/")
        assert r.status_code == 200 and r.context["report"] is not None
        return len(ctx.captured_queries)

    one = count()
    for i in range(5):
        add_usage(ModelDeployment.objects.create(allocation=dep.allocation, tenant=dep.tenant, name=f"m{i}",
                                                 backend="python", spec={}, memory_mb=10, state="ready"))
    assert len(client.get("/console/planner/").context["report"].request.workloads) == 6
    assert count() == one


@pytest.mark.parametrize("edit", [
    {"w-TOTAL_FORMS": None, "w-INITIAL_FORMS": None, "w-MIN_NUM_FORMS": None, "w-MAX_NUM_FORMS": None},
    {"w-TOTAL_FORMS": "abc"},
    {"w-TOTAL_FORMS": "-3", "w-INITIAL_FORMS": "9"},
    {"w-TOTAL_FORMS": "100000"},
    {"w-MAX_NUM_FORMS": "zz", "w-MIN_NUM_FORMS": "5"},
    {"target_utilization": None, "growth": None, "price_per_kwh": None, "currency": None, f"cost_{H100}": None},
])
def test_console_planner_edited_url_never_shows_hidden_field_messages(client, operator, catalog, tiers, edit):
    """Issue 15 point 7: a link whose hidden formset counts were edited or dropped, or that lacks some
    settings, plans what it holds (settings at their defaults) instead of Django's hidden-field errors."""
    client.force_login(operator)
    params = {k: v for k, v in (_page_params() | edit).items() if v is not None}
    r = client.get("/console/planner/", params)
    html = r.content.decode()
    assert r.status_code == 200
    assert "Hidden field" not in html and "ManagementForm" not in html and "tampered" not in html
    assert r.context["report"] is not None and r.context["report"].best.result.feasible, html[:2000]
    if edit.get("w-TOTAL_FORMS") == "100000":
        assert "at most 40 workloads" in html
    if "currency" in edit:
        assert "Not in the link, so at their defaults" in html and r.context["plan"]["currency"] == "USD"


def test_console_planner_bare_plan_link_says_what_is_missing(client, operator, catalog):
    client.force_login(operator)
    html = client.get("/console/planner/", {"plan": "1"}).content.decode()
    assert "Hidden field" not in html and "ManagementForm" not in html
    assert "give at least one workload" in html
    html = client.get("/console/planner/", _page_params(target_utilization="lots")).content.decode()
    assert "Hidden field" not in html and "Enter a number." in html
