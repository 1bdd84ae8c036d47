"""Capacity planner benchmark: the planner's fleet cost against two baselines on the same demand mixes.

    .venv/bin/python tests/bench/planner.py [--mixes N] [--workloads N] [--seed N]

Each mix is N workloads (tokens/s from 300 to 60,000; 5 to 120 GiB per replica) on the catalog's
H100 and H200 shapes with the modelled throughput (TESSERA_TOKENS_PER_S_PER_TBPS x bandwidth x compute
share), GPU-hours at $1.89 (H100) and $2.50 (H200), idle 70 W / full 700 W at $0.12/kWh, 70% target load.

Baselines, measured in the same run on the same mixes:

* greedy: each workload (largest first) on the shape with the lowest cost per token for it (its GPU's
  cost x compute share / usable tokens/s, replicas rounded up), then first-fit onto GPUs: a slice
  goes on the first GPU of its model whose profiles plus it still fit a MIG layout, else a new GPU
  (exact realizability: a multiset of profiles fits a GPU iff it is inside a maximal layout).
* whole GPUs only: the planner itself restricted to MIG off (what an MSP without MIG would buy).

Prints the cost ratios (planner / baseline; below 1 = the planner is cheaper) and solve times.
Only the planner module (pure Python + scipy) is used; no database.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from marketplace import planner
from marketplace.hardware.geometry import all_geometries

BANDWIDTH = {"h100-sxm-80gb": 3.35, "h200-sxm-141gb": 4.8}
COST = {"h100-sxm-80gb": 1.89, "h200-sxm-141gb": 2.50}
PER_TBPS = 3000.0
TARGET = 0.7


def shapes() -> tuple[planner.Shape, ...]:
    out = []
    for key, geo in all_geometries().items():
        for p in geo.profiles:
            if not p.media_extensions:
                share = p.compute_slices / geo.compute_slices
                out.append(planner.Shape(key, p.name, p.memory_mib / 1024, share, PER_TBPS * BANDWIDTH[key] * share))
        out.append(planner.Shape(key, None, geo.memory_mib / 1024, 1.0, PER_TBPS * BANDWIDTH[key]))
    return tuple(out)


def gpus() -> tuple[planner.GpuCost, ...]:
    return tuple(planner.GpuCost(k, k, COST[k], 70.0, 700.0) for k in COST)


def mix(rng: random.Random, n: int) -> tuple[planner.Workload, ...]:
    return tuple(planner.Workload(f"w{i}", rng.choice([300, 1_000, 2_500, 6_000, 15_000, 35_000, 60_000]),
                                  rng.choice([5, 8, 15, 30, 45, 60, 75, 120])) for i in range(n))


def greedy_cost(workloads, shape_list, price_per_kwh: float) -> float:
    gpu_of = {g.gpu_model: g for g in gpus()}
    maximal = {k: [dict(lay.counts) for lay in planner.layouts(k)] for k in COST}

    def fits(model: str, counts: dict) -> bool:
        return any(all(m.get(p, 0) >= n for p, n in counts.items()) for m in maximal[model])

    fleet: dict[str, list[dict]] = {k: [] for k in COST}
    dynamic_w = 0.0
    for w in sorted(workloads, key=lambda w: -w.tokens_per_s):
        options = []
        for s in shape_list:
            if s.memory_gib >= w.min_memory_gib:
                k = planner.slices_needed(w, s, TARGET)
                options.append((k * s.compute_share * gpu_of[s.gpu_model].hour_cost, s, k))
        _, s, k = min(options, key=lambda o: (o[0], o[1].key))
        g = gpu_of[s.gpu_model]
        dynamic_w += (g.max_w - g.idle_w) * s.compute_share * w.tokens_per_s / s.tokens_per_s
        for _ in range(k):
            for counts in fleet[s.gpu_model]:
                more = {**counts, s.profile: counts.get(s.profile, 0) + 1}
                if fits(s.gpu_model, more):
                    counts.update(more)
                    break
            else:
                fleet[s.gpu_model].append({s.profile: 1})
    cost = sum(len(v) * (gpu_of[m].hour_cost + gpu_of[m].idle_w / 1000 * price_per_kwh) for m, v in fleet.items())
    return cost + dynamic_w / 1000 * price_per_kwh


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mixes", type=int, default=30)
    ap.add_argument("--workloads", type=int, default=12)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    shape_list = shapes()
    price = 0.12
    rows = []
    for _ in range(args.mixes):
        workloads = mix(rng, args.workloads)
        inp = planner.PlanInput(workloads, shape_list, gpus(), price, target_utilization=TARGET)
        t0 = time.perf_counter()
        best = planner.solve(inp)
        t_best = time.perf_counter() - t0
        whole = planner.solve(planner.PlanInput(workloads, shape_list, gpus(), price, target_utilization=TARGET,
                                                mig=False))
        greedy = greedy_cost(workloads, shape_list, price)
        rows.append((best.cost_per_hour, greedy, whole.cost_per_hour, t_best, best.optimal, best.total_gpus))
    ratio_greedy = [b / g for b, g, *_ in rows]
    ratio_whole = [b / w for b, _g, w, *_ in rows]
    times = sorted(r[3] for r in rows)
    p95 = times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
    print(f"planner benchmark: {args.mixes} mixes x {args.workloads} workloads (seed {args.seed}), "
          f"H100 ${COST['h100-sxm-80gb']}/h, H200 ${COST['h200-sxm-141gb']}/h, target {TARGET:.0%}")
    print(f"  cost per hour, mean:   planner {statistics.mean(r[0] for r in rows):9.2f}   "
          f"greedy {statistics.mean(r[1] for r in rows):9.2f}   whole GPUs {statistics.mean(r[2] for r in rows):9.2f}")
    print(f"  planner / greedy       mean {statistics.mean(ratio_greedy):.3f}   worst {max(ratio_greedy):.3f}   "
          f"best {min(ratio_greedy):.3f}")
    print(f"  planner / whole GPUs   mean {statistics.mean(ratio_whole):.3f}   worst {max(ratio_whole):.3f}   "
          f"best {min(ratio_whole):.3f}")
    print(f"  GPUs per plan, mean    {statistics.mean(r[5] for r in rows):.1f}")
    print(f"  solve time             p50 {statistics.median(times) * 1000:.0f} ms   p95 {p95 * 1000:.0f} ms   "
          f"max {times[-1] * 1000:.0f} ms   proven within {planner.MIP_GAP:.1%}: "
          f"{sum(r[4] for r in rows)}/{len(rows)}")
    if any(b > g * (1 + planner.MIP_GAP) + 1e-9 for b, g, *_ in rows):
        print("  NOTE: the planner cost more than greedy on some mix (it should not)")


if __name__ == "__main__":
    main()
