"""GPU telemetry: the NVML collector (simulated backend driven by metering), downsampling and
retention, energy apportioning, the Plotly charts (numbers from stored data), their endpoints,
the Prometheus exposition and plotly.js served from static files."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from unittest import mock

import pynvml
import pytest
from django.test import Client
from django.utils import timezone

from marketplace.hardware.nvml_sim import SimNvml
from marketplace.models import Allocation, Gpu, ModelDeployment
from marketplace.services import orders, provisioning
from telemetry import charts, metrics
from telemetry.models import CollectorError, GpuSample, MigSample, Resolution, UsageHourly
from telemetry.services import collector, downsample, energy
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import DeploymentFactory, MembershipFactory, TenantFactory, make_key
from tests.fleet_fixtures import make_node, make_tier

pytestmark = pytest.mark.django_db
R = Resolution
T0 = datetime(2026, 11, 2, 10, 0, tzinfo=UTC)


def _hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


@pytest.fixture
def shop(h100_node, tiers):
    """Tenants alpha (a 3g slice) and bravo (a 1g slice), both active, each with a deployment."""
    out = {"node": h100_node}
    for slug, tier in (("alpha", "3g"), ("bravo", "1g")):
        tenant = TenantFactory(slug=slug, name=slug.title())
        owner = MembershipFactory(tenant=tenant, role=Role.OWNER).user
        p = principal_for_user(owner)
        a = orders.create_order(p, tenant=tenant, tier=tiers[tier]).allocations.get()
        assert provisioning.provision(a.pk) == "activated"
        a = Allocation.objects.select_related("instance__gpu", "tier").get(pk=a.pk)
        dep = ModelDeployment.objects.create(allocation=a, tenant=tenant, name="llm", backend="python", spec={},
                                             memory_mb=4000, state=ModelDeployment.State.READY)
        out[slug] = {"tenant": tenant, "owner": owner, "p": p, "alloc": a, "dep": dep}
    return out


def _usage(entry, hour, inp, out, requests=1):
    return UsageHourly.objects.create(tenant=entry["tenant"], deployment=entry["dep"], hour=hour,
                                      input_tokens=inp, output_tokens=out, requests=requests)


# --- collector -------------------------------------------------------------------------------------

def test_collector_stores_every_gpu_and_drives_the_simulator_from_metering(shop):
    node, alpha = shop["node"], shop["alpha"]
    now = _hour(timezone.now()) + timedelta(minutes=30)
    cap = collector.tier_capacity_tokens_per_s(alpha["alloc"].tier)
    assert cap == pytest.approx(3000 * 3.35 * 3 / 7)
    tokens = int(0.5 * cap * 5400)  # half the slice's capacity over the 90-minute window
    _usage(alpha, _hour(now) - timedelta(hours=1), tokens - 1000, 1000)

    result = collector.collect_node(node.pk, now=now)
    assert result["gpus"] == 8 and result["errors"] == 0
    raw = {s.gpu.index: s for s in GpuSample.objects.filter(resolution=R.RAW).select_related("gpu")}
    assert len(raw) == 8
    # MIG on: NVML utilization is NotSupported -> stored as NULL, not an error; activity is estimated
    assert all(s.utilization is None and s.mig for s in raw.values())
    assert not CollectorError.objects.exists()
    slice_row = MigSample.objects.get(allocation=alpha["alloc"])
    assert slice_row.activity == pytest.approx(tokens / 5400 / cap)
    assert slice_row.tenant_id == alpha["tenant"].pk and slice_row.compute_slices == 3
    gi = alpha["alloc"].instance.gpu.index
    assert raw[gi].activity == pytest.approx(slice_row.activity * 3 / 7)
    # the simulator followed: the loaded GPU draws more power and its slice holds the model's memory
    idle = [s for i, s in raw.items() if i not in {gi, shop["bravo"]["alloc"].instance.gpu.index}]
    assert raw[gi].power_w > max(s.power_w for s in idle) + 50
    assert slice_row.memory_used_mb >= 4000
    bravo_row = MigSample.objects.get(allocation=shop["bravo"]["alloc"])
    assert bravo_row.activity == 0.0

    # a replay within the same second stores nothing twice
    collector.collect_node(node.pk, now=now)
    assert GpuSample.objects.filter(resolution=R.RAW).count() == 8


def test_collector_survives_an_nvml_error_on_one_gpu(h100_node, monkeypatch):
    real = SimNvml.nvmlDeviceGetTemperature

    def broken(self, handle, sensor):
        gpu, _gi, _ci = self._dev(handle)
        if gpu == 3:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return real(self, handle, sensor)

    monkeypatch.setattr(SimNvml, "nvmlDeviceGetTemperature", broken)
    result = collector.collect_node(h100_node.pk)
    assert result["gpus"] == 7 and result["errors"] == 1
    stored = set(GpuSample.objects.values_list("gpu__index", flat=True))
    assert stored == {0, 1, 2, 4, 5, 6, 7}
    err = CollectorError.objects.get()
    assert err.gpu.index == 3 and err.kind == "NVMLError_GpuIsLost" and err.count == 1
    collector.collect_node(h100_node.pk, now=timezone.now() + timedelta(seconds=5))
    assert CollectorError.objects.get().count == 2
    assert ('tessera_collector_errors_total{node="node-a",gpu="3",kind="NVMLError_GpuIsLost"} 2'
            in metrics.render())


# --- downsampling and retention ------------------------------------------------------------------

def _raw_series(gpu, minutes=120, mig=False):
    rows = []
    for i in range(minutes):
        rows.append(GpuSample(
            gpu=gpu, resolution=R.RAW, ts=T0 + timedelta(seconds=60 * i + 7),
            utilization=None if mig else float(i % 10 * 10), utilization_samples=0 if mig else 1,
            activity=(i % 10) / 10, memory_used_mb=1000.0 + i, memory_total_mb=81559.0, power_w=100.0 + 3 * i,
            energy_j=1000.0 * i, temperature_c=30.0 + (i % 7), sm_clock_mhz=1980.0 - i, mig=mig))
    GpuSample.objects.bulk_create(rows)
    return rows


def _expected(rows, step):
    out = {}
    for r in rows:
        out.setdefault(downsample.bucket(r.ts, step), []).append(r)
    return out


def test_downsampling_is_exact_idempotent_and_pruning_keeps_rollups(h100_node):
    g0, g1 = list(Gpu.objects.order_by("index"))[:2]
    rows = _raw_series(g0)
    _raw_series(g1, mig=True)
    MigSample.objects.bulk_create([
        MigSample(gpu=g1, mig_uuid="MIG-x", gi_id=1, compute_slices=3, resolution=R.RAW,
                  ts=T0 + timedelta(seconds=60 * i + 7), memory_used_mb=float(i), memory_total_mb=40000.0,
                  activity=i / 200) for i in range(120)])

    now = T0 + timedelta(hours=2, minutes=5)
    created = downsample.downsample(now=now)
    assert created == {"5m": 48, "mig_5m": 24, "1h": 4, "mig_1h": 2}
    for step, res in ((300, R.FIVE_MIN), (3600, R.HOUR)):
        for b, members in _expected(rows, step).items():
            s = GpuSample.objects.get(gpu=g0, resolution=res, ts=b)
            n = len(members)
            assert s.samples == n
            assert s.power_w == pytest.approx(sum(m.power_w for m in members) / n)
            assert s.utilization == pytest.approx(sum(m.utilization for m in members) / n)
            assert s.activity == pytest.approx(sum(m.activity for m in members) / n)
            assert s.temperature_c == pytest.approx(sum(m.temperature_c for m in members) / n)
            assert s.energy_j == max(m.energy_j for m in members)  # last counter value in the bucket
    assert GpuSample.objects.get(gpu=g1, resolution=R.HOUR, ts=T0).utilization is None  # MIG: stays null
    assert MigSample.objects.get(resolution=R.HOUR, ts=T0).memory_used_mb == pytest.approx(sum(range(60)) / 60)
    snapshot = sorted(GpuSample.objects.exclude(resolution=R.RAW).values_list("gpu_id", "resolution", "ts",
                                                                              "power_w", "energy_j", "samples"))

    assert downsample.downsample(now=now) == {"5m": 0, "mig_5m": 0, "1h": 0, "mig_1h": 0}  # idempotent

    # two days later: raw is past its 24 h and rolled up -> gone; rollups unchanged and still exact
    later = now + timedelta(days=2)
    pruned = downsample.prune(now=later)
    assert pruned["raw"] == 240 and pruned["mig_raw"] == 120 and pruned["5m"] == 0
    assert not GpuSample.objects.filter(resolution=R.RAW).exists()
    assert downsample.downsample(now=later) == {"5m": 0, "mig_5m": 0, "1h": 0, "mig_1h": 0}
    assert sorted(GpuSample.objects.values_list("gpu_id", "resolution", "ts", "power_w", "energy_j",
                                                "samples")) == snapshot
    # 5m rows go after 30 days, hourly after a year
    assert downsample.prune(now=now + timedelta(days=31))["5m"] == 48
    assert GpuSample.objects.filter(resolution=R.HOUR).count() == 4
    assert downsample.prune(now=now + timedelta(days=366))["1h"] == 4


def test_raw_is_never_pruned_before_it_is_rolled_up(h100_node):
    gpu = Gpu.objects.order_by("index").first()
    _raw_series(gpu, minutes=30)
    assert downsample.prune(now=T0 + timedelta(days=3))["raw"] == 0
    assert GpuSample.objects.filter(resolution=R.RAW).count() == 30
    # rolled up only up to 10:20 (grace: buckets must have ended 2 min before now): rows after stay
    downsample.downsample(now=T0 + timedelta(minutes=22))
    assert not GpuSample.objects.filter(resolution=R.HOUR).exists()  # the hour is not complete yet
    assert downsample.prune(now=T0 + timedelta(days=3))["raw"] == 0  # its hour is not rolled up
    downsample.downsample(now=T0 + timedelta(hours=1, minutes=3))
    assert downsample.prune(now=T0 + timedelta(days=3))["raw"] == 30


# --- energy ----------------------------------------------------------------------------------------

def _energy_data(shop):
    """One GPU holding alpha's 3g and bravo's 1g: three samples 1 kWh apart; bravo only in the first
    interval. Returns (gpu, start, end)."""
    a, b = shop["alpha"]["alloc"], shop["bravo"]["alloc"]
    gpu = a.instance.gpu
    start = T0
    for i, e in enumerate((0.0, 3.6e6, 7.2e6)):
        ts = start + timedelta(minutes=i)
        GpuSample.objects.create(gpu=gpu, resolution=R.RAW, ts=ts, activity=0.5, memory_used_mb=1, memory_total_mb=2,
                                 power_w=500, energy_j=e, temperature_c=50, sm_clock_mhz=1900, mig=True)
        if i == 0:
            continue
        MigSample.objects.create(gpu=gpu, mig_uuid="MIG-a", gi_id=1, compute_slices=3, allocation=a,
                                 tenant=a.tenant, resolution=R.RAW, ts=ts, memory_used_mb=1, memory_total_mb=2)
        if i == 1:
            MigSample.objects.create(gpu=gpu, mig_uuid="MIG-b", gi_id=2, compute_slices=1, allocation=b,
                                     tenant=b.tenant, resolution=R.RAW, ts=ts, memory_used_mb=1,
                                     memory_total_mb=2)
    return gpu, start, start + timedelta(minutes=5)


def test_energy_kwh_and_apportioning_by_compute_share(shop, settings):
    gpu, start, end = _energy_data(shop)
    assert energy.gpu_kwh(gpu.pk, start, end) == pytest.approx(2.0)
    rep = energy.apportion(start, end)
    a, b = shop["alpha"], shop["bravo"]
    assert rep.gpu_kwh[gpu.pk] == pytest.approx(2.0) and rep.total_kwh == pytest.approx(2.0)
    assert rep.allocation_kwh[a["alloc"].pk] == pytest.approx(6 / 7)
    assert rep.tenant_kwh[b["tenant"].pk] == pytest.approx(1 / 7)
    assert rep.unallocated_kwh == pytest.approx(2 - 6 / 7 - 1 / 7)
    # a counter reset (driver reload) counts the new value as the increase
    GpuSample.objects.create(gpu=gpu, resolution=R.RAW, ts=start + timedelta(minutes=3), activity=0, memory_used_mb=1,
                             memory_total_mb=2, power_w=1, energy_j=1.8e6, temperature_c=1, sm_clock_mhz=1)
    assert energy.gpu_kwh(gpu.pk, start, end) == pytest.approx(2.5)

    settings.TESSERA_ENERGY_PRICE_PER_KWH = "0.20"
    _usage(a, _hour(start), 300_000, 100_000)
    rows = energy.power_cost_per_tier(start, start + timedelta(hours=1))
    assert rows["h100-3g"]["tokens"] == 400_000
    assert rows["h100-3g"]["kwh"] == pytest.approx(6 / 7)  # the reset interval has no slice: unallocated
    cost = Decimal(str(round(6 / 7, 9))) * Decimal("0.20")
    assert rows["h100-3g"]["cost"] == cost.quantize(Decimal("0.000001"))
    assert rows["h100-3g"]["cost_per_1k_tokens"] == (cost * 1000 / 400_000).quantize(Decimal("0.00000001"))
    assert rows["h100-1g"]["tokens"] == 0 and rows["h100-1g"]["cost_per_1k_tokens"] is None


# --- charts ----------------------------------------------------------------------------------------

@pytest.fixture
def op_p(operator):
    return principal_for_user(operator)


def test_fleet_utilization_and_heatmap_numbers(h100_node, op_p):
    g0, g1 = list(Gpu.objects.order_by("index"))[:2]
    for i, (a0, a1) in enumerate(((0.2, 0.6), (0.4, 1.0))):
        for g, act in ((g0, a0), (g1, a1)):
            GpuSample.objects.create(gpu=g, resolution=R.RAW, ts=T0 + timedelta(minutes=i, seconds=g.index * 3),
                                     activity=act, memory_used_mb=1, memory_total_mb=2, power_w=1, energy_j=1,
                                     temperature_c=1, sm_clock_mhz=1)
    params = {"start": T0.isoformat(), "end": (T0 + timedelta(hours=1)).isoformat()}
    body = charts.figure_json("fleet-utilization", op_p, params)
    assert body["data"]["fleet"] == [40.0, 70.0]
    assert body["data"]["by_model"]["h100-sxm-80gb"]["avg"] == [40.0, 70.0]
    assert body["figure"]["data"][0]["y"] == [40.0, 70.0]
    heat = charts.figure_json("gpu-heatmap", op_p, params)["data"]
    assert heat["gpus"][:2] == ["node-a · GPU 0", "node-a · GPU 1"]
    assert heat["z"][0] == [20.0, 40.0] and heat["z"][1] == [60.0, 100.0] and heat["z"][2] == [None, None]


def test_mig_slot_map_shows_who_holds_which_slots(shop, op_p):
    data = charts.figure_json("mig-slots", op_p, {})["data"]
    a = shop["alpha"]["alloc"].instance
    b = shop["bravo"]["alloc"].instance
    rows = {r["gpu"]: r for r in data["gpus"]}
    row_a = rows[f"node-a · GPU {a.gpu.index}"]
    assert [row_a["slots"][s] for s in range(a.start, a.start + a.size)] == ["alpha"] * 4
    assert rows[f"node-a · GPU {b.gpu.index}"]["slots"][b.start] == "bravo"
    assert data["used"] == 5 and data["free"] == 64 - 5 and data["tenants"] == ["alpha", "bravo"]
    free = next(r for r in data["gpus"] if not any(r["slots"]))
    assert free["slots"] == [None] * 8 and free["profiles"] == [None] * 8


@pytest.mark.parametrize("name", [c.name for c in charts.CHARTS.values() if c.plain])
def test_a_plain_chart_s_numbers_are_json_as_built(shop, op_p, name):
    """A chart registered plain skips figure_json's copy: its numbers must need none (no Decimal, datetime,
    tuple or non-string key), or the API would fail to encode them or change their digits."""
    c, _fig, numbers = charts.build(name, op_p, {})
    assert numbers["gpus"] if name == "mig-slots" else numbers
    assert charts._plain(numbers) == numbers

    def json_types(v) -> bool:
        if isinstance(v, dict):
            return all(type(k) is str and json_types(x) for k, x in v.items())
        if isinstance(v, list):
            return all(json_types(x) for x in v)
        return type(v) in (str, int, float, bool, type(None))

    assert json_types(numbers)


def _priced_period(shop):
    now = timezone.now()
    start, end = _hour(now) - timedelta(hours=5), _hour(now) - timedelta(hours=3)
    Allocation.objects.filter(pk__in=[shop["alpha"]["alloc"].pk, shop["bravo"]["alloc"].pk]).update(
        activated_at=start - timedelta(hours=1))
    _usage(shop["alpha"], start, 1_000_000, 500_000, requests=100)
    _usage(shop["alpha"], start + timedelta(hours=1), 0, 0, requests=0)
    _usage(shop["bravo"], start + timedelta(hours=1), 200_000, 0, requests=50)
    _usage(shop["bravo"], end, 999, 999, requests=9)  # outside the period
    return {"start": start.isoformat(), "end": end.isoformat()}, start, end


def test_cost_per_tier_numbers(shop, op_p):
    params, _s, _e = _priced_period(shop)
    data = charts.figure_json("cost-per-tier", op_p, params)["data"]["tiers"]
    # 3g: tokens 1M in x 0.10 + 0.5M out x 0.40 = 0.30, plus 2 slice-hours x 1.00 = 2.30
    assert data["h100-3g"]["amount"] == "2.300000" and data["h100-3g"]["requests"] == 100
    assert data["h100-3g"]["cost_per_inference"] == "0.02300000"
    assert data["h100-3g"]["cost_per_1k_tokens"] == str((Decimal("2.3") * 1000 / 1_500_000).quantize(
        Decimal("0.00000001")))
    # 1g: 0.2M in x 0.10 = 0.02 + 2.00
    assert data["h100-1g"]["amount"] == "2.020000" and data["h100-1g"]["cost_per_inference"] == "0.04040000"


def test_power_cost_chart_numbers(shop, op_p):
    _gpu, start, end = _energy_data(shop)
    _usage(shop["alpha"], _hour(start), 6_000, 0)
    data = charts.figure_json("power-cost", op_p, {"start": start.isoformat(),
                                                    "end": (start + timedelta(hours=1)).isoformat()})["data"]
    assert data["total_kwh"] == pytest.approx(2.0) and data["price_per_kwh"] == "0.12"
    t = data["tiers"]["h100-3g"]
    assert t["kwh"] == pytest.approx(6 / 7) and t["tokens"] == 6000
    assert Decimal(t["cost_per_1k_tokens"]) == pytest.approx(Decimal(6 / 7) * Decimal("0.12") / 6, abs=Decimal("1e-7"))
    # per 1M tokens from the unrounded cost, to 4 significant digits (not per 1K's 8 places times 1000)
    assert Decimal(t["cost_per_1m_tokens"]) == Decimal("17.14") and data["currency"] == "USD"
    fig = charts.figure_json("power-cost", op_p, {"start": start.isoformat(),
                                                   "end": (start + timedelta(hours=1)).isoformat()})
    assert fig["data"]["tiers"]["h100-3g"]["cost_per_1m_tokens"] == "17.14"


def test_power_cost_per_1m_keeps_its_precision_where_per_1k_rounds_away():
    """A tiny power cost (0.0000123 per 1M tokens) was 1e-8 per 1K at best: bars off by up to 35 %. Significant
    digits keep it."""
    from marketplace.formatting import significant

    assert significant(Decimal("0.00001234567")) == Decimal("0.00001235")
    assert significant(Decimal("17.142857")) == Decimal("17.14")
    assert significant(Decimal("123456.7")) == Decimal("1.235E+5")
    assert significant(Decimal(0)) == 0


def test_h100_vs_h200_side_by_side(shop, op_p, catalog):
    make_node("node-h200", "hgx-h200-8")
    h200 = make_tier("h200-1g", "h200-sxm-141gb", "1g.18gb")
    tenant = shop["alpha"]["tenant"]
    a = orders.create_order(shop["alpha"]["p"], tenant=tenant, tier=h200).allocations.get()
    assert provisioning.provision(a.pk) == "activated"
    params, start, end = _priced_period(shop)
    Allocation.objects.filter(pk=a.pk).update(activated_at=start)
    dep = ModelDeployment.objects.create(allocation=a, tenant=tenant, name="big", backend="python", spec={},
                                         memory_mb=1000, state=ModelDeployment.State.READY)
    UsageHourly.objects.create(tenant=tenant, deployment=dep, hour=start, input_tokens=7_200_000,
                               output_tokens=0, requests=10)
    for g, act in ((Gpu.objects.filter(gpu_model__key="h200-sxm-141gb").first(), 0.9),
                   (Gpu.objects.filter(gpu_model__key="h100-sxm-80gb").first(), 0.3)):
        GpuSample.objects.create(gpu=g, resolution=R.RAW, ts=start + timedelta(minutes=1), activity=act,
                                 memory_used_mb=1, memory_total_mb=2, power_w=1, energy_j=1, temperature_c=1,
                                 sm_clock_mhz=1)
    data = charts.figure_json("h100-vs-h200", op_p, params)["data"]["models"]
    h1, h2 = data["h100-sxm-80gb"], data["h200-sxm-141gb"]
    assert h2["tokens_per_s_per_gpu"] == pytest.approx(7_200_000 / 7200 / 8)
    assert h1["tokens_per_s_per_gpu"] == pytest.approx(1_700_000 / 7200 / 8)
    assert h2["utilization"] == 90.0 and h1["utilization"] == 30.0
    # h200: 7.2M in x 0.10 = 0.72 + 2 slice-hours x 1.00 -> 2.72 per 7.2M tokens
    assert h2["cost_per_1k_tokens"] == str((Decimal("2.72") * 1000 / 7_200_000).quantize(Decimal("0.00000001")))
    assert h1["cost_per_1k_tokens"] == str((Decimal("4.32") * 1000 / 1_700_000).quantize(Decimal("0.00000001")))


def test_tenant_usage_is_scoped_to_the_tenant(shop, op_p):
    params, start, _e = _priced_period(shop)
    mine = charts.figure_json("tenant-usage", shop["alpha"]["p"], params)["data"]
    assert list(mine["tenants"]) == ["alpha"]
    assert mine["tenants"]["alpha"]["tokens"] == [1_500_000, 0]
    assert mine["tenants"]["alpha"]["spend"] == ["1.30", "1.00"]  # 0.30 tokens + 1 slice-hour, then 1 slice-hour
    both = charts.figure_json("tenant-usage", op_p, params)["data"]["tenants"]
    assert set(both) == {"alpha", "bravo"} and both["bravo"]["tokens"] == [0, 200_000]
    assert both["bravo"]["spend"] == ["1.00", "1.02"]
    with pytest.raises(charts.ChartNotFound):
        charts.figure_json("tenant-usage", shop["alpha"]["p"], {**params, "tenant": "bravo"})
    with pytest.raises(charts.Forbidden):
        charts.figure_json("fleet-utilization", shop["alpha"]["p"], params)


def _sample(gpu, res, ts, energy_j=0.0):
    return GpuSample(gpu=gpu, resolution=res, ts=ts, activity=0.5, memory_used_mb=1, memory_total_mb=2, power_w=500,
                     energy_j=energy_j, temperature_c=50, sm_clock_mhz=1900)


def _chosen_by_reading_every_row(start, end, coarsest):
    """choose_resolutions' rule applied to every stored row of each window (the reference the probes must match)."""
    order = energy.ORDER[:energy.ORDER.index(coarsest) + 1][::-1]
    out = {}
    for gpu in Gpu.objects.all():
        found = {}
        for r in energy.ORDER:
            lo, anchor_hi, hi = energy._window(r, start, end)
            ts = sorted(GpuSample.objects.filter(gpu=gpu, resolution=r, ts__gte=lo, ts__lte=hi)
                        .values_list("ts", flat=True))
            if ts:
                found[r] = (ts[0].timestamp() + energy.STEP[r].total_seconds(), ts[0] <= anchor_hi)
        anchored = [r for r in order if r in found and found[r][1]]
        if anchored:
            out[gpu.pk] = anchored[0]
        elif found:
            out[gpu.pk] = min(found, key=lambda r: (found[r][0], energy.ORDER.index(r)))
    return out


