"""Placement benchmark: the engine vs a first-fit baseline vs fluid (fragmentation-free) references.

    .venv/bin/python tests/bench/placement.py [--seed N] [--requests N] [--lifetime L]

Fleet: 125 nodes of 8 GPUs (63 H200 nodes, 62 H100 nodes: 504 H200 + 496 H100). Requests: a seeded
mix (mostly 1g/2g slices, some 3g/4g, a few 7g and whole GPUs, some dedicated), one per time step;
each admitted allocation lives an exponential lifetime and is released when it expires, so the
fleet fills up and then runs at saturation. Every policy sees the same arrivals and lifetimes.

References (no placement, slices perfectly divisible; they admit by the same greedy
"admit if it fits now" rule, so they are the fragmentation-free counterpart of the engine, not a
proof that no online policy can admit more):

* fluid-mem: per GPU model, admit iff the model's free memory slices >= the request's size;
* fluid-tight: also compute slices (7 per GPU), per-profile max counts (x GPUs), memory slice 7
  (only 1g.20gb@6, 3g@4 and 7g/whole can use it, so everything else shares 7 slices per GPU) and
  dedication (a dedicated tenant holds whole GPUs: ceil of its needs, returned when no longer needed).
  Every one of these is a necessary condition for a real layout, so fluid-tight is the honest
  "no fragmentation at all" figure the engine is measured against.

Only the standard library is used. Not collected by pytest (tests/bench is in norecursedirs).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from marketplace.hardware.geometry import geometry
from marketplace.placement import BEST_FIT, FIRST_FIT, Fleet, GpuState, Request
from marketplace.placement_groups import GROUP_SIZES, GroupFleet, GroupRequest, NodeState

H100 = "h100-sxm-80gb"
H200 = "h200-sxm-141gb"
NODES = 125
GPUS_PER_NODE = 8
WHOLE = "whole"

# (profile id or WHOLE, share of requests); ids: 19 1g, 20 1g+me, 15 1g.20gb/1g.35gb, 14 2g, 9 3g,
# 5 4g, 0 7g. Mostly small slices, some 3g/4g, a few 7g / whole GPU.
MIX = [(19, 0.33), (20, 0.03), (15, 0.14), (14, 0.23), (9, 0.12), (5, 0.07), (0, 0.05), (WHOLE, 0.03)]
DEDICATED_SHARE = 0.06
RAMP = 0.3  # the first 30% of the requests arrive four times as fast (filling the fleet)
TENANTS = 300
DEDICATED_TENANTS = 12


@dataclass(frozen=True)
class Arrival:
    t: float
    geometry: str
    profile: int | str
    tenant: int
    dedicated: bool
    lifetime: int


def build_fleet_states() -> list[GpuState]:
    states = []
    gid = 0
    for node in range(NODES):
        geo = H200 if node % 2 == 0 else H100
        for _ in range(GPUS_PER_NODE):
            states.append(GpuState(gid, geo, node))
            gid += 1
    return states


def mean_memory_slices() -> float:
    g = geometry(H100)
    size = {p.profile_id: p.memory_slices for p in g.profiles}
    size[WHOLE] = g.memory_slices
    return sum(size[p] * w for p, w in MIX) / sum(w for _, w in MIX)


def make_arrivals(n: int, seed: int, load: float, gpu_count: dict[str, int]) -> tuple[list[Arrival], float]:
    """One arrival per time unit (the first RAMP share four times as fast, to fill the fleet), each
    with an exponential lifetime whose mean makes the offered memory load ``load`` x capacity."""
    rng = random.Random(seed)
    total_gpus = sum(gpu_count.values())
    capacity = total_gpus * geometry(H100).memory_slices
    mean_life = load * capacity / mean_memory_slices()  # Little: arrivals/time * life * size = load*cap
    profiles = [p for p, _ in MIX]
    weights = [w for _, w in MIX]
    tenant_w = [1.0 / (k + 1) ** 0.8 for k in range(TENANTS)]  # a few big tenants, a long tail
    geos = list(gpu_count)
    geo_w = [gpu_count[g] / total_gpus for g in geos]
    out = []
    ramp = int(RAMP * n)
    for i in range(n):
        t = i / 4 if i < ramp else ramp / 4 + (i - ramp)
        dedicated = rng.random() < DEDICATED_SHARE
        tenant = rng.randrange(DEDICATED_TENANTS) if dedicated else rng.choices(range(TENANTS), tenant_w)[0]
        prof = rng.choices(profiles, weights)[0]
        life = rng.expovariate(1.0 / mean_life)
        out.append(Arrival(t, rng.choices(geos, geo_w)[0], prof, tenant, dedicated, life))
    return out, mean_life


# --------------------------------------------------------------------------------------------
# Engine / baseline run
# --------------------------------------------------------------------------------------------


def run_policy(arrivals: list[Arrival], policy: str) -> dict:
    fleet = Fleet(build_fleet_states(), policy=policy)
    expiries: list[tuple[float, int, int, int]] = []  # (t_end, seq, gpu, start)
    admitted = 0
    by_geo: dict[str, int] = {}
    by_kind = {"small": [0, 0], "large": [0, 0], "whole/7g": [0, 0], "dedicated": [0, 0]}
    place_ns: list[int] = []
    frag_samples: list[float] = []
    util_samples: list[float] = []
    perf = time.perf_counter_ns
    t_start = perf()
    for seq, a in enumerate(arrivals):
        while expiries and expiries[0][0] <= a.t:
            _, _, gpu, start = heapq.heappop(expiries)
            fleet.release(gpu, start)
        if a.profile == WHOLE:
            req = Request(a.geometry, a.tenant, whole_gpu=True, dedicated=a.dedicated)
        else:
            req = Request(a.geometry, a.tenant, profile_id=a.profile, dedicated=a.dedicated)
        t0 = perf()
        d = fleet.place(req)
        place_ns.append(perf() - t0)
        kind = _kind(a)
        by_kind[kind][1] += 1
        if d:
            admitted += 1
            by_geo[a.geometry] = by_geo.get(a.geometry, 0) + 1
            by_kind[kind][0] += 1
            heapq.heappush(expiries, (a.t + a.lifetime, seq, d.gpu_id, d.start))
        if seq % 100 == 99:
            frag_samples.append(fleet.fragmentation())
            util_samples.append(fleet.utilization())
    total_ns = perf() - t_start
    place_ns.sort()
    return {
        "admitted": admitted,
        "by_geo": by_geo,
        "by_kind": by_kind,
        "mean_us": statistics.fmean(place_ns) / 1e3,
        "p95_us": place_ns[int(0.95 * len(place_ns))] / 1e3,
        "max_us": place_ns[-1] / 1e3,
        "place_total_s": sum(place_ns) / 1e9,
        "total_s": total_ns / 1e9,
        "frag_end": fleet.fragmentation(),
        "frag_avg": statistics.fmean(frag_samples[len(frag_samples) // 2 :]),
        "util_avg": statistics.fmean(util_samples[len(util_samples) // 2 :]),
        "util_end": fleet.utilization(),
    }


def _kind(a: Arrival) -> str:
    if a.dedicated:
        return "dedicated"
    if a.profile in (WHOLE, 0):
        return "whole/7g"
    if a.profile in (9, 5):
        return "large"
    return "small"


# --------------------------------------------------------------------------------------------
# Fluid references
# --------------------------------------------------------------------------------------------


class _FluidPool:
    """Aggregate usage of n GPUs of one model, slices perfectly divisible."""

    def __init__(self, geo_key: str, n: int, tight: bool) -> None:
        g = geometry(geo_key)
        self.mem_per = g.memory_slices
        self.comp_per = g.compute_slices
        self.max_count = {p.profile_id: p.max_count for p in g.profiles}
        self.max_count[WHOLE] = 1
        # whole GPU and 7g share slot 0 and 1 per GPU; counted together as "7g"
        self.size = {p.profile_id: p.memory_slices for p in g.profiles}
        self.size[WHOLE] = g.memory_slices
        self.comp = {p.profile_id: p.compute_slices for p in g.profiles}
        self.comp[WHOLE] = g.compute_slices
        # profiles that can use the last memory slice (a start + size reaching the end)
        self.uses_last = {p.profile_id for p in g.profiles if max(p.starts) + p.memory_slices == g.memory_slices}
        self.uses_last.add(WHOLE)
        self.n = n
        self.tight = tight
        self.mem = 0
        self.compute = 0
        self.low_mem = 0  # memory held by profiles that cannot use the last slice
        self.counts: dict[int | str, int] = {}

    def fits(self, prof, n: int | None = None, extra: int = 1) -> bool:
        n = self.n if n is None else n
        mem = self.mem + extra * self.size[prof]
        if mem > self.mem_per * n:
            return False
        if not self.tight:
            return True
        if self.compute + extra * self.comp[prof] > self.comp_per * n:
            return False
        low = self.low_mem + (0 if prof in self.uses_last else extra * self.size[prof])
        if low > (self.mem_per - 1) * n:
            return False
        c = self.counts.get(prof, 0) + extra
        return c <= self.max_count[prof] * n

    def holds_in(self, n: int) -> bool:
        """Current usage fits into n GPUs."""
        if self.mem > self.mem_per * n:
            return False
        if not self.tight:
            return True
        if self.compute > self.comp_per * n or self.low_mem > (self.mem_per - 1) * n:
            return False
        return all(c <= self.max_count[p] * n for p, c in self.counts.items())

    def add(self, prof, sign: int = 1) -> None:
        self.mem += sign * self.size[prof]
        if prof not in self.uses_last:
            self.low_mem += sign * self.size[prof]
        self.compute += sign * self.comp[prof]
        self.counts[prof] = self.counts.get(prof, 0) + sign


def _fits_whole(pool: _FluidPool, prof) -> bool:
    # A whole GPU and a 7g both need an entirely empty GPU: they share one count budget.
    return _fits_whole_n(pool, prof, pool.n)


def run_fluid(arrivals: list[Arrival], gpu_count: dict[str, int], tight: bool) -> dict:
    by_kind: dict[str, int] = {}
    shared = {g: _FluidPool(g, n, tight) for g, n in gpu_count.items()}
    own: dict[tuple[str, int], _FluidPool] = {}
    expiries: list[tuple[float, int, str, int, bool, int | str]] = []
    admitted = 0
    for seq, a in enumerate(arrivals):
        while expiries and expiries[0][0] <= a.t:
            _, _, geo, tenant, in_own, prof = heapq.heappop(expiries)
            if in_own:
                p = own[(geo, tenant)]
                p.add(prof, -1)
                while p.n > 0 and p.holds_in(p.n - 1):
                    p.n -= 1
                    shared[geo].n += 1
            else:
                shared[geo].add(prof, -1)
        s = shared[a.geometry]
        key = (a.geometry, a.tenant)
        if not tight:
            ok = s.fits(a.profile)
            if ok:
                s.add(a.profile)
                admitted += 1
                by_kind[_kind(a)] = by_kind.get(_kind(a), 0) + 1
                heapq.heappush(expiries, (a.t + a.lifetime, seq, a.geometry, a.tenant, False, a.profile))
            continue
        p = own.get(key)
        if p is None:
            p = own[key] = _FluidPool(a.geometry, 0, tight)
        target = None
        if a.dedicated:
            # the tenant's dedicated GPUs, growing by one whole GPU taken from the shared pool
            if p.fits(a.profile) and _fits_whole(p, a.profile):
                target = p
            elif (
                s.n >= 1 and s.holds_in(s.n - 1) and p.fits(a.profile, p.n + 1) and _fits_whole_n(p, a.profile, p.n + 1)
            ):
                p.n += 1
                s.n -= 1
                target = p
        elif s.fits(a.profile) and _fits_whole(s, a.profile):
            target = s
        elif p.n and p.fits(a.profile) and _fits_whole(p, a.profile):
            target = p
        if target is not None:
            target.add(a.profile)
            admitted += 1
            by_kind[_kind(a)] = by_kind.get(_kind(a), 0) + 1
            heapq.heappush(expiries, (a.t + a.lifetime, seq, a.geometry, a.tenant, target is p, a.profile))
    return {"admitted": admitted, "by_kind": by_kind}


def _fits_whole_n(pool: _FluidPool, prof, n: int) -> bool:
    if prof not in (WHOLE, 0):
        return True
    return pool.counts.get(WHOLE, 0) + pool.counts.get(0, 0) + 1 <= n


# --------------------------------------------------------------------------------------------
# A true upper bound: the LP relaxation, through its dual
# --------------------------------------------------------------------------------------------


def _resource_rows(geo_key: str) -> list[tuple[str, dict, int]]:
    """Per-GPU necessary conditions, as (name, coefficient per profile, capacity per GPU)."""
    g = geometry(geo_key)
    size = {p.profile_id: p.memory_slices for p in g.profiles}
    size[WHOLE] = g.memory_slices
    comp = {p.profile_id: p.compute_slices for p in g.profiles}
    comp[WHOLE] = g.compute_slices
    last = {p.profile_id for p in g.profiles if max(p.starts) + p.memory_slices == g.memory_slices} | {WHOLE}
    rows = [
        ("memory slices", size, g.memory_slices),
        ("compute slices", comp, g.compute_slices),
        (
            "slices 0-6 (profiles that cannot use slice 7)",
            {p: s for p, s in size.items() if p not in last},
            g.memory_slices - 1,
        ),
        ("7g / whole / 4g need slices 0-3", {0: 1, WHOLE: 1, 5: 1}, 1),
    ]
    for p in g.profiles:
        if p.profile_id in (0, 5):
            continue
        if p.max_count * p.memory_slices < g.memory_slices:  # count cap not implied by memory
            rows.append((f"max count {p.name}", {p.profile_id: 1}, p.max_count))
    return rows


def lp_upper_bound(
    arrivals: list[Arrival], gpu_count: dict[str, int], known: dict[str, float], iters: int = 1500,
    rows_of=None, weight=None,
) -> float | None:
    """Upper bound on the requests ANY policy could satisfy, even offline with admission control:
    the LP  max sum x_i  s.t. at every arrival time, per GPU model and per row of
    _resource_rows, sum over active admitted requests of coef * x_i <= capacity * GPUs; 0<=x<=1.
    Any dual y >= 0 gives the bound  C.y + sum_i max(0, 1 - (A^T y)_i); y is improved by projected
    subgradient steps (Polyak, target = the best count a policy reached), so the figure is valid at
    every iteration and only its tightness depends on the iterations. Needs numpy (else None).
    ``rows_of(geo)``: the rows (default _resource_rows); ``weight(arrival)``: the objective's weight of a
    request (default 1: requests satisfied; the groups run weighs by GPUs)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    total = 0.0
    for geo, n_gpus in gpu_count.items():
        reqs = [a for a in arrivals if a.geometry == geo]
        if not reqs:
            continue
        t = np.array([a.t for a in reqs])
        hi = np.searchsorted(t, t + np.array([a.lifetime for a in reqs]), side="left")
        n = len(reqs)
        rows = (rows_of or _resource_rows)(geo)
        w = np.array([weight(a) if weight else 1.0 for a in reqs])
        q = np.array([[coef.get(a.profile, 0) for a in reqs] for _, coef, _ in rows], dtype=float)
        cap = np.array([c * n_gpus for _, _, c in rows], dtype=float)
        keep = q.any(axis=1)
        q, cap = q[keep], cap[keep]
        y = np.zeros((len(cap), n))
        best = float(w.sum())
        lam, stall = 1.0, 0
        target = known.get(geo, 0)
        for _ in range(iters):
            cum = np.concatenate([np.zeros((len(cap), 1)), np.cumsum(y, axis=1)], axis=1)
            price = (q * (cum[:, hi] - cum[:, :n])).sum(axis=0)  # (A^T y)_i; request i covers [i, hi_i)
            red = w - price
            x = red > 0
            dual = float((cap[:, None] * y).sum() + red[x].sum())
            if dual < best - 1e-9:
                best, stall = dual, 0
            else:
                stall += 1
                if stall >= 40:
                    lam, stall = lam / 2, 0
            qx = q * x
            gone = np.stack([np.bincount(hi[x], weights=qx[r, x], minlength=n + 1)[:n] for r in range(len(cap))])
            load = np.cumsum(qx, axis=1) - np.cumsum(gone, axis=1)  # usage right after arrival k
            grad = cap[:, None] - load
            grad[(y <= 0) & (grad > 0)] = 0.0  # projection onto y >= 0
            norm = float((grad * grad).sum())
            if norm == 0 or lam < 1e-4:
                break
            y = np.maximum(0.0, y - lam * max(dual - target, 1.0) / norm * grad)
        total += best
    return total


