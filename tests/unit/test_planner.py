"""The capacity planner's solver (marketplace.planner): MIG layouts checked against the NVML simulator
and the reference's layout table, plans checked by hand and against brute force.

Plain functions, no database.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from functools import cache

import pynvml
import pytest

from marketplace import planner
from marketplace.hardware.geometry import geometry
from marketplace.hardware.nvml_sim import SimNvml
from marketplace.planner import GpuCost, Layout, PlanError, PlanInput, Shape, Workload

H100, H200 = "h100-sxm-80gb", "h200-sxm-141gb"


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------

# The 38 placement-maximal H100 layouts (an independent enumeration from the MIG User Guide's H100 placement
# table, https://docs.nvidia.com/datacenter/tesla/mig-user-guide/ ):
# every one must be inside one of ours (ours are the multiset-maximal ones, which suffice for planning).
REFERENCE_H100 = """7x1g.10gb; 6x1g.10gb+1x1g.20gb; 5x1g.10gb+1x2g.20gb; 4x1g.10gb+1x1g.20gb+1x2g.20gb;
4x1g.10gb+1x3g.40gb; 3x1g.10gb+2x2g.20gb; 2x1g.10gb+1x1g.20gb+2x2g.20gb; 3x1g.10gb+1x4g.40gb;
2x1g.10gb+1x1g.20gb+1x4g.40gb; 2x1g.10gb+1x2g.20gb+1x3g.40gb; 1x1g.10gb+3x2g.20gb; 1x1g.20gb+3x2g.20gb;
1x1g.10gb+1x2g.20gb+1x4g.40gb; 1x1g.20gb+1x2g.20gb+1x4g.40gb; 2x2g.20gb+1x3g.40gb; 1x3g.40gb+1x4g.40gb;
1x7g.80gb; 5x1g.10gb+1x1g.20gb; 4x1g.10gb+2x1g.20gb; 3x1g.10gb+1x1g.20gb+1x2g.20gb;
2x1g.10gb+2x1g.20gb+1x2g.20gb; 3x1g.10gb+1x3g.40gb; 2x1g.10gb+1x1g.20gb+1x3g.40gb;
1x1g.10gb+1x1g.20gb+2x2g.20gb; 2x1g.20gb+2x2g.20gb; 1x1g.10gb+1x1g.20gb+1x4g.40gb;
1x1g.10gb+1x2g.20gb+1x3g.40gb; 2x1g.20gb+1x4g.40gb; 1x1g.20gb+1x2g.20gb+1x3g.40gb; 2x3g.40gb;
3x1g.10gb+2x1g.20gb; 2x1g.10gb+3x1g.20gb; 1x1g.10gb+2x1g.20gb+1x2g.20gb; 3x1g.20gb+1x2g.20gb;
1x1g.10gb+1x1g.20gb+1x3g.40gb; 2x1g.20gb+1x3g.40gb; 1x1g.10gb+3x1g.20gb; 4x1g.20gb"""


def _parse(text: str) -> list[dict[str, int]]:
    out = []
    for item in text.replace("\n", " ").split(";"):
        counts = {}
        for part in item.strip().split("+"):
            n, name = part.split("x", 1)
            counts[name] = int(n)
        out.append(counts)
    return out


def _counts(lay: Layout) -> dict[str, int]:
    return {p: n for p, n in lay.counts}


@cache
def _sim(model: str) -> SimNvml:
    sim = SimNvml(fleet=[model])
    sim.nvmlInit()
    return sim


def realizable_on_simulator(model: str, counts: dict[str, int]) -> bool:
    """Can these GPU instances be created together on one simulated GPU? Depth-first over the legal
    placements the simulator itself lists, creating and destroying real (simulated) GPU instances."""
    sim = _sim(model)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    geo = geometry(model)
    todo = sorted((geo.profile_by_name(n) for n, k in counts.items() for _ in range(k)),
                  key=lambda p: -p.memory_slices)

    def starts(profile_id: int) -> list[tuple[int, int]]:
        count = ctypes.c_uint()
        sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
        return [(p.start, p.size) for p in arr[: count.value]]

    def place(i: int) -> bool:
        if i == len(todo):
            return True
        p = todo[i]
        for start, size in starts(p.profile_id):
            try:
                gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(
                    h, p.profile_id, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size)))
            except pynvml.NVMLError_InsufficientResources:
                continue
            try:
                if place(i + 1):
                    return True
            finally:
                sim.nvmlGpuInstanceDestroy(gi)
        return False

    return place(0)


@pytest.mark.parametrize("model", [H100, H200])
def test_layouts_are_realizable_and_maximal_on_the_simulator(model):
    lays = planner.mig_layouts(model)
    assert len(lays) == 28
    names = [p.name for p in geometry(model).profiles if not p.media_extensions]
    for lay in lays:
        counts = _counts(lay)
        assert realizable_on_simulator(model, counts), lay.label
        for extra in names:  # nothing more fits, in any arrangement
            more = {**counts, extra: counts.get(extra, 0) + 1}
            assert not realizable_on_simulator(model, more), f"{lay.label} + {extra}"
    # none is inside another (they are the maximal ones)
    for a, b in itertools.permutations(lays, 2):
        assert not all(_counts(b).get(k, 0) >= v for k, v in _counts(a).items()), (a.label, b.label)


def test_every_reference_layout_is_covered():
    ours = [_counts(lay) for lay in planner.mig_layouts(H100)]
    reference = _parse(REFERENCE_H100)
    assert len(reference) == 38
    for ref in reference:
        assert any(all(o.get(k, 0) >= v for k, v in ref.items()) for o in ours), ref
    # and each of ours is itself one of the reference's placement-maximal layouts
    assert all(o in reference for o in ours)


def test_whole_gpu_layout_and_labels():
    lays = planner.layouts(H200)
    assert lays[-1].is_whole and lays[-1].label == "whole GPU (MIG off)"
    assert planner.layouts(H200, mig=False) == [lays[-1]]
    assert "2× 3g.71gb" in {lay.label for lay in lays}


# --------------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------------

RATE = {H100: 1000.0, H200: 1400.0}  # tokens/s per compute slice (7 per GPU), round numbers to check by hand


def shapes(rate=RATE) -> tuple[Shape, ...]:
    out = []
    for model in (H100, H200):
        geo = geometry(model)
        for p in geo.profiles:
            if not p.media_extensions:
                out.append(Shape(model, p.name, p.memory_mib / 1024, p.compute_slices / 7,
                                 rate[model] * p.compute_slices))
        out.append(Shape(model, None, geo.memory_mib / 1024, 1.0, rate[model] * 7))
    return tuple(out)


def gpus(h100=2.0, h200=2.5, idle=0.0, full=0.0) -> tuple[GpuCost, ...]:
    return (GpuCost(H100, "H100", h100, idle, full), GpuCost(H200, "H200", h200, idle, full))


def plan(workloads, **kw) -> planner.PlanResult:
    kw.setdefault("target_utilization", 1.0)
    return planner.solve(PlanInput(workloads=tuple(workloads), shapes=kw.pop("shapes", shapes()),
                                   gpus=kw.pop("gpus", gpus()), price_per_kwh=kw.pop("price_per_kwh", 0.0), **kw))


def test_one_workload_on_the_cheaper_model_per_token():
    # H100 $2.00 for 7,000 tok/s (0.286 m$/1K...) vs H200 $2.50 for 9,800 tok/s: H200 is cheaper per token.
    r = plan([Workload("chat", 19_600, 10)])
    assert r.feasible and r.optimal
    assert r.gpus == {H200: 2}
    assert r.cost_per_hour == pytest.approx(5.0)
    assert r.cost_per_1k_tokens == pytest.approx(5.0 / (19_600 * 3.6))
    # H100 made cheap enough: it wins
    r = plan([Workload("chat", 19_600, 10)], gpus=gpus(h100=1.0))
    assert r.gpus == {H100: 3}  # 3 x 7,000 >= 19,600
    assert r.cost_per_hour == pytest.approx(3.0)


def test_memory_decides_the_slice():
    # 30 GiB per replica: on H100 only 3g/4g/7g/whole fit (2g.20gb and 1g.20gb have 19.6 GiB).
    r = plan([Workload("code", 2_500, 30)], gpu_models=(H100,))
    (a,) = r.assignments
    assert a.profile in ("3g.40gb", "4g.40gb", None, "7g.80gb")
    assert a.slices * 1000 * (3 if a.profile == "3g.40gb" else 4) >= 2_500
    big = plan([Workload("huge", 100, 120)], gpu_models=(H100,))
    assert not big.feasible and big.status == "infeasible"
    assert "huge needs 120 GiB per replica" in big.message and "79.6 GiB" in big.message
    assert plan([Workload("huge", 100, 120)]).assignments[0].gpu_model == H200


def test_slices_of_different_workloads_share_one_gpu():
    # Two small workloads: one needs a 4g (4 compute slices), the other a 3g; one GPU holds 4g + 3g.
    r = plan([Workload("a", 3_900, 35), Workload("b", 2_900, 35)], gpu_models=(H100,))
    assert r.gpus == {H100: 1}
    assert [(u.layout, u.gpus) for u in r.layouts] == [("1× 4g.40gb + 1× 3g.40gb", 1)]
    assert {a.workload: a.profile for a in r.assignments} == {"a": "4g.40gb", "b": "3g.40gb"}


def test_target_utilization_adds_replicas():
    full = plan([Workload("w", 7_000, 5)], gpu_models=(H100,))
    assert full.gpus == {H100: 1}
    headroom = plan([Workload("w", 7_000, 5)], gpu_models=(H100,), target_utilization=0.5)
    assert headroom.gpus == {H100: 2}
    for a in headroom.assignments:
        assert a.utilization <= 0.5 + 1e-9


def test_power_is_priced_idle_plus_activity():
    # 1 H100 at idle 100 W, full 700 W; 3,500 tok/s on a whole GPU (7,000) = activity 0.5 -> 400 W.
    r = plan([Workload("w", 3_500, 5)], gpu_models=(H100,), mig=False, gpus=gpus(idle=100, full=700),
             price_per_kwh=0.5)
    assert r.gpus == {H100: 1}
    assert r.power_kw == pytest.approx(0.4)
    assert r.power_cost_per_hour == pytest.approx(0.2)
    assert r.cost_per_hour == pytest.approx(2.2)


def _min_gpus(model: str, need: dict[str, int]) -> int | None:
    """Fewest GPUs of `model` whose layouts (maximal MIG ones + whole) cover `need` (breadth-first)."""
    lays = [{(k or "whole"): v for k, v in lay.counts} for lay in planner.layouts(model)]
    target = tuple(sorted(need.items()))
    if not need:
        return 0
    frontier, seen = {target}, {target}
    for depth in range(1, 40):
        nxt = set()
        for state in frontier:
            for lay in lays:
                rest = tuple((k, v - lay.get(k, 0)) for k, v in state if v - lay.get(k, 0) > 0)
                if not rest:
                    return depth
                if rest not in seen:
                    seen.add(rest)
                    nxt.add(rest)
        frontier = nxt
    return None


def brute_force(workloads, shape_list, costs, target) -> float:
    """Cheapest cost over every way to put each workload on one shape (GPU cost only)."""
    best = math.inf
    options = [[s for s in shape_list if s.memory_gib >= w.min_memory_gib] for w in workloads]
    for pick in itertools.product(*options):
        need: dict[str, dict[str, int]] = {H100: {}, H200: {}}
        for w, s in zip(workloads, pick, strict=True):
            k = planner.slices_needed(w, s, target)
            key = s.profile or "whole"
            need[s.gpu_model][key] = need[s.gpu_model].get(key, 0) + k
        cost = 0.0
        for model, n in need.items():
            g = _min_gpus(model, n)
            if g is None:
                break
            cost += g * costs[model]
        else:
            best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_on_small_mixes(seed):
    import random

    rng = random.Random(seed)
    workloads = [Workload(f"w{i}", rng.choice([400, 1_200, 2_900, 6_500, 11_000]), rng.choice([5, 15, 30, 60]))
                 for i in range(3)]
    shape_list = [s for s in shapes() if s.profile in (None, "1g.10gb", "1g.18gb", "2g.20gb", "2g.35gb",
                                                         "3g.40gb", "3g.71gb")]
    costs = {H100: 2.0, H200: 2.6}
    r = plan(workloads, shapes=tuple(shape_list), gpus=gpus(2.0, 2.6), target_utilization=0.8)
    expected = brute_force(workloads, shape_list, costs, 0.8)
    assert r.feasible
    assert r.cost_per_hour == pytest.approx(expected, rel=planner.MIP_GAP + 1e-9)
    # what the plan says is consistent with itself
    used: dict[str, int] = {}
    for a in r.assignments:
        used[a.shape] = used.get(a.shape, 0) + a.slices
        assert a.utilization <= 0.8 + 1e-9
    have: dict[str, int] = {}
    for u in r.layouts:
        for prof, k in u.counts.items():
            key = f"{u.gpu_model}/{prof}"
            have[key] = have.get(key, 0) + k * u.gpus
    for key, n in used.items():
        assert have.get(key, 0) >= n, key
    assert r.cost_per_hour == pytest.approx(sum(u.gpus * costs[u.gpu_model] for u in r.layouts))


def test_scenarios_restrict_the_fleet():
    inp = PlanInput(workloads=(Workload("a", 9_000, 20), Workload("b", 700, 8)), shapes=shapes(), gpus=gpus(),
                    price_per_kwh=0.1)
    out = {s.key: s for s in planner.scenarios(inp)}
    assert list(out) == ["optimal", f"only-{H100}", f"only-{H200}", "whole-gpus"]
    assert set(out[f"only-{H100}"].result.gpus) == {H100}
    assert set(out[f"only-{H200}"].result.gpus) == {H200}
    assert all(u.layout == "whole GPU (MIG off)" for u in out["whole-gpus"].result.layouts)
    best = out["optimal"].result.cost_per_hour
    assert all(best <= s.result.cost_per_hour + 1e-9 for s in out.values() if s.result.feasible)


@pytest.mark.parametrize("bad, field, message", [
    ({"workloads": ()}, "workloads", "at least one workload"),
    ({"workloads": (Workload("a", 1, 1), Workload("a", 2, 1))}, "workloads", "unique: a"),
    ({"workloads": (Workload("a", 0, 1),)}, "workloads", "tokens/s must be above 0"),
    ({"workloads": (Workload("a", 1, -1),)}, "workloads", "memory cannot be negative"),
    ({"workloads": (Workload("a", 1, 1, ("a100",)),)}, "workloads", "unknown GPU model a100"),
    ({"target_utilization": 0}, "target_utilization", "above 0"),
    ({"target_utilization": 1.5}, "target_utilization", "at most 100%"),
    ({"price_per_kwh": -1}, "price_per_kwh", "cannot be negative"),
])
def test_bad_input_is_refused_with_the_field(bad, field, message):
    kw = {"workloads": (Workload("a", 100, 1),), "shapes": shapes(), "gpus": gpus(), "price_per_kwh": 0.1, **bad}
    with pytest.raises(PlanError, match=message) as exc:
        planner.solve(PlanInput(**kw))
    assert exc.value.field == field