def test_resolutions_are_chosen_per_gpu_and_span_in_one_statement(h100_node, django_assert_num_queries):
    g = list(Gpu.objects.order_by("index"))
    rows = []
    for m in range(-180, 180):
        t = T0 + timedelta(minutes=m)
        rows += [_sample(g[0], R.RAW, t, m), _sample(g[1], R.RAW, t, m)]  # GPUs 0 and 1: raw throughout
        if m % 5 == 0:
            rows.append(_sample(g[0], R.FIVE_MIN, t, m))  # GPU 0: 5-minute rollups too
        if m % 60 == 0:
            rows.append(_sample(g[3], R.HOUR, t, m))  # GPU 3: hourly only
        if m >= 10 and m % 5 == 0:
            rows.append(_sample(g[2], R.FIVE_MIN, t, m))  # GPU 2: 5-minute rows from T0 + 10 min ...
        if m >= 20:
            rows.append(_sample(g[2], R.RAW, t, m))  # ... raw from T0 + 20 min: neither anchors at T0
        if m >= 3:
            rows.append(_sample(g[4], R.RAW, t, m))  # GPU 4: raw from T0 + 3 min, 5-minute rows from T0
        if m >= 0 and m % 5 == 0:
            rows.append(_sample(g[4], R.FIVE_MIN, t, m))
    GpuSample.objects.bulk_create(rows)
    spans = [(T0, T0 + timedelta(hours=1)), (T0 + timedelta(minutes=30), T0 + timedelta(minutes=90)),
             (T0 - timedelta(minutes=1), T0 + timedelta(minutes=4))]
    for coarsest in (R.RAW, R.FIVE_MIN, R.HOUR):
        with django_assert_num_queries(1):
            chosen, every = energy.choose_spans(spans, None, coarsest)
        assert [sorted(e) for e in every] == [sorted(x.pk for x in g)] * len(spans)
        for (start, end), got in zip(spans, chosen, strict=True):
            assert got == _chosen_by_reading_every_row(start, end, coarsest), (coarsest, start)
    at_t0 = energy.choose_resolutions(T0, T0 + timedelta(hours=1), coarsest=R.FIVE_MIN)
    assert at_t0 == {g[0].pk: R.FIVE_MIN, g[1].pk: R.RAW, g[2].pk: R.FIVE_MIN, g[3].pk: R.HOUR, g[4].pk: R.RAW}
    assert energy.choose_resolutions(T0, T0 + timedelta(hours=1), gpus=[g[0].pk, g[5].pk]) == {g[0].pk: R.RAW}
    # every span apportioned in the same two statements, each as it is alone
    with django_assert_num_queries(2):
        both = energy.apportion_spans(spans, coarsest=R.FIVE_MIN)
    for (start, end), rep in zip(spans, both, strict=True):
        alone = energy.apportion(start, end, coarsest=R.FIVE_MIN)
        assert rep.gpu_kwh == alone.gpu_kwh and rep.total_kwh > 0
    # GPU 0 at 5 minutes over T0 .. T0 + 1 h: 12 increases of 5 J; GPU 1 raw: 60 of 1 J
    assert both[0].gpu_kwh[g[0].pk] * energy.J_PER_KWH == pytest.approx(60)
    assert both[0].gpu_kwh[g[1].pk] * energy.J_PER_KWH == pytest.approx(60)
    assert both[0].gpu_kwh[g[5].pk] == 0.0


