"""The capacity planner's inputs, read from what Tessera measured, and the plan built from them.

Figures per **shape** (a MIG profile of a GPU model, or a whole GPU), over a window (default 7 days):

* **measured tokens/s**: tokens per request metered on the shape's slices (UsageHourly) times requests
  per second of model execution their Triton servers reported (TritonServedHourly requests and
  execution_ns, from Triton's batch_stats), over the (deployment, hour) pairs that have both. That is
  the rate a slice sustains while it is busy, i.e. flat out. Each ratio is taken within one source, so
  the scrape running up to a minute behind metering does not bias it. Used when at least
  MIN_MEASURED_SECONDS of execution were seen.
  Several model instances executing at once on one slice make it conservative (their times add up).
* **modelled tokens/s** (selectors.catalog.modelled_tokens_per_s) otherwise; an operator may override
  either per shape.
* **peak**: the busiest slice-hour seen (tokens in the hour / 3600): demonstrated, a floor.

Per GPU model: the owning cost per GPU-hour (TESSERA_PLANNER_GPU_HOUR_COST; the operator's figure, power
excluded) and the power curve: idle and full-load watts fitted (least squares) to the GPU samples'
power against activity in the window, when the samples spread over enough activity; else idle =
catalog idle watts and full load = TDP (modelled).

The measuring sums come from selectors.planner_measures: the hourly planner rollups that the downsampling job
keeps for the window's rolled-up hours, the usage, Triton and sample rows for the rest; the same figures as
reading the rows throughout, in a number of queries that does not grow with the fleet or the window.

Demand defaults to what the tenants' deployments asked for: each one's busiest hour in the window, in
tokens/s, with its declared model memory, so "plan for today's demand" is one click; the operator edits it.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import Count
from django.utils import timezone

from marketplace import planner
from marketplace.hardware.geometry import all_geometries
from marketplace.models import Gpu, GpuModel, MigProfile, ModelDeployment, PricePlan, Tier
from marketplace.selectors import planner_measures as measures
from marketplace.selectors.catalog import modelled_tokens_per_s
from marketplace.services import billing
from telemetry.models import Resolution
from telemetry.services.energy import price_per_kwh
from tenants.models import Tenant

MIN_MEASURED_SECONDS = 60.0  # execution seconds before a measured rate is trusted over the model
MIN_POWER_SAMPLES = 12
MIN_ACTIVITY_SPREAD = 0.05  # standard deviation of activity needed to fit a power line
DEFAULT_WINDOW_DAYS = 7
DEFAULT_TARGET_UTILIZATION = 0.7
MAX_WORKLOADS = 40
DEFAULT_GPU_HOUR_COST = {"h100-sxm-80gb": "1.89", "h200-sxm-141gb": "2.50"}


@dataclass
class ShapeFigures:
    gpu_model: GpuModel
    profile: MigProfile | None
    modelled_tps: float
    measured_tps: float | None = None
    measured_tokens: int = 0
    measured_requests: int = 0  # metered
    measured_seconds: float = 0.0
    served_requests: int = 0  # what Triton counted over measured_seconds of execution
    peak_tps: float | None = None
    override_tps: float | None = None
    tier: Tier | None = None
    plan: PricePlan | None = None

    @property
    def key(self) -> str:
        return f"{self.gpu_model.key}/{self.profile.name if self.profile else 'whole'}"

    @property
    def label(self) -> str:
        return f"{self.gpu_model.name} {self.profile.name if self.profile else 'whole GPU'}"

    @property
    def memory_gib(self) -> float:
        return (self.profile.memory_mib if self.profile else self.gpu_model.memory_mib) / 1024

    @property
    def compute_share(self) -> float:
        return self.profile.compute_slices / self.gpu_model.compute_slices if self.profile else 1.0

    @property
    def tokens_per_s(self) -> float:
        if self.override_tps is not None:
            return self.override_tps
        return self.measured_tps if self.measured_tps is not None else self.modelled_tps

    @property
    def source(self) -> str:
        if self.override_tps is not None:
            return "given"
        return "measured" if self.measured_tps is not None else "modelled"

    def shape(self) -> planner.Shape:
        return planner.Shape(self.gpu_model.key, self.profile.name if self.profile else None, self.memory_gib,
                             self.compute_share, self.tokens_per_s, self.source)


@dataclass
class PowerFigures:
    gpu_model: GpuModel
    idle_w: float
    max_w: float
    source: str
    samples: int = 0


def window(days: float | None = None, until: datetime | None = None) -> tuple[datetime, datetime]:
    until = until or timezone.now()
    return until - timedelta(days=days or DEFAULT_WINDOW_DAYS), until


def shape_figures(since: datetime, until: datetime, currency: str = "USD", *,
                  measure: bool = True, sums: dict | None = None) -> list[ShapeFigures]:
    """Every MIG profile (``+me`` left out) and the whole GPU of every GPU model, with its figures
    (``measure=False``: the catalog and the modelled figure only, no reads of usage or Triton rows).
    `sums`: planner_measures.shapes over the window, when the caller has read them already."""
    models = list(GpuModel.objects.prefetch_related("profiles").order_by("memory_gb", "key"))
    out: dict[tuple[int, int | None], ShapeFigures] = {}
    for m in models:
        for profile in sorted(m.profiles.all(), key=lambda pr: (pr.memory_slices, pr.compute_slices, pr.name)):
            if not profile.media_extensions:
                out[(m.pk, profile.pk)] = ShapeFigures(m, profile, modelled_tokens_per_s(m, profile))
        out[(m.pk, None)] = ShapeFigures(m, None, modelled_tokens_per_s(m, None))
    if not measure:
        return list(out.values())

    # rolled-up hours from the planner rollup, the rest from the usage and Triton rows (planner_measures)
    sums = measures.shapes(since, until) if sums is None else sums
    for key, row in sums.items():
        f = out.get(key)
        if f is None:
            continue
        f.measured_tokens, f.measured_requests = row["tokens"], row["requests"]
        f.measured_seconds, f.served_requests = row["execution_ns"] / 1e9, row["served_requests"]
        if row["peak_tokens"]:  # the busiest slice-hour
            f.peak_tps = row["peak_tokens"] / 3600
    for f in out.values():
        # tokens per request (metering) x requests per second of execution (Triton): each ratio comes
        # from one source, so the scrape's lag behind metering (up to a scrape interval) cancels out.
        if (f.measured_seconds >= MIN_MEASURED_SECONDS and f.measured_tokens > 0 and f.measured_requests > 0
                and f.served_requests > 0):
            f.measured_tps = f.measured_tokens / f.measured_requests * f.served_requests / f.measured_seconds

    now = timezone.now()
    book = billing.PlanBook(currency)  # the rating's own plan lookup: the plan in force now
    for tier in Tier.objects.filter(active=True).order_by("dedicated", "key"):
        shape = out.get((tier.gpu_model_id, tier.profile_id))
        plan = book.at(tier.pk, PricePlan.Kind.ON_DEMAND, now)
        if shape is not None and shape.tier is None and plan is not None:
            shape.tier, shape.plan = tier, plan
    return list(out.values())


def power_figures(since: datetime, until: datetime, where: measures.Split | None = None) -> dict[str, PowerFigures]:
    """Per GPU model: watts at idle and at full activity, fitted to the samples or from the catalog."""
    out = {}
    key_of = {}
    for m in GpuModel.objects.order_by("memory_gb", "key"):
        geo = all_geometries().get(m.key)
        idle = geo.sim.idle_watts if geo else 0.1 * m.tdp_watts
        out[m.key] = PowerFigures(m, float(idle), float(m.tdp_watts), "modelled")
        key_of[m.pk] = m.key
    where = where or measures.split(since, until)
    for res in (Resolution.FIVE_MIN, Resolution.RAW, Resolution.HOUR):
        if all(f.source == "measured" for f in out.values()):
            break  # a finer resolution fitted every model: the coarser ones (millions of rows) are not read
        for (_res, model_id), r in sorted(measures.power((res,), since, until, where).items(),
                                          key=lambda kv: kv[0][1]):
            key = key_of.get(model_id)
            if key is None or out[key].source == "measured" or r["n"] < MIN_POWER_SAMPLES:
                continue
            n, sx, sy, sxx, sxy = r["n"], r["sx"] or 0.0, r["sy"] or 0.0, r["sxx"] or 0.0, r["sxy"] or 0.0
            var = sxx / n - (sx / n) ** 2
            if var < MIN_ACTIVITY_SPREAD ** 2:
                continue
            slope = (sxy / n - (sx / n) * (sy / n)) / var
            intercept = sy / n - slope * sx / n
            if slope < 0 or intercept < 0:
                continue
            f = out[key]
            f.idle_w, f.max_w, f.source, f.samples = intercept, intercept + slope, "measured", int(n)
    return out


def measured_demand(since: datetime, until: datetime, limit: int = 12) -> list[dict]:
    """One workload per tenant and model name (all its deployments together): the busiest hour in the
    window in tokens/s and the largest declared model memory, busiest first."""
    by_id = measures.demand(since, until)
    slugs = dict(Tenant.objects.filter(pk__in={k[0] for k in by_id}).values_list("pk", "slug"))
    peak = {(slugs[t], name): v for (t, name), v in by_id.items() if t in slugs}
    top = sorted((k for k in peak if peak[k] > 0), key=lambda k: (-peak[k], k))[:limit]
    memory: dict[tuple[str, str], int] = defaultdict(int)
    tiers: dict[tuple[str, str], set[str]] = defaultdict(set)
    for slug, name, mb, tier in (ModelDeployment.objects.filter(tenant__slug__in={k[0] for k in top},
                                                                name__in={k[1] for k in top})
                                 .values_list("tenant__slug", "name", "memory_mb", "allocation__tier__key")):
        memory[(slug, name)] = max(memory[(slug, name)], mb or 0)
        tiers[(slug, name)].add(tier)
    return [{"name": f"{slug}/{name}", "tokens_per_s": round(peak[(slug, name)] / 3600, 3),
             "min_memory_gib": math.ceil(max(memory[(slug, name)], 1) / 1024 * 1000) / 1000,  # never below
             "gpu_models": [],
             "now_on": sorted(tiers[(slug, name)])} for slug, name in top]


def token_mix(since: datetime, until: datetime, sums: dict | None = None) -> float:
    """Share of input tokens among all tokens metered in the window (3/4 when nothing was metered).
    `sums`: planner_measures.shapes over the window, when the caller has read them already."""
    sums = measures.shapes(since, until) if sums is None else sums
    i = float(sum(r["input_tokens"] for r in sums.values()))
    o = float(sum(r["output_tokens"] for r in sums.values()))
    return i / (i + o) if i + o > 0 else 0.75


def default_gpu_hour_cost(model_key: str) -> Decimal:
    table = {**DEFAULT_GPU_HOUR_COST, **getattr(settings, "TESSERA_PLANNER_GPU_HOUR_COST", {})}
    return Decimal(str(table.get(model_key, "2.00")))


def fleet_gpus() -> dict[str, int]:
    return {r["gpu_model__key"]: r["n"] for r in Gpu.objects.values("gpu_model__key").annotate(n=Count("id"))
            .order_by()}


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass
class PlanRequest:
    workloads: list[planner.Workload]
    target_utilization: float = DEFAULT_TARGET_UTILIZATION
    gpu_hour_cost: dict[str, float] = field(default_factory=dict)  # GPU model key -> cost (default: setting)
    price_per_kwh: float | None = None  # default: TESSERA_ENERGY_PRICE_PER_KWH
    window_days: float = DEFAULT_WINDOW_DAYS
    gpu_models: tuple[str, ...] | None = None  # allowed GPU models (None: every model in the catalog)
    throughput: dict[str, float] = field(default_factory=dict)  # shape key -> tokens/s override
    currency: str = "USD"
    growth: float = 1.0  # multiplies every workload's tokens/s
    until: datetime | None = None


@dataclass
class ScenarioReport:
    key: str
    label: str
    result: planner.PlanResult
    revenue_per_hour: float | None = None
    unpriced: list[str] = field(default_factory=list)  # shapes used that no tier on sale prices

    @property
    def price_per_1k_tokens(self) -> float | None:
        """What the tenants pay per 1K tokens at the on-demand list prices (slice-hours + tokens)."""
        r = self.result
        if self.revenue_per_hour is None or not r.feasible or r.tokens_per_s <= 0:
            return None
        return self.revenue_per_hour / (r.tokens_per_s * 3.6)

    @property
    def price_per_1m_tokens(self) -> float | None:
        per_1k = self.price_per_1k_tokens
        return None if per_1k is None else per_1k * 1000

    @property
    def margin_per_hour(self) -> float | None:
        if self.revenue_per_hour is None or not self.result.feasible:
            return None
        return self.revenue_per_hour - self.result.cost_per_hour


@dataclass
class PlanReport:
    request: PlanRequest
    since: datetime
    until: datetime
    shapes: list[ShapeFigures]
    power: dict[str, PowerFigures]
    input_share: float
    scenarios: list[ScenarioReport]
    fleet: dict[str, int]
    solved_at: datetime | None = None
    solve_seconds: float | None = None  # the solver's time for this answer; None: it came from the cache
    cached: bool = False

    @property
    def best(self) -> ScenarioReport:
        return self.scenarios[0]


def _validate(req: PlanRequest, shapes: dict[str, ShapeFigures], models: dict[str, GpuModel]) -> None:
    if len(req.workloads) > MAX_WORKLOADS:
        raise planner.PlanError(f"at most {MAX_WORKLOADS} workloads per plan", field="workloads")
    if not (req.growth > 0 and math.isfinite(req.growth)):
        raise planner.PlanError("growth must be above 0", field="growth")
    if not (0 < req.window_days <= 366):
        raise planner.PlanError("the measurement window is 1 hour to 366 days", field="window_days")
    for key, v in req.throughput.items():
        if key not in shapes:
            raise planner.PlanError(f"unknown shape {key!r}; shapes look like 'h100-sxm-80gb/3g.40gb' or "
                                    f"'h200-sxm-141gb/whole'", field="throughput")
        if not (v > 0 and math.isfinite(v)):
            raise planner.PlanError(f"{key}: tokens/s must be above 0", field="throughput")
    for key, v in req.gpu_hour_cost.items():
        if key not in models:
            raise planner.PlanError(f"unknown GPU model {key!r}", field="gpu_hour_cost")
        if not (v >= 0 and math.isfinite(v)):
            raise planner.PlanError(f"{key}: the GPU-hour cost cannot be negative", field="gpu_hour_cost")
    for key in req.gpu_models or ():
        if key not in models:
            raise planner.PlanError(f"unknown GPU model {key!r}", field="gpu_models")


def build_plan(req: PlanRequest) -> PlanReport:
    """Measure, solve the optimum and the comparison scenarios, and price them at list prices."""
    since, until = window(req.window_days, req.until)
    where = measures.split(since, until)  # which hours the planner rollup holds
    sums = measures.shapes(since, until, where)
    figures = shape_figures(since, until, req.currency, sums=sums)
    by_key = {f.key: f for f in figures}
    models = {f.gpu_model.key: f.gpu_model for f in figures}
    _validate(req, by_key, models)
    for key, v in req.throughput.items():
        by_key[key].override_tps = float(v)
    power = power_figures(since, until, where)
    kwh = float(price_per_kwh()) if req.price_per_kwh is None else float(req.price_per_kwh)
    gpus = tuple(planner.GpuCost(k, m.name, float(req.gpu_hour_cost.get(k, default_gpu_hour_cost(k))),
                                 power[k].idle_w, power[k].max_w, power[k].source) for k, m in models.items())
    workloads = tuple(planner.Workload(w.name, w.tokens_per_s * req.growth, w.min_memory_gib, w.gpu_models)
                      for w in req.workloads)
    # the shapes a tier sells (on demand, with a price in force): the planner lays out nothing else
    inp = planner.PlanInput(workloads=workloads, shapes=tuple(f.shape() for f in figures if f.plan is not None),
                            gpus=gpus, price_per_kwh=kwh, target_utilization=req.target_utilization,
                            gpu_models=tuple(req.gpu_models) if req.gpu_models else None)
    share = token_mix(since, until, sums)
    solved, solved_at, took = solved_scenarios(inp)
    scenarios = [_priced(s, by_key, share) for s in solved]
    return PlanReport(req, since, until, figures, power, share, scenarios, fleet_gpus(), solved_at=solved_at,
                      solve_seconds=took, cached=took is None)


#: how long a solved plan is kept for the same inputs (the page measures over whole hours: they change hourly)
PLAN_CACHE_SECONDS = 3600


def solved_scenarios(inp: planner.PlanInput) -> tuple[list[planner.Scenario], datetime, float | None]:
    """The planner's scenarios for these exact inputs (workloads, shapes with their measured figures, costs): solved
    once and kept in the cache for PLAN_CACHE_SECONDS, so a page view with unchanged inputs does not run the
    solver again. Returns (scenarios, when solved, seconds it took now; None: from the cache)."""
    import hashlib

    from django.core.cache import cache

    key = "planner:" + hashlib.sha256(repr(inp).encode()).hexdigest()
    hit = cache.get(key)
    if hit is not None:
        scenarios, at = hit
        return scenarios, at, None
    t0 = time.perf_counter()
    scenarios = planner.scenarios(inp)
    took, at = time.perf_counter() - t0, timezone.now()
    cache.set(key, (scenarios, at), PLAN_CACHE_SECONDS)
    return scenarios, at, took


def _priced(s: planner.Scenario, shapes: dict[str, ShapeFigures], input_share: float) -> ScenarioReport:
    """Revenue per hour at the on-demand list prices: the slices' slice-hours plus the tokens they serve."""
    out = ScenarioReport(s.key, s.label, s.result)
    if not s.result.feasible:
        return out
    total = 0.0
    for a in s.result.assignments:
        f = shapes[a.shape]
        if f.plan is None:
            out.unpriced.append(f.key)
            continue
        total += billing.list_price_per_hour(f.plan, a.slices, a.tokens_per_s * 3600, input_share)
    out.revenue_per_hour = total  # partial where shapes are unpriced (listed)
    return out


