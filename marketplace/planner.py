"""Capacity and cost-per-token planner: how many H100 and H200 GPUs, in which MIG layouts, serve a
demand mix at the lowest cost per 1K tokens. Pure Python over the catalog geometry plus scipy's MILP
solver (HiGHS); no Django. marketplace.selectors.capacity_planning feeds it the measured figures.

The model, per hour:

* A **shape** is a MIG profile of a GPU model (``1g.18gb`` on an H200 ...) or a whole GPU with MIG
  off. Each has a usable memory (the profile's MiB) and a throughput: tokens/s that one slice serves
  flat out (measured, modelled or given; see the selector).
* A **layout** is a maximal multiset of MIG profiles that fits one GPU (NVIDIA's placement rules:
  legal starts, no overlapping memory slices, per-profile instance limits), enumerated here from the
  catalog; ``1g.*+me`` variants are left out (same compute and memory as 1g, at most one per GPU).
  Adding "whole GPU, MIG off" gives every way a GPU can be set up. Only maximal layouts are needed:
  a GPU costs the same whatever it holds, and unused slices are allowed.
* A **workload** needs ``tokens_per_s`` served by slices of at least ``min_memory_gib`` each (one
  replica of the model per slice), optionally on named GPU models only.

Each workload runs on ONE shape (identical replicas, as a model's replicas are deployed in practice):
on shape s it needs ``k[w,s] = ceil(demand_w / (target_utilization * capacity_s))`` slices. Integer
program: ``x[g,L]`` GPUs of model g set up in layout L, binary ``b[w,s]`` = workload w runs on shape s,
with ``sum_s b[w,s] = 1`` and, per shape, ``sum_w k[w,s] * b[w,s] <= sum_L count(L, s) * x[g,L]``.
Cost per hour to minimise: ``sum_g,L x[g,L] * (gpu_hour_cost_g + idle_kW_g * price_kWh)`` plus the
dynamic power ``sum_w,s b[w,s] * (max_kW_g - idle_kW_g) * price_kWh * compute_share_s * demand_w /
capacity_s`` (a GPU's power is linear in its activity; a slice's activity is its load over its
capacity, weighted by its compute share, as in the collector). HiGHS stops within MIP_GAP of the
proven lower bound. Cost per 1K tokens = cost per hour / (tokens per hour / 1000).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from marketplace.hardware.geometry import GpuGeometry, all_geometries

WHOLE = None  # profile name of a whole GPU (MIG off)
HOURS_PER_MONTH = 730
ALTERNATIVE_TIME_LIMIT_S = 3.0
MIP_GAP = 1e-3  # relative gap at which HiGHS stops: within 0.1% of the proven lower bound
SLICE_EPSILON = 1e-6  # $ per slice-hour: among equal-cost plans, prefer fewer slices (no gratuitous ones)


class PlanError(ValueError):
    """Input the planner cannot work with; ``field`` names it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    gpu_model: str
    counts: tuple[tuple[str | None, int], ...]  # (profile name or WHOLE, count), largest profile first

    @property
    def label(self) -> str:
        if self.counts == ((WHOLE, 1),):
            return "whole GPU (MIG off)"
        return " + ".join(f"{n}× {p}" for p, n in self.counts)

    @property
    def is_whole(self) -> bool:
        return self.counts == ((WHOLE, 1),)

    def count(self, profile: str | None) -> int:
        return dict(self.counts).get(profile, 0)