def _plotly_json(fig) -> dict:
    return json.loads(fig.to_json())


def _go_empty(fig, message: str = "no data yet"):
    """What the charts did to an empty plotly Figure (telemetry.figures.empty writes the same into the dict)."""
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 16, "color": "#666"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _go_money_axes(fig, currency: str, x_title: str) -> None:
    from marketplace.formatting import plotly_unit_price_format

    fig.update_yaxes(title_text=currency, tickformat=plotly_unit_price_format(currency), exponentformat="none")
    fig.update_xaxes(title_text=x_title)


def _old_fleet_figure(name: str, data: dict):
    """The fleet chart's figure built with plotly's graph objects from the chart's own numbers, as the charts did
    before they wrote plotly's JSON themselves (telemetry.figures)."""
    import plotly.graph_objects as go

    words = charts._step_words(data["step_s"]) if "step_s" in data else ""
    if name == "fleet-utilization":
        fig = go.Figure(layout={**charts.LAYOUT, "title": "Fleet utilization",
                                "yaxis": {"range": [0, 100], "title": "GPU activity (%)"},
                                "xaxis": {"title": f"time (UTC), {words} averages", "type": "date",
                                          "range": data["range"]}})
        fig.add_trace(go.Scatter(x=[datetime.fromisoformat(t) for t in data["ts"]], y=data["fleet"], name="fleet",
                                 mode="lines"))
        for model, v in sorted(data["by_model"].items()):
            fig.add_trace(go.Scatter(x=v["ts"], y=v["avg"], name=model, mode="lines", line={"dash": "dot"}))
        return fig if data["ts"] else _go_empty(fig)
    if name == "gpu-heatmap":
        per_node = data["per_node"]
        fig = go.Figure(go.Heatmap(x=[datetime.fromisoformat(t) for t in data["ts"]], y=data["gpus"], z=data["z"],
                                   zmin=0, zmax=100, colorscale="Viridis", colorbar={"title": "activity (%)"},
                                   hoverongaps=False),
                        layout={**charts.LAYOUT, "title": "GPU activity heatmap" + (" (per node)" if per_node else ""),
                                "xaxis": {"title": f"time (UTC), {words} averages", "type": "date",
                                          "range": data["range"]},
                                "yaxis": {"title": "node" if per_node else "GPU"},
                                "height": max(360, min(1400, 60 + 14 * len(data["gpus"])))})
        return fig if data["ts"] else _go_empty(fig)
    if name == "mig-slots":
        code = {t: i + 1 for i, t in enumerate(data["tenants"])}
        z = [[code.get(t, 0) for t in r["slots"]] for r in data["gpus"]]
        text = [[f"{t} ({p})" if t else "free" for t, p in zip(r["slots"], r["profiles"], strict=True)]
                for r in data["gpus"]]
        palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
        colors = ["#eeeeee"] + [palette[i % len(palette)] for i in range(len(data["tenants"]))]
        scale = []
        for i, c in enumerate(colors):
            scale += [[i / len(colors), c], [(i + 1) / len(colors), c]]
        return go.Figure(go.Heatmap(x=[f"slot {s}" for s in range(8)], y=[r["gpu"] for r in data["gpus"]], z=z,
                                    text=text, hoverinfo="text+y", texttemplate="%{text}", zmin=-0.5,
                                    zmax=len(data["tenants"]) + 0.5, showscale=False, colorscale=scale, xgap=2,
                                    ygap=2),
                         layout={**charts.LAYOUT, "title": "MIG slot map (who holds which memory slices)"})
    assert name == "power-cost"
    rows, cur = data["tiers"], data["currency"]
    keys = sorted(rows)
    fig = go.Figure(go.Bar(x=keys, y=[None if rows[k]["cost_per_1m_tokens"] is None
                                      else float(rows[k]["cost_per_1m_tokens"]) for k in keys],
                           text=[f"{rows[k]['kwh']:,.3f} kWh" for k in keys], textposition="none",
                           hovertemplate=f"%{{x}}<br>%{{y:,.4~r}} {cur} per 1M tokens<br>%{{text}}<extra></extra>"),
                    layout={**charts.LAYOUT, "title": f"Power cost per 1M tokens by tier (energy at "
                                                      f"{data['price_per_kwh']} {cur} per kWh)"})
    fig.update_yaxes(title_text=f"{cur} per 1M tokens", exponentformat="none", tickformat=",.3~r", rangemode="tozero")
    fig.update_xaxes(title_text="tier")
    return fig if keys else _go_empty(fig)