# --------------------------------------------------------------------------------------------------
# Plain output (API, page)
# --------------------------------------------------------------------------------------------------


def shape_dict(f: ShapeFigures) -> dict:
    return {
        "shape": f.key, "gpu_model": f.gpu_model.key, "profile": f.profile.name if f.profile else None,
        "label": f.label, "memory_gib": round(f.memory_gib, 3), "compute_share": round(f.compute_share, 6),
        "tokens_per_s": round(f.tokens_per_s, 3), "source": f.source,
        "modelled_tokens_per_s": round(f.modelled_tps, 3),
        "measured_tokens_per_s": None if f.measured_tps is None else round(f.measured_tps, 3),
        "measured_tokens": f.measured_tokens, "measured_execution_s": round(f.measured_seconds, 3),
        "peak_slice_hour_tokens_per_s": None if f.peak_tps is None else round(f.peak_tps, 3),
        "tier": f.tier.key if f.tier else None,
        "price_per_slice_hour": None if f.plan is None else str(f.plan.price_per_slice_hour),
    }


def _round(x: float | None, places: int) -> float | None:
    return None if x is None else round(x, places)


def power_dict(p: PowerFigures) -> dict:
    return {"idle_w": round(p.idle_w, 3), "max_w": round(p.max_w, 3), "source": p.source, "samples": p.samples}