@cache
def mig_layouts(gpu_model: str, allowed: frozenset[str] | None = None) -> tuple[Layout, ...]:
    """Every maximal multiset of MIG profiles (``+me`` left out; only ``allowed`` profiles when given: the ones
    tiers sell) that can be placed on one GPU."""
    geo: GpuGeometry = all_geometries()[gpu_model]
    profiles = [p for p in geo.profiles if not p.media_extensions and (allowed is None or p.name in allowed)]
    options = [(p.name, p.memory_slices, start) for p in profiles for start in p.starts]
    limit = {p.name: p.max_count for p in profiles}
    found: set[tuple[tuple[str, int], ...]] = set()

    def walk(i: int, used: int, counts: dict[str, int]) -> None:
        found.add(tuple(sorted(counts.items())))
        for j in range(i, len(options)):
            name, size, start = options[j]
            mask = ((1 << size) - 1) << start
            if used & mask or counts.get(name, 0) >= limit[name]:
                continue
            counts[name] = counts.get(name, 0) + 1
            walk(j + 1, used | mask, counts)
            counts[name] -= 1
            if not counts[name]:
                del counts[name]

    walk(0, 0, {})
    found.discard(())

    def contains(big: dict[str, int], small: dict[str, int]) -> bool:
        return all(big.get(k, 0) >= v for k, v in small.items())

    sets = [dict(s) for s in found]
    maximal = [s for s in sets if not any(o != s and contains(o, s) for o in sets)]
    order: dict[str | None, tuple[int, int, str]] = {
        p.name: (-p.memory_slices, -p.compute_slices, p.name) for p in profiles
    }
    out = [Layout(gpu_model, tuple(sorted(s.items(), key=lambda kv: order[kv[0]]))) for s in maximal]
    return tuple(sorted(out, key=lambda lay: [(order[p], -n) for p, n in lay.counts]))


def layouts(gpu_model: str, *, mig: bool = True, whole: bool = True,
            allowed: frozenset[str] | None = None) -> list[Layout]:
    out = list(mig_layouts(gpu_model, allowed)) if mig else []
    if whole:
        out.append(Layout(gpu_model, ((WHOLE, 1),)))
    return out


# --------------------------------------------------------------------------------------------------
# Inputs and results
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    gpu_model: str
    profile: str | None  # MIG profile name, or WHOLE
    memory_gib: float
    compute_share: float  # of the GPU's compute (1g on a 7-slice GPU: 1/7; whole GPU: 1)
    tokens_per_s: float  # one slice flat out
    source: str = "modelled"

    @property
    def key(self) -> str:
        return f"{self.gpu_model}/{self.profile or 'whole'}"

    @property
    def label(self) -> str:
        return self.profile or "whole GPU"


@dataclass(frozen=True)
class GpuCost:
    gpu_model: str
    name: str
    hour_cost: float  # owning cost per GPU-hour (amortised hardware + hosting), power excluded
    idle_w: float
    max_w: float  # power at activity 1.0
    power_source: str = "modelled"


@dataclass(frozen=True)
class Workload:
    name: str
    tokens_per_s: float
    min_memory_gib: float
    gpu_models: tuple[str, ...] = ()  # empty: any


@dataclass(frozen=True)
class PlanInput:
    workloads: tuple[Workload, ...]
    shapes: tuple[Shape, ...]
    gpus: tuple[GpuCost, ...]
    price_per_kwh: float
    target_utilization: float = 0.7
    gpu_models: tuple[str, ...] | None = None  # restrict the fleet to these models (None: all of `gpus`)
    mig: bool = True
    whole: bool = True
    time_limit_s: float = 10.0


@dataclass
class Assignment:
    workload: str
    shape: str  # Shape.key
    gpu_model: str
    profile: str | None
    slices: int
    tokens_per_s: float
    utilization: float  # of the slices' capacity


@dataclass
class LayoutUse:
    gpu_model: str
    layout: str
    counts: dict[str, int]
    gpus: int