def _old_money_figure(name: str, data: dict, currency: str = "USD"):
    """The money chart's figure built with make_subplots and plotly's graph objects from the chart's own numbers, as
    the charts did before they wrote plotly's JSON themselves (telemetry.figures.subplots)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from marketplace.formatting import plotly_unit_price_format

    def f(x):
        return None if x is None else float(x)

    if name == "cost-per-tier":
        rows, keys = data["tiers"], sorted(data["tiers"])
        fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.15,
                            subplot_titles=("per inference", "per 1M tokens"))
        fig.add_trace(go.Bar(x=keys, y=[f(rows[k]["cost_per_inference"]) for k in keys], name="per inference"), 1, 1)
        fig.add_trace(go.Bar(x=keys, y=[f(rows[k]["cost_per_1m_tokens"]) for k in keys], name="per 1M tokens",
                             hovertemplate=f"%{{x}}<br>%{{y:,.4~r}} {currency} per 1M tokens<extra></extra>"), 1, 2)
        fig.update_layout(**charts.LAYOUT, title=f"What a customer pays, by tier ({currency})", showlegend=False)
        _go_money_axes(fig, currency, "tier")
        return fig if keys else _go_empty(fig)
    if name == "h100-vs-h200":
        numbers, models = data["models"], sorted(data["models"])
        fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.12,
                            subplot_titles=("tokens/s per GPU", "cost per 1M tokens", "utilization"))
        for col, field in enumerate(("tokens_per_s_per_gpu", "cost_per_1m_tokens", "utilization"), start=1):
            fig.add_trace(go.Bar(x=models, y=[f(numbers[m][field]) for m in models], name=field), 1, col)
        fig.update_layout(**charts.LAYOUT, title=f"H100 vs H200 (money in {currency})", showlegend=False)
        fig.update_xaxes(title_text="GPU model")
        fig.update_yaxes(title_text="tokens/s", tickformat=",.1f", exponentformat="none", row=1, col=1)
        fig.update_yaxes(title_text=currency, tickformat=plotly_unit_price_format(currency),
                         exponentformat="none", row=1, col=2)
        fig.update_yaxes(title_text="%", range=[0, 100], row=1, col=3)
        return fig
    assert name == "tenant-usage"
    tenants, bucket, currencies = data["tenants"], data["bucket"], data["currencies"]
    fig = make_subplots(rows=1 + len(currencies), cols=1, shared_xaxes=True,
                        vertical_spacing=0.08 if len(currencies) > 1 else 0.12,
                        subplot_titles=("tokens", *(f"spend ({c})" for c in currencies)))
    series = {slug: ({t: n for t, n in zip(row["ts"], row["tokens"], strict=True)},
                     {t: Decimal(x) for t, x in zip(row["ts"], row["spend"], strict=True)})
              for slug, row in tenants.items() if any(row["tokens"]) or any(Decimal(x) for x in row["spend"])}
    ranked = sorted(series, key=lambda s: (-Decimal(tenants[s]["total"]), -sum(series[s][0].values()), s))
    shown, rest = sorted(ranked[:charts.TOP_TENANTS]), ranked[charts.TOP_TENANTS:]
    drawn = [(s, tenants[s]["currency"], *series[s]) for s in shown]
    for cur in currencies:
        others = [s for s in rest if tenants[s]["currency"] == cur]
        if not others:
            continue
        other_tok, other_spend = {}, {}
        for s in others:
            for t, n in series[s][0].items():
                other_tok[t] = other_tok.get(t, 0) + n
            for t, x in series[s][1].items():
                other_spend[t] = other_spend.get(t, Decimal(0)) + x
        label = f"{len(others)} other tenants" + (f" ({cur})" if len(currencies) > 1 else "")
        drawn.append((label, cur, other_tok, other_spend))
    for i, (label, cur, tok, money) in enumerate(drawn):
        ts = sorted(set(tok) | set(money))
        x = [datetime.fromisoformat(t) for t in ts]
        colour = charts.SERIES_COLOURS[i % len(charts.SERIES_COLOURS)]
        fig.add_trace(go.Bar(x=x, y=[tok.get(t, 0) for t in ts], name=label, legendgroup=label, marker_color=colour,
                             hovertemplate=f"{label}<br>%{{x}}<br>%{{y:,d}} tokens<extra></extra>"), 1, 1)
        fig.add_trace(go.Scatter(x=x, y=[float(money.get(t, Decimal(0))) for t in ts], name=label,
                                 legendgroup=label, showlegend=False, mode="lines+markers", line_color=colour,
                                 marker_color=colour,
                                 hovertemplate=f"{label}<br>%{{x}}<br>%{{y:,.2f}} {cur}<extra></extra>"),
                      2 + currencies.index(cur), 1)
    fig.update_layout(**charts.LAYOUT, title="Usage and spend per tenant", barmode="stack")
    fig.update_yaxes(title_text="tokens", tickformat=",d", row=1, col=1)
    for i, cur in enumerate(currencies):
        fig.update_yaxes(title_text=cur, tickformat=",.2f", exponentformat="none", rangemode="tozero", row=2 + i,
                         col=1)
    fig.update_xaxes(title_text=f"time (UTC), per {bucket}", row=1 + len(currencies), col=1)
    fig.update_xaxes(range=data["range"])
    return fig if drawn else _go_empty(fig)


def many_tenants_with_usage(tier, start: datetime, hours: int, n: int) -> None:
    """`n` tenants, each holding `tier` from `start` for `hours` hours with usage in every hour: tenant i uses (i + 1)M
    input tokens an hour (whole millions at whole-cent prices: every bucket's spend is whole cents, so the chart's
    "other tenants" series is the sum of the rows it shows)."""
    for i in range(n):
        tenant = TenantFactory(slug=f"many{i:02d}", currency="USD")
        dep = DeploymentFactory(allocation__order__tenant=tenant, allocation__order__tier=tier,
                                allocation__activated_at=start,
                                allocation__released_at=start + timedelta(hours=hours))
        UsageHourly.objects.bulk_create(
            UsageHourly(tenant=tenant, deployment=dep, hour=start + timedelta(hours=h), input_tokens=(i + 1) * 10**6,
                        output_tokens=0, requests=i + 1) for h in range(hours))


@pytest.mark.parametrize("with_data", [True, False], ids=["data", "empty"])
def test_money_figures_are_the_json_plotly_builds(shop, op_p, tiers, with_data):
    """The money charts write plotly's JSON themselves, the make_subplots grid built by plotly once per distinct
    grid: what the client gets is what make_subplots and plotly's graph objects built from the same numbers."""
    import plotly.graph_objects as go

    if with_data:
        params, start, end = _priced_period(shop)
        many_tenants_with_usage(tiers["1g"], start, 2, charts.TOP_TENANTS + 2)
    else:  # before any allocation: nothing to rate
        params = {"start": "2020-01-01T00:00:00Z", "end": "2020-01-01T01:00:00Z"}
    for name in ("cost-per-tier", "h100-vs-h200", "tenant-usage"):
        for extra in ({}, {"currency": "EUR"}):
            body = charts.figure_json(name, op_p, {**params, **extra})
            sent = json.loads(json.dumps(body["figure"]))  # as the client reads it
            assert sent == _plotly_json(_old_money_figure(name, body["data"], extra.get("currency", "USD"))), name
            assert _plotly_json(go.Figure(sent)) == sent, name  # every property valid, in plotly's own form
            empty = name != "h100-vs-h200" and not (with_data and not extra)  # nobody is billed in EUR
            titles = 3 if name == "h100-vs-h200" else 2
            assert len(sent["layout"]["annotations"]) == titles + empty, (name, extra)
            if name != "tenant-usage":
                assert all(ax["exponentformat"] == "none" for k, ax in sent["layout"].items()
                           if k.startswith("yaxis") and k != "yaxis3"), name
    if with_data:
        body = charts.figure_json("tenant-usage", op_p, params)
        names = [t["name"] for t in body["figure"]["data"]]
        assert len(body["data"]["tenants"]) == charts.TOP_TENANTS + 4
        assert names[-1] == "4 other tenants" and len(names) == 2 * (charts.TOP_TENANTS + 1)