# --------------------------------------------------------------------------------------------


def evaluate(arrivals: list[Arrival], gpu_count: dict[str, int]) -> dict:
    best = run_policy(arrivals, BEST_FIT)
    ff = run_policy(arrivals, FIRST_FIT)
    fluid_mem = run_fluid(arrivals, gpu_count, tight=False)
    fluid_tight = run_fluid(arrivals, gpu_count, tight=True)
    known = {g: max(best["by_geo"].get(g, 0), ff["by_geo"].get(g, 0)) for g in gpu_count}
    lp = lp_upper_bound(arrivals, gpu_count, known)
    return {"engine": best, "first_fit": ff, "fluid_tight": fluid_tight, "fluid_mem": fluid_mem, "lp": lp}


# --------------------------------------------------------------------------------------------
# --groups: MIG slices and 1/2/4/8-GPU groups sharing one fleet (marketplace.placement_groups)
# --------------------------------------------------------------------------------------------

# Slices by profile id and whole-GPU groups "g1".."g8", with their share of requests.
GROUP_MIX = [(19, 0.22), (14, 0.14), (9, 0.08), (5, 0.05), (0, 0.03),
             ("g1", 0.18), ("g2", 0.15), ("g4", 0.10), ("g8", 0.05)]
GROUP_N = {"g1": 1, "g2": 2, "g4": 4, "g8": 8}