@dataclass
class PlanResult:
    feasible: bool
    status: str
    message: str = ""
    gpus: dict[str, int] = field(default_factory=dict)
    layouts: list[LayoutUse] = field(default_factory=list)
    assignments: list[Assignment] = field(default_factory=list)
    spare_slices: dict[str, int] = field(default_factory=dict)  # shape key -> slices set up but not needed
    gpu_cost_per_hour: float = 0.0
    power_cost_per_hour: float = 0.0
    power_kw: float = 0.0
    tokens_per_s: float = 0.0
    solve_seconds: float = 0.0
    mip_gap: float | None = None
    optimal: bool = False

    @property
    def cost_per_hour(self) -> float:
        return self.gpu_cost_per_hour + self.power_cost_per_hour

    @property
    def cost_per_month(self) -> float:
        return self.cost_per_hour * HOURS_PER_MONTH

    @property
    def cost_per_1k_tokens(self) -> float | None:
        if not self.feasible or self.tokens_per_s <= 0:
            return None
        return self.cost_per_hour / (self.tokens_per_s * 3600 / 1000)

    @property
    def cost_per_1m_tokens(self) -> float | None:
        """What the charts show: per 1M tokens."""
        per_1k = self.cost_per_1k_tokens
        return None if per_1k is None else per_1k * 1000

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus.values())

    def as_dict(self) -> dict[str, object]:
        return {
            "feasible": self.feasible, "status": self.status, "message": self.message, "optimal": self.optimal,
            "gpus": dict(self.gpus), "total_gpus": self.total_gpus,
            "layouts": [vars(u) for u in self.layouts],
            "assignments": [vars(a) for a in self.assignments],
            "spare_slices": dict(self.spare_slices),
            "gpu_cost_per_hour": _r(self.gpu_cost_per_hour), "power_cost_per_hour": _r(self.power_cost_per_hour),
            "cost_per_hour": _r(self.cost_per_hour), "cost_per_month": _r(self.cost_per_month, 2),
            "power_kw": _r(self.power_kw, 3), "tokens_per_s": _r(self.tokens_per_s, 3),
            "cost_per_1k_tokens": None if self.cost_per_1k_tokens is None else _r(self.cost_per_1k_tokens, 8),
            "cost_per_1m_tokens": None if self.cost_per_1m_tokens is None else _r(self.cost_per_1m_tokens, 6),
            "solve_seconds": _r(self.solve_seconds, 4), "mip_gap": self.mip_gap,
        }


def _r(x: float, places: int = 6) -> float:
    return round(float(x), places)


# --------------------------------------------------------------------------------------------------
# Solving
# --------------------------------------------------------------------------------------------------


def validate(inp: PlanInput) -> None:
    if not inp.workloads:
        raise PlanError("give at least one workload (name, tokens/s, memory)", field="workloads")
    if not 0 < inp.target_utilization <= 1:
        raise PlanError("target utilization must be above 0 and at most 100%", field="target_utilization")
    if inp.price_per_kwh < 0 or not math.isfinite(inp.price_per_kwh):
        raise PlanError("the price per kWh cannot be negative", field="price_per_kwh")
    names = [w.name for w in inp.workloads]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PlanError(f"workload names must be unique: {', '.join(dup)}", field="workloads")
    known = {g.gpu_model for g in inp.gpus}
    for w in inp.workloads:
        if not (w.tokens_per_s > 0 and math.isfinite(w.tokens_per_s)):
            raise PlanError(f"{w.name}: tokens/s must be above 0", field="workloads")
        if not (w.min_memory_gib >= 0 and math.isfinite(w.min_memory_gib)):
            raise PlanError(f"{w.name}: memory cannot be negative", field="workloads")
        unknown = set(w.gpu_models) - known
        if unknown:
            raise PlanError(f"{w.name}: unknown GPU model {', '.join(sorted(unknown))}", field="workloads")
    for g in inp.gpus:
        if g.hour_cost < 0 or g.idle_w < 0 or g.max_w < g.idle_w:
            raise PlanError(f"{g.name}: costs and power cannot be negative, and full power is at least idle power",
                            field="gpus")


def _fleet_models(inp: PlanInput) -> list[GpuCost]:
    return [g for g in inp.gpus if inp.gpu_models is None or g.gpu_model in inp.gpu_models]


def _eligible(w: Workload, s: Shape, models: set[str]) -> bool:
    return (s.gpu_model in models and (not w.gpu_models or s.gpu_model in w.gpu_models)
            and s.memory_gib >= w.min_memory_gib and s.tokens_per_s > 0)


def _infeasible_reason(inp: PlanInput, shapes: list[Shape], models: set[str]) -> str | None:
    for w in inp.workloads:
        if not any(_eligible(w, s, models) for s in shapes):
            fits = [s for s in shapes if s.gpu_model in models and (not w.gpu_models or s.gpu_model in w.gpu_models)]
            largest = max((s.memory_gib for s in fits), default=0)
            if fits:
                return (f"{w.name} needs {w.min_memory_gib:g} GiB per replica; the largest slice available here "
                        f"has {largest:.1f} GiB")
            if not any(s.gpu_model in models for s in inp.shapes):
                return (f"{w.name}: nothing is on sale on the GPU models allowed (the planner lays out only the "
                        "slices and whole GPUs that tiers sell, with an on-demand price in force)")
            return f"{w.name}: no GPU model it may run on is in this fleet"
    return None