@pytest.mark.parametrize("with_data", [True, False], ids=["data", "empty"])
def test_fleet_figures_are_the_json_plotly_builds(shop, op_p, with_data):
    """The fleet charts write plotly's JSON themselves (no graph-object validation of a 1,000-row heatmap): what
    the client gets is what plotly built from the same numbers before, and plotly reads it back unchanged."""
    import plotly.graph_objects as go

    if with_data:
        _gpu, start, end = _energy_data(shop)
        _usage(shop["alpha"], _hour(start), 6_000, 0)
        params = {"start": start.isoformat(), "end": (start + timedelta(hours=1)).isoformat()}
    else:
        params = {"hours": "1"}
    for name in ("fleet-utilization", "gpu-heatmap", "mig-slots", "power-cost"):
        body = charts.figure_json(name, op_p, params)
        sent = json.loads(json.dumps(body["figure"]))  # as the client reads it
        assert sent == _plotly_json(_old_fleet_figure(name, body["data"])), name
        assert _plotly_json(go.Figure(sent)) == sent, name  # every property valid, in plotly's own form
        assert bool(with_data or name == "mig-slots") == ("annotations" not in sent["layout"]), name
    with mock.patch.object(charts, "HEATMAP_ROWS", 4):  # one row per node
        body = charts.figure_json("gpu-heatmap", op_p, params)
    assert body["data"]["per_node"]
    assert json.loads(json.dumps(body["figure"])) == _plotly_json(_old_fleet_figure("gpu-heatmap", body["data"]))