def report_dict(report: PlanReport) -> dict:
    req = report.request
    return {
        "window": {"since": report.since.isoformat(), "until": report.until.isoformat()},
        "currency": req.currency, "target_utilization": req.target_utilization, "growth": req.growth,
        "input_token_share": round(report.input_share, 6),
        "workloads": [{"name": w.name, "tokens_per_s": w.tokens_per_s * req.growth, "min_memory_gib": w.min_memory_gib,
                       "gpu_models": list(w.gpu_models)} for w in req.workloads],
        "shapes": [shape_dict(f) for f in report.shapes],
        "power": {k: power_dict(p) for k, p in report.power.items()},
        "fleet_gpus": report.fleet,
        "solved_at": report.solved_at.isoformat() if report.solved_at else None,
        "solve_seconds": _round(report.solve_seconds, 3), "from_cache": report.cached,
        "scenarios": [{"key": s.key, "label": s.label, **s.result.as_dict(),
                       "revenue_per_hour": _round(s.revenue_per_hour, 6),
                       "margin_per_hour": _round(s.margin_per_hour, 6),
                       "price_per_1k_tokens": _round(s.price_per_1k_tokens, 8),
                       "price_per_1m_tokens": _round(s.price_per_1m_tokens, 6),
                       "unpriced_shapes": sorted(set(s.unpriced))} for s in report.scenarios],
    }