def _gpus_of(profile) -> float:
    """GPUs a request holds (a slice: its share of the memory slices)."""
    if profile in GROUP_N:
        return float(GROUP_N[profile])
    g = geometry(H100)
    return g.profile_by_id(profile).memory_slices / g.memory_slices


def make_group_arrivals(n: int, seed: int, load: float, gpu_count: dict[str, int]) -> tuple[list[Arrival], float]:
    rng = random.Random(seed)
    total = sum(gpu_count.values())
    mean_gpus = sum(_gpus_of(p) * w for p, w in GROUP_MIX) / sum(w for _, w in GROUP_MIX)
    mean_life = load * total / mean_gpus
    profiles = [p for p, _ in GROUP_MIX]
    weights = [w for _, w in GROUP_MIX]
    geos = list(gpu_count)
    out = []
    ramp = int(RAMP * n)
    for i in range(n):
        t = i / 4 if i < ramp else ramp / 4 + (i - ramp)
        out.append(Arrival(t, rng.choice(geos), rng.choices(profiles, weights)[0], rng.randrange(TENANTS), False,
                           rng.expovariate(1.0 / mean_life)))
    return out, mean_life


def _group_rows(geo_key: str) -> list[tuple[str, dict, int]]:
    """The slice rows, a group of N GPUs counting as N whole GPUs, and one 8-GPU group per node (8 GPUs)."""
    rows = []
    for name, coef, cap in _resource_rows(geo_key):
        c = {k: v for k, v in coef.items() if k != WHOLE}
        for g, n in GROUP_N.items():
            if WHOLE in coef:
                c[g] = coef[WHOLE] * n
        rows.append((name, c, cap))
    rows.append(("8-GPU groups: one per node", {"g8": 1}, 0))  # cap per GPU is 1/8: set below
    return rows