def _prune(lays: list[Layout], shape_of: dict[tuple[str, str | None], Shape]) -> list[Layout]:
    """Drop a one-instance MIG layout (7g) where the whole GPU does at least as much (memory and tokens/s):
    equal-cost twins only slow the solver down and make the answer arbitrary."""
    out = []
    for lay in lays:
        if len(lay.counts) == 1 and lay.counts[0][1] == 1 and lay.counts[0][0] is not WHOLE:
            whole = shape_of.get((lay.gpu_model, WHOLE))
            mine = shape_of.get((lay.gpu_model, lay.counts[0][0]))
            if (whole is not None and mine is not None and whole.memory_gib >= mine.memory_gib
                    and whole.tokens_per_s >= mine.tokens_per_s
                    and any(o.gpu_model == lay.gpu_model and o.is_whole for o in lays)):
                continue
        out.append(lay)
    return out


def slices_needed(w: Workload, s: Shape, target: float) -> int:
    """Replicas of the workload on slices of this shape so that none runs above the target load."""
    return max(1, math.ceil(w.tokens_per_s / (target * s.tokens_per_s) - 1e-9))


def solve(inp: PlanInput) -> PlanResult:
    """The lowest-cost fleet for the demand (see the module docstring)."""
    validate(inp)
    fleet = _fleet_models(inp)
    models = {g.gpu_model for g in fleet}
    cost_of = {g.gpu_model: g for g in fleet}
    # only layouts made of the shapes given (the ones tiers sell): no GPU is split into slices nobody can buy
    given = {(s.gpu_model, s.profile) for s in inp.shapes}
    lays = [lay for g in fleet for lay in layouts(
        g.gpu_model, mig=inp.mig, whole=inp.whole and (g.gpu_model, WHOLE) in given,
        allowed=frozenset(p for m, p in given if m == g.gpu_model and p is not WHOLE))]
    lays = _prune(lays, {(s.gpu_model, s.profile): s for s in inp.shapes})
    offered = {(lay.gpu_model, p) for lay in lays for p, _n in lay.counts}
    shapes = [s for s in inp.shapes if (s.gpu_model, s.profile) in offered]
    why = _infeasible_reason(inp, shapes, models) if fleet else "no GPU model is allowed in this fleet"
    if why:
        return PlanResult(False, "infeasible", why)

    price = inp.price_per_kwh
    # One choice per (workload, shape): that many identical replicas, each at most at the target load.
    choices: list[tuple[int, int, int, float]] = []
    for wi, w in enumerate(inp.workloads):
        for si, s in enumerate(shapes):
            if _eligible(w, s, models):
                k = slices_needed(w, s, inp.target_utilization)
                g = cost_of[s.gpu_model]
                dyn = (g.max_w - g.idle_w) / 1000 * price * s.compute_share * w.tokens_per_s / s.tokens_per_s
                choices.append((wi, si, k, dyn))
    nx, nb = len(lays), len(choices)
    n = nx + nb  # x[layout] (GPUs in that layout), b[choice] (0/1)
    c = np.zeros(n)
    for i, lay in enumerate(lays):
        g = cost_of[lay.gpu_model]
        c[i] = g.hour_cost + g.idle_w / 1000 * price
    for j, (_wi, _si, k, dyn) in enumerate(choices):
        c[nx + j] = dyn + SLICE_EPSILON * k

    rows, lo, hi = [], [], []
    for wi in range(len(inp.workloads)):  # every workload on exactly one shape
        row = np.zeros(n)
        for j, ch in enumerate(choices):
            if ch[0] == wi:
                row[nx + j] = 1.0
        rows.append(row)
        lo.append(1.0)
        hi.append(1.0)
    for si, s in enumerate(shapes):  # slices used <= slices the layouts set up
        row = np.zeros(n)
        for j, (_wi, cs, k, _d) in enumerate(choices):
            if cs == si:
                row[nx + j] = k
        if not row.any():
            continue
        for i, lay in enumerate(lays):
            if lay.gpu_model == s.gpu_model:
                row[i] = -lay.count(s.profile)
        rows.append(row)
        lo.append(-np.inf)
        hi.append(0.0)

    upper = np.concatenate([np.full(nx, np.inf), np.ones(nb)])
    t0 = time.perf_counter()
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=np.ones(n),
               bounds=Bounds(np.zeros(n), upper),
               options={"time_limit": inp.time_limit_s, "disp": False, "mip_rel_gap": MIP_GAP})
    elapsed = time.perf_counter() - t0
    if res.x is None:
        status = "time limit reached before a plan was found" if res.status == 1 else res.message
        return PlanResult(False, "no-solution", f"the solver found no plan: {status}", solve_seconds=elapsed)
    return _result(inp, res, lays, shapes, choices, cost_of, elapsed)