def test_chart_endpoints_access(shop, operator, api, as_user, as_key):
    r = as_user(operator).get("/api/v1/charts/")
    assert {c["name"] for c in r.json()["charts"]} == set(charts.CHARTS)
    for name in charts.CHARTS:
        r = as_user(operator).get(f"/api/v1/charts/{name}/")
        assert r.status_code == 200, (name, r.content)
        assert r.json()["figure"]["data"] is not None and "data" in r.json()
    owner = shop["alpha"]["owner"]
    for name in ("fleet-utilization", "gpu-heatmap", "mig-slots", "cost-per-tier", "power-cost", "h100-vs-h200"):
        assert as_user(owner).get(f"/api/v1/charts/{name}/").status_code == 403
    _usage(shop["alpha"], _hour(timezone.now()), 10, 20)
    _usage(shop["bravo"], _hour(timezone.now()), 30, 40)
    r = as_user(owner).get("/api/v1/charts/tenant-usage/")
    assert r.status_code == 200 and list(r.json()["data"]["tenants"]) == ["alpha"]
    assert r.json()["data"]["tenants"]["alpha"]["tokens"][-1] == 30
    assert as_user(owner).get("/api/v1/charts/tenant-usage/?tenant=bravo").status_code == 404
    assert as_user(owner).get("/api/v1/charts/nope/").status_code == 404
    _key, secret = make_key(shop["bravo"]["tenant"], ["billing:read"])
    r = as_key(secret).get("/api/v1/charts/tenant-usage/")
    assert r.status_code == 200 and list(r.json()["data"]["tenants"]) == ["bravo"]
    api.logout()
    api.credentials()
    assert api.get("/api/v1/charts/tenant-usage/").status_code in (401, 403)