def _group_rows_capped(geo_key: str) -> list[tuple[str, dict, float]]:
    return [(n, c, (1 / GPUS_PER_NODE if cap == 0 else cap)) for n, c, cap in _group_rows(geo_key)]


def run_groups(arrivals: list[Arrival], policy: str) -> dict:
    """Slices go to GPUs already opened for MIG (the slice engine); a slice that fits none opens a GPU, which
    the group engine chooses as a 1-GPU group; an opened GPU that empties goes back. Groups go to the group
    engine. The same policy (best or first fit) drives both engines."""
    gfleet = GroupFleet([NodeState(node, H200 if node % 2 == 0 else H100,
                                   tuple(node * GPUS_PER_NODE + i for i in range(GPUS_PER_NODE)))
                         for node in range(NODES)], policy=policy)
    sfleet = Fleet([], policy=policy)
    open_gpus: dict[int, int] = {}  # gpu id -> instances on it
    expiries: list[tuple[float, int, str, int, tuple[int, ...]]] = []
    admitted = 0
    gpu_weighted = 0.0
    by_kind: dict[str, list[int]] = {}
    by_geo: dict[str, int] = {}
    by_geo_w: dict[str, float] = {}
    stranded_samples: list[dict[int, int]] = []
    free_samples: list[int] = []
    perf = time.perf_counter_ns
    place_ns = 0
    for seq, a in enumerate(arrivals):
        while expiries and expiries[0][0] <= a.t:
            _, _, kind, where, idx = heapq.heappop(expiries)
            if kind == "group":
                gfleet.release(where, idx)
            else:
                sfleet.release(where, idx[0])
                open_gpus[where] -= 1
                if not open_gpus[where]:
                    del open_gpus[where]
                    sfleet.remove_gpu(where)
                    gfleet.release(where // GPUS_PER_NODE, (where % GPUS_PER_NODE,))
        kind = str(a.profile) if a.profile in GROUP_N else "slice"
        by_kind.setdefault(kind, [0, 0])[1] += 1
        t0 = perf()
        ok = False
        if a.profile in GROUP_N:
            d = gfleet.place(GroupRequest(a.geometry, a.tenant, GROUP_N[a.profile]))
            if d:
                ok = True
                heapq.heappush(expiries, (a.t + a.lifetime, seq, "group", d.node_id, d.indexes))
        else:
            req = Request(a.geometry, a.tenant, profile_id=int(a.profile))
            sd = sfleet.place(req)
            if not sd:
                g = gfleet.place(GroupRequest(a.geometry, a.tenant, 1))  # open a GPU for MIG
                if g:
                    gid = g.gpu_ids[0]
                    sfleet.add_gpu(GpuState(gid, a.geometry, g.node_id))
                    open_gpus[gid] = 0
                    sd = sfleet.place(req)
            if sd:
                ok = True
                open_gpus[sd.gpu_id] += 1
                heapq.heappush(expiries, (a.t + a.lifetime, seq, "slice", sd.gpu_id, (sd.start,)))
        place_ns += perf() - t0
        if ok:
            admitted += 1
            gpu_weighted += _gpus_of(a.profile)
            by_geo[a.geometry] = by_geo.get(a.geometry, 0) + 1
            by_geo_w[a.geometry] = by_geo_w.get(a.geometry, 0.0) + _gpus_of(a.profile)
            by_kind[kind][0] += 1
        if seq % 100 == 99 and seq > len(arrivals) // 2:
            stranded_samples.append(gfleet.stranded())
            free_samples.append(gfleet.free_count())
    free_avg = statistics.fmean(free_samples)
    stranded_avg = {n: statistics.fmean(s[n] for s in stranded_samples) for n in GROUP_SIZES}
    return {"admitted": admitted, "gpu_weighted": gpu_weighted, "by_kind": by_kind, "by_geo": by_geo,
            "by_geo_w": by_geo_w, "free_avg": free_avg, "stranded_avg": stranded_avg,
            "place_us": place_ns / 1e3 / len(arrivals)}


def run_groups_fluid(arrivals: list[Arrival], gpu_count: dict[str, int]) -> dict:
    """The fragmentation-free counterpart: the same greedy admit-if-it-fits rule on a pool of GPUs per model
    where slices are fractions of a GPU and groups need only that many free GPUs anywhere."""
    free = {g: float(n) for g, n in gpu_count.items()}
    expiries: list[tuple[float, int, str, float]] = []
    admitted, weighted = 0, 0.0
    for seq, a in enumerate(arrivals):
        while expiries and expiries[0][0] <= a.t:
            _, _, geo, size = heapq.heappop(expiries)
            free[geo] += size
        size = _gpus_of(a.profile)
        if free[a.geometry] >= size - 1e-9:
            free[a.geometry] -= size
            admitted += 1
            weighted += size
            heapq.heappush(expiries, (a.t + a.lifetime, seq, a.geometry, size))
    return {"admitted": admitted, "gpu_weighted": weighted}


def main_groups(args) -> int:
    gpu_count = {H200: (NODES + 1) // 2 * GPUS_PER_NODE, H100: NODES // 2 * GPUS_PER_NODE}
    arrivals, mean_life = make_group_arrivals(args.requests, args.seed, args.load, gpu_count)
    best = run_groups(arrivals, BEST_FIT)
    ff = run_groups(arrivals, FIRST_FIT)
    fluid = run_groups_fluid(arrivals, gpu_count)
    known = {g: max(best["by_geo"].get(g, 0), ff["by_geo"].get(g, 0)) for g in gpu_count}
    lp = lp_upper_bound(arrivals, gpu_count, known, rows_of=_group_rows_capped)
    known_w = {g: max(best["by_geo_w"].get(g, 0.0), ff["by_geo_w"].get(g, 0.0)) for g in gpu_count}
    lp_w = lp_upper_bound(arrivals, gpu_count, known_w, rows_of=_group_rows_capped,
                          weight=lambda a: _gpus_of(a.profile))
    n = len(arrivals)
    mix = ", ".join(f"{p}:{w:.0%}" for p, w in GROUP_MIX)
    print(f"Groups: {sum(gpu_count.values())} GPUs on {NODES} HGX nodes (8 GPUs, NUMA 4+4); {n} requests, seed "
          f"{args.seed}, offered load {args.load:.0%} of the GPUs (mean lifetime {mean_life:.0f} arrivals)")
    print(f"Mix (slice profile id or gN = N-GPU group: share): {mix}")
    print()
    w = 40
    print(f"{'':{w}}{'engine':>12}{'first-fit':>12}{'LP bound':>12}{'fluid':>12}")
    print(f"{'requests satisfied (of ' + str(n) + ')':{w}}{best['admitted']:>12}{ff['admitted']:>12}{lp or 0:>12.1f}"
          f"{fluid['admitted']:>12}")
    for k in sorted(best["by_kind"]):
        got, total = best["by_kind"][k]
        print(f"{'  ' + k + ' (of ' + str(total) + ')':{w}}{got:>12}{ff['by_kind'][k][0]:>12}")
    print(f"{'GPU-weighted (GPUs x requests)':{w}}{best['gpu_weighted']:>12.1f}{ff['gpu_weighted']:>12.1f}"
          f"{lp_w or 0:>12.1f}{fluid['gpu_weighted']:>12.1f}")
    print(f"{'engine / fluid (GPU-weighted)':{w}}{best['gpu_weighted'] / fluid['gpu_weighted']:>12.4f}"
          f"{ff['gpu_weighted'] / fluid['gpu_weighted']:>12.4f}")
    if lp and lp_w:
        print(f"{'engine / LP bound (requests)':{w}}{best['admitted'] / lp:>12.4f}{ff['admitted'] / lp:>12.4f}")
        print(f"{'engine / LP bound (GPU-weighted)':{w}}{best['gpu_weighted'] / lp_w:>12.4f}"
              f"{ff['gpu_weighted'] / lp_w:>12.4f}")
    print(f"{'engine / first-fit (GPU-weighted)':{w}}{best['gpu_weighted'] / ff['gpu_weighted']:>12.4f}")
    print(f"{'free whole GPUs, 2nd-half avg':{w}}{best['free_avg']:>12.1f}{ff['free_avg']:>12.1f}")
    for size in GROUP_SIZES[1:]:
        print(f"{'  stranded for ' + str(size) + '-GPU groups, avg':{w}}{best['stranded_avg'][size]:>12.1f}"
              f"{ff['stranded_avg'][size]:>12.1f}")
    print(f"{'placement time per request, us':{w}}{best['place_us']:>12.1f}{ff['place_us']:>12.1f}")
    print()
    print("stranded for N: free whole GPUs that no free legal N-GPU set (one node, one NUMA node if N <= 4) covers.")
    print("LP bound: same dual LP as the slice run; a group of N counts as N whole GPUs in every row, and an 8-GPU")
    print("  group needs a node to itself; no policy, even offline, can exceed it (it may refuse small requests")
    print("  to admit 8-GPU groups later: its gap to the engine mixes fragmentation with online admission).")
    print("fluid: same arrivals and admit-if-it-fits rule with no placement at all (slices are fractions of a GPU,")
    print("  groups need N free GPUs anywhere): the fragmentation-free reference, not a bound.")
    if lp_w:
        ratio = best["gpu_weighted"] / lp_w
        print(f"target: engine/LP bound (GPU-weighted) {ratio:.4f} (>= 0.97: {'met' if ratio >= 0.97 else 'NOT met'})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--load", type=float, default=1.0, help="offered memory load / capacity")
    ap.add_argument("--sweep", default="0.9,1.1,1.25", help="other loads for the summary ('' = none)")
    ap.add_argument("--groups", action="store_true", help="slices and 1/2/4/8-GPU groups on one fleet")
    args = ap.parse_args()
    if args.groups:
        return main_groups(args)

    states = build_fleet_states()
    gpu_count: dict[str, int] = {}
    for st in states:
        gpu_count[st.geometry] = gpu_count.get(st.geometry, 0) + 1
    arrivals, mean_life = make_arrivals(args.requests, args.seed, args.load, gpu_count)
    r = evaluate(arrivals, gpu_count)
    best, ff, ft, fm, lp = r["engine"], r["first_fit"], r["fluid_tight"], r["fluid_mem"], r["lp"]

    n = len(arrivals)
    print(
        f"Fleet: {len(states)} GPUs on {NODES} nodes ({gpu_count[H100]} H100, {gpu_count[H200]} H200); "
        f"{n} requests, seed {args.seed}; offered load {args.load:.0%} of the memory slices "
        f"(mean lifetime {mean_life:.0f} arrivals; the first {RAMP:.0%} arrive 4x as fast)"
    )
    mix = ", ".join(f"{'whole' if p == WHOLE else p}:{w:.0%}" for p, w in MIX)
    print(f"Mix (profile id: share): {mix}; {DEDICATED_SHARE:.0%} dedicated (from {DEDICATED_TENANTS} tenants)")
    print()
    w = 38
    cols = ["engine", "first-fit", "fluid-tight", "fluid-mem", "LP bound"]
    print(f"{'':{w}}" + "".join(f"{c:>12}" for c in cols))
    lp_s = f"{lp:12.1f}" if lp is not None else f"{'n/a':>12}"
    print(
        f"{'requests satisfied (of ' + str(n) + ')':{w}}{best['admitted']:>12}{ff['admitted']:>12}"
        f"{ft['admitted']:>12}{fm['admitted']:>12}{lp_s}"
    )
    for k, (got, total) in best["by_kind"].items():
        print(
            f"{'  ' + k + ' (of ' + str(total) + ')':{w}}{got:>12}{ff['by_kind'][k][0]:>12}"
            f"{ft['by_kind'].get(k, 0):>12}{fm['by_kind'].get(k, 0):>12}{'':>12}"
        )
    refs = [ff["admitted"], ft["admitted"], fm["admitted"], lp]
    print(
        f"{'engine / column':{w}}{'':>12}"
        + "".join(f"{best['admitted'] / x:>12.4f}" if x else f"{'n/a':>12}" for x in refs)
    )
    print(
        f"{'column / LP bound':{w}}"
        + "".join(f"{x / lp:>12.4f}" if lp else f"{'n/a':>12}" for x in [best["admitted"], *refs[:3]])
    )
    print()
    print(f"{'':{w}}{'engine':>12}{'first-fit':>12}")
    rows = [
        ("place() mean, us", "mean_us", ".1f"),
        ("place() p95, us", "p95_us", ".1f"),
        ("place() max, us", "max_us", ".1f"),
        (f"place() total for {n} requests, s", "place_total_s", ".3f"),
        ("whole run incl. releases, s", "total_s", ".3f"),
        ("memory slices in use, 2nd-half avg", "util_avg", ".1%"),
        ("memory slices in use, end", "util_end", ".1%"),
        ("fragmentation, 2nd-half avg", "frag_avg", ".1%"),
        ("fragmentation, end", "frag_end", ".1%"),
    ]
    for label, key, fmt in rows:
        print(f"{label:{w}}{best[key]:>12{fmt}}{ff[key]:>12{fmt}}")
    print()
    print("fragmentation: share of the free memory slices that no free 3g placement covers.")
    print("fluid-*: same arrivals and greedy admit-if-it-fits rule, slices perfectly divisible (fluid-tight")
    print("  adds compute, max counts, slice 7 and dedication); a reference, not a strict bound: an engine")
    print("  that rejects a big request may admit several small ones later and beat it.")
    print("LP bound: LP relaxation of the offline problem (foresight, admission control) with the same")
    print("  necessary per-GPU conditions; no policy can satisfy more requests. Its gap to the engine")
    print("  mixes fragmentation with what online greedy admission costs.")

    if args.sweep:
        print()
        print(
            f"{'load':>6}{'engine':>9}{'1st-fit':>9}{'fl-tight':>9}{'LP':>9}"
            f"{'eng/LP':>9}{'eng/fl-t':>9}{'eng/1st':>9}{'ff/LP':>9}"
        )
        loads = sorted({args.load, *(float(x) for x in args.sweep.split(",") if x.strip())})
        for load in loads:
            arr, _ = make_arrivals(args.requests, args.seed, load, gpu_count)
            q = r if load == args.load else evaluate(arr, gpu_count)
            e, f_, t_, b = (q["engine"]["admitted"], q["first_fit"]["admitted"], q["fluid_tight"]["admitted"], q["lp"])
            print(f"{load:>6.0%}{e:>9}{f_:>9}{t_:>9}{b:>9.0f}{e / b:>9.4f}{e / t_:>9.4f}{e / f_:>9.4f}{f_ / b:>9.4f}")

    ratio_lp = best["admitted"] / lp if lp else float("nan")
    ratio_ft = best["admitted"] / ft["admitted"]
    fast = best["place_total_s"] < 1.0
    print()
    print(
        f"targets at load {args.load:.0%}: engine/LP bound {ratio_lp:.4f} (>= 0.98: "
        f"{'met' if ratio_lp >= 0.98 else 'NOT met'}); engine/fluid-tight {ratio_ft:.4f}; "
        f"{n} placements in {best['place_total_s']:.3f} s (< 1 s: {'met' if fast else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