def _result(
    inp: PlanInput,
    res: Any,
    lays: list[Layout],
    shapes: list[Shape],
    choices: list[tuple[int, int, int, float]],
    cost_of: dict[str, GpuCost],
    elapsed: float,
) -> PlanResult:
    nx = len(lays)
    x = [int(round(v)) for v in res.x[:nx]]
    b = [round(v) == 1 for v in res.x[nx:]]
    gap = res.get("mip_gap")
    out = PlanResult(True, "optimal" if res.status == 0 else "feasible", optimal=res.status == 0,
                     solve_seconds=elapsed, mip_gap=None if gap is None else float(gap))
    if not out.optimal:
        out.message = "time limit reached: the best plan found so far (not proven optimal)"
    watts = 0.0
    for i, lay in enumerate(lays):
        if x[i]:
            g = cost_of[lay.gpu_model]
            out.layouts.append(LayoutUse(lay.gpu_model, lay.label, {p or "whole": k for p, k in lay.counts}, x[i]))
            out.gpus[lay.gpu_model] = out.gpus.get(lay.gpu_model, 0) + x[i]
            out.gpu_cost_per_hour += x[i] * g.hour_cost
            watts += x[i] * g.idle_w
    used: dict[int, int] = {}
    for j, (wi, si, k, _dyn) in enumerate(choices):
        if not b[j]:
            continue
        w, s = inp.workloads[wi], shapes[si]
        g = cost_of[s.gpu_model]
        watts += (g.max_w - g.idle_w) * s.compute_share * w.tokens_per_s / s.tokens_per_s
        used[si] = used.get(si, 0) + k
        out.assignments.append(Assignment(w.name, s.key, s.gpu_model, s.profile, k, w.tokens_per_s,
                                          round(w.tokens_per_s / (s.tokens_per_s * k), 6)))
    for si, s in enumerate(shapes):
        have = sum(x[i] * lay.count(s.profile) for i, lay in enumerate(lays) if lay.gpu_model == s.gpu_model)
        if have - used.get(si, 0) > 0:
            out.spare_slices[s.key] = have - used.get(si, 0)
    out.power_kw = watts / 1000
    out.power_cost_per_hour = out.power_kw * inp.price_per_kwh
    out.tokens_per_s = sum(w.tokens_per_s for w in inp.workloads)
    out.layouts.sort(key=lambda u: (u.gpu_model, -u.gpus, u.layout))
    out.assignments.sort(key=lambda a: a.workload)
    return out


# --------------------------------------------------------------------------------------------------
# Alternatives, for comparison
# --------------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    key: str
    label: str
    result: PlanResult


def scenarios(inp: PlanInput) -> list[Scenario]:
    """The optimum, and what the same demand costs when the MSP restricts itself: one GPU model only,
    or whole GPUs only (MIG off)."""
    out = [Scenario("optimal", "Optimal (all models, MIG layouts)", solve(inp))]
    names = {g.gpu_model: g.name for g in inp.gpus}
    allowed = inp.gpu_models if inp.gpu_models is not None else tuple(names)
    quick = min(inp.time_limit_s, ALTERNATIVE_TIME_LIMIT_S)  # comparisons: a good answer fast is enough
    if len(allowed) > 1:
        for m in allowed:
            out.append(Scenario(f"only-{m}", f"{names[m]} only",
                                solve(replace(inp, gpu_models=(m,), time_limit_s=quick))))
    if inp.mig and inp.whole:
        out.append(Scenario("whole-gpus", "Whole GPUs only (MIG off)",
                            solve(replace(inp, mig=False, time_limit_s=quick))))
    return out