def test_chart_page_uses_local_plotly_and_static_file_is_served(shop, operator, settings):
    settings.WHITENOISE_USE_FINDERS = True
    settings.WHITENOISE_AUTOREFRESH = True
    client = Client()
    r = client.get("/static/vendor/plotly/plotly.min.js")
    assert r.status_code == 200
    assert b"plotly" in b"".join(r.streaming_content)[:2000].lower()
    assert client.get("/charts/mig-slots/").status_code == 302  # login first
    client.force_login(operator)
    r = client.get("/charts/mig-slots/")
    html = r.content.decode()
    assert r.status_code == 200
    assert '<script src="/static/vendor/plotly/plotly.min.js"></script>' in html
    assert 'src="https://' not in html and "cdn" not in html.lower()
    assert 'id="figure-data"' in html and "Plotly.newPlot" in html
    client.force_login(shop["alpha"]["owner"])
    assert client.get("/charts/mig-slots/").status_code == 403
    assert client.get("/charts/tenant-usage/").status_code == 200


def test_a_refused_chart_says_why_inside_the_app(shop, operator, client):
    """A bad range, a fleet chart for a tenant, an unknown tenant or chart: the app's page (its navigation), the
    reason and a way back, with the right status; never bare text."""
    client.force_login(operator)
    for url, status, words in [("/charts/fleet-utilization/?start=yesterday", 400, "start"),
                               ("/charts/tenant-usage/?tenant=nobody", 404, "No such tenant"),
                               ("/charts/nope/", 404, "")]:
        r = client.get(url)
        html = r.content.decode()
        assert r.status_code == status and r["Content-Type"].startswith("text/html"), url
        assert 'class="topbar"' in html and 'id="error-home"' in html and words in html, url
    back = client.get("/charts/fleet-utilization/?start=yesterday").content.decode()
    assert 'href="/charts/fleet-utilization/"' in back  # back to the chart, its default range
    client.force_login(shop["alpha"]["owner"])
    r = client.get("/charts/mig-slots/")
    assert r.status_code == 403 and 'class="topbar"' in r.content.decode() and "operators" in r.content.decode()


# --- Prometheus ------------------------------------------------------------------------------------

def test_metrics_protected_and_exposes_built_values(shop, operator, settings):
    settings.TESSERA_METRICS_TOKEN = "s3cret-token"
    _usage(shop["alpha"], _hour(timezone.now()), 1234, 567, requests=8)
    _usage(shop["alpha"], _hour(timezone.now()) - timedelta(hours=1), 1000, 0, requests=2)
    collector.collect_node(shop["node"].pk)
    c = Client()
    assert c.get("/metrics").status_code == 401
    assert c.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    c.force_login(shop["alpha"]["owner"])
    assert c.get("/metrics").status_code == 403  # a tenant user is not staff
    r = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/plain; version=0.0.4")
    text = r.content.decode()
    for line in (
        'tessera_gpus{model="h100-sxm-80gb",state="ok"} 8',
        'tessera_slots{model="h100-sxm-80gb",status="used"} 5',
        'tessera_slots{model="h100-sxm-80gb",status="free"} 59',
        'tessera_allocations{state="active",tier="h100-3g"} 1',
        'tessera_allocation_transitions_total{to_state="active"} 2',
        'tessera_tenant_tokens_total{tenant="alpha",direction="input"} 2234',
        'tessera_tenant_tokens_total{tenant="alpha",direction="output"} 567',
        'tessera_tenant_requests_total{tenant="alpha"} 10',
        "# TYPE tessera_gpu_power_watts gauge",
    ):
        assert line in text, line
    gpu = shop["alpha"]["alloc"].instance.gpu
    s = GpuSample.objects.get(gpu=gpu)
    assert f'tessera_gpu_power_watts{{node="node-a",gpu="{gpu.index}",uuid="{gpu.uuid}",' \
           f'model="h100-sxm-80gb"}} {s.power_w!r}' in text
    assert "tessera_gpu_utilization_percent{" not in text  # MIG: NVML has none
    c2 = Client()
    c2.force_login(operator)
    assert c2.get("/metrics").status_code == 200
    settings.TESSERA_METRICS_TOKEN = ""
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 403
