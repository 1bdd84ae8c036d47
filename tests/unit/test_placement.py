"""Placement engine: policy unit tests and property tests (no database; run with -p no:django)."""

from __future__ import annotations

import ctypes
import importlib.util
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.hardware.geometry import geometry
from marketplace.placement import (
    BEST_FIT,
    FIRST_FIT,
    Decision,
    Fleet,
    GpuState,
    Instance,
    NoCapacity,
    Request,
    layout_problems,
    legal_starts,
    valid_layout,
)

H100 = "h100-sxm-80gb"
H200 = "h200-sxm-141gb"
P1G, PME, P1G2, P2G, P3G, P4G, P7G = 19, 20, 15, 14, 9, 5, 0
ALL_PIDS = (P1G, PME, P1G2, P2G, P3G, P4G, P7G)


def gpu(gpu_id, geo=H100, node=0, instances=(), dedicated=None, sticky=False):
    return GpuState(gpu_id, geo, node, instances, dedicated, sticky)


def req(profile=None, tenant=1, geo=H100, whole=False, dedicated=False):
    return Request(geo, tenant, profile_id=profile, whole_gpu=whole, dedicated=dedicated)


# --------------------------------------------------------------------------------------------
# An independent oracle, written from geometry.py and the three rules only
# --------------------------------------------------------------------------------------------


def oracle_fits(geo_key, instances, pid, start):
    """Could (pid, start) be added to this list of Instance? (rules 1-3 and compute <= 7)"""
    g = geometry(geo_key)
    if pid is None:
        return not instances and start == 0
    p = g.profile_by_id(pid)
    if start not in p.starts:
        return False
    new = set(range(start, start + p.memory_slices))
    used = set()
    compute = p.compute_slices
    count = 1
    for i in instances:
        if i.profile_id is None:
            return False
        q = g.profile_by_id(i.profile_id)
        used |= set(range(i.start, i.start + q.memory_slices))
        compute += q.compute_slices
        count += i.profile_id == pid
    return not (new & used) and compute <= g.compute_slices and count <= p.max_count


def oracle_tenancy_ok(state: GpuState, request: Request):
    owner = state.dedicated_tenant_id
    if request.dedicated:
        return owner == request.tenant_id or (owner is None and not list(state.instances))
    return owner is None or owner == request.tenant_id


def oracle_hosts(fleet: Fleet, request: Request):
    """Every (gpu_id, start) where the request could legally go."""
    pid = None if request.whole_gpu else request.profile_id
    out = []
    for s in fleet.states():
        if s.geometry != request.geometry or not oracle_tenancy_ok(s, request):
            continue
        starts = (0,) if pid is None else geometry(s.geometry).profile_by_id(pid).starts
        for start in starts:
            if oracle_fits(s.geometry, list(s.instances), pid, start):
                out.append((s.gpu_id, start))
    return out


def assert_layout_ok(state: GpuState):
    g = geometry(state.geometry)
    used: set[int] = set()
    compute = 0
    counts: dict = {}
    for i in state.instances:
        if i.profile_id is None:
            assert len(state.instances) == 1 and i.start == 0
            continue
        p = g.profile_by_id(i.profile_id)
        assert i.start in p.starts, (state.gpu_id, i)
        slots = set(range(i.start, i.start + p.memory_slices))
        assert not slots & used, (state.gpu_id, state.instances)
        used |= slots
        compute += p.compute_slices
        counts[i.profile_id] = counts.get(i.profile_id, 0) + 1
    assert compute <= g.compute_slices
    for pid, c in counts.items():
        assert c <= g.profile_by_id(pid).max_count, (state.gpu_id, pid, c)
    if state.dedicated_tenant_id is not None:
        assert all(i.tenant_id == state.dedicated_tenant_id for i in state.instances)


# --------------------------------------------------------------------------------------------
# Validity rules
# --------------------------------------------------------------------------------------------


def test_valid_layout_rules():
    assert valid_layout(H100, [])
    assert valid_layout(H100, [(P3G, 0), (P4G, 0)]) is False  # overlap
    assert valid_layout(H100, [(P4G, 0), (P3G, 4)])  # 4+3 compute = 7
    assert not valid_layout(H100, [(P3G, 2)])  # start not in {0, 4}
    assert not valid_layout(H100, [(PME, 0), (PME, 1)])  # at most one +me
    assert valid_layout(H100, [(PME, 0), (P1G, 1)])
    assert not valid_layout(H100, [(P1G, 7)])  # 1g.10gb cannot start at 7
    assert valid_layout(H100, [(P1G2, 6)])  # 1g.20gb@6 reaches slice 7
    assert not valid_layout(H100, [(P7G, 0), (P1G, 0)])
    assert not valid_layout(H100, [(None, 0), (P1G, 3)])  # whole GPU takes everything
    assert any("max count" in p for p in layout_problems(H100, [(PME, 0), (PME, 1)]))
    assert any("overlaps" in p for p in layout_problems(H100, [(P2G, 0), (P1G, 1)]))
    assert legal_starts(H100, [(P3G, 4)], P2G) == [0, 2]


def _all_valid_sets(geo_key):
    g = geometry(geo_key)
    placements = [(p.profile_id, s) for p in g.profiles for s in p.starts]
    out = []

    def rec(i, chosen):
        if i == len(placements):
            out.append(tuple(chosen))
            return
        rec(i + 1, chosen)
        chosen.append(placements[i])
        if valid_layout(geo_key, chosen):
            rec(i + 1, chosen)
        chosen.pop()

    rec(0, [])
    return out


def test_valid_layout_matches_enumeration_in_reference():
    """gpu.md 1.6: 2,318 valid placement sets on H100 (non-empty), none over 7 compute slices."""
    sets = [s for s in _all_valid_sets(H100) if s]
    assert len(sets) == 2318
    g = geometry(H100)
    assert max(sum(g.profile_by_id(p).compute_slices for p, _ in s) for s in sets) <= 7
    assert len([s for s in _all_valid_sets(H200) if s]) == 2318


def test_valid_layout_agrees_with_oracle_on_every_pair():
    g = geometry(H100)
    placements = [(p.profile_id, s) for p in g.profiles for s in range(8)]
    for a, b in itertools.product(placements, repeat=2):
        inst = [Instance(a[0], a[1], 1)] if oracle_fits(H100, [], a[0], a[1]) else None
        if inst is None:
            assert not valid_layout(H100, [a, b])
            continue
        assert valid_layout(H100, [a, b]) == oracle_fits(H100, inst, b[0], b[1]), (a, b)


# --------------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------------


def test_1g_on_empty_h100_goes_to_start_6_keeping_the_big_profiles():
    """Any 1g breaks one 3g half; start 6 keeps 4g@0, 3g@0 and 2g@0/2/4 (as the driver's own
    automatic placement does); starts 0-3 would lose the 4g, 4-5 a 2g."""
    f = Fleet([gpu(1)])
    d = f.place(req(P1G))
    assert isinstance(d, Decision)
    assert (d.gpu_id, d.start, d.size) == (1, 6, 1)
    assert f.can_place(1, P4G, 0) and f.can_place(1, P3G, 0)
    assert all(f.can_place(1, P2G, s) for s in (0, 2, 4))
    assert not f.can_place(1, P3G, 4)
    assert f.free_mask(1) == 0b1011_1111 and f.used_mask(1) == 0b0100_0000


def test_seven_1g_fill_in_the_drivers_order():
    """gpu.md 1.7: seven 1g.10gb on an empty H100 land in slot order 6, 4, 5, 0, 1, 2, 3."""
    f = Fleet([gpu(1)])
    starts = [f.place(req(P1G)).start for _ in range(7)]
    assert starts == [6, 4, 5, 0, 1, 2, 3]
    assert isinstance(f.place(req(P1G)), NoCapacity)  # 7 compute slices used


def test_3g_on_empty_goes_to_4_so_a_4g_still_fits_and_then_fills_it():
    f = Fleet([gpu(1), gpu(2)])
    d = f.place(req(P3G))
    assert (d.gpu_id, d.start) == (1, 4)
    d2 = f.place(req(P4G))
    assert (d2.gpu_id, d2.start) == (1, 0)  # best fit: the partly used GPU, not GPU 2
    assert f.used_mask(1) == 0xFF and f.used_mask(2) == 0
    assert "fills the GPU" in d2.reason


def test_prefers_partly_used_gpu():
    f = Fleet([gpu(1), gpu(2, instances=[(P1G, 6, 9)]), gpu(3)])
    d = f.place(req(P1G))
    assert d.gpu_id == 2 and d.start == 4
    assert "partly used (1/8" in d.reason and "GPU 2" in d.reason
    d = f.place(req(P2G))
    assert (d.gpu_id, d.start) == (2, 0)  # still the partly used one; 4 is taken by the 1g
    assert f.used_mask(1) == 0 and f.used_mask(3) == 0


def test_keeps_3g_placeable_when_it_can():
    # GPU has a 2g at 0: a 1g should go into 2..3 (the half already broken), not the free half.
    f = Fleet([gpu(1, instances=[(P2G, 0, 5)])])
    d = f.place(req(P1G))
    assert d.start in (2, 3)
    assert f.can_place(1, P3G, 4)
    assert "keeps 3g.40gb placeable" in d.reason


def test_reason_mentions_gpu_and_candidates():
    f = Fleet([gpu(10, node=3), gpu(11, node=3), gpu(12, node=4)])
    d = f.place(req(P1G))
    assert "GPU 10" in d.reason and "node 3" in d.reason and "empty" in d.reason
    assert "2 other candidates" in d.reason and d.candidates == 3
    assert d.node_id == 3


def test_h200_names_in_reasons():
    f = Fleet([gpu(1, geo=H200)])
    d = f.place(req(P1G, geo=H200))
    assert "H200" in d.reason and "keeps 4g.71gb placeable" in d.reason
    f.place(req(P3G, geo=H200))
    f.place(req(P3G, geo=H200))  # no second 3g: one half is broken by the 1g
    nc = f.place(req(P3G, geo=H200))
    assert isinstance(nc, NoCapacity) and "3g.71gb" in nc.reason and "H200" in nc.reason


def test_geometry_must_match():
    f = Fleet([gpu(1, geo=H100)])
    nc = f.place(req(P1G, geo=H200))
    assert not nc and "no H200 SXM 141GB GPUs in the fleet" in nc.reason
    with pytest.raises(ValueError):
        f.place(req(99))
    with pytest.raises(ValueError):
        f.place(Request("a100", 1, profile_id=P1G))
    with pytest.raises(ValueError):
        f.place(Request(H100, 1))
    with pytest.raises(ValueError):
        f.place(Request(H100, 1, profile_id=P1G, whole_gpu=True))


def test_whole_gpu_only_on_empty():
    f = Fleet([gpu(1, instances=[(P1G, 0, 2)]), gpu(2)])
    d = f.place(req(whole=True))
    assert (d.gpu_id, d.profile_id, d.start, d.size) == (2, None, 0, 8)
    nc = f.place(req(whole=True))
    assert isinstance(nc, NoCapacity) and "empty" in nc.reason
    assert f.instances(2) == [Instance(None, 0, 1)] and f.free_starts(2, P1G) == ()
    d = f.place(req(P1G, tenant=3))
    assert d.gpu_id == 1  # the whole GPU takes nothing else
    f.release(2, 0)
    assert f.place(req(P7G)).gpu_id == 2


def test_dedicated_gpu_never_shared_with_another_tenant():
    f = Fleet([gpu(1, dedicated=7, instances=[(P1G, 6, 7)]), gpu(2, instances=[(P4G, 0, 3), (P3G, 4, 3)])])
    nc = f.place(req(P1G, tenant=8))
    assert isinstance(nc, NoCapacity)
    assert "1 dedicated to other tenants" in nc.reason and nc.dedicated_to_others == 1
    d = f.place(req(P1G, tenant=7))  # its owner may still use it
    assert d.gpu_id == 1 and d.dedicated and not d.newly_dedicated


def test_dedicated_request_takes_own_gpu_else_an_empty_one():
    f = Fleet([gpu(1, instances=[(P1G, 6, 2)]), gpu(2), gpu(3)])
    d = f.place(req(P1G, tenant=5, dedicated=True))
    assert d.gpu_id == 2 and d.newly_dedicated and d.dedicated  # not the partly used shared GPU 1
    assert "now dedicated" in d.reason
    assert f.dedicated_tenant(2) == 5
    d2 = f.place(req(P2G, tenant=5, dedicated=True))
    assert (d2.gpu_id, d2.start) == (2, 4) and not d2.newly_dedicated
    # another tenant's shared requests never land on GPU 2, though it has room
    for _ in range(6):
        assert f.place(req(P1G, tenant=6)).gpu_id == 1
    assert f.place(req(P1G, tenant=6)).gpu_id == 3
    # tenant 5 fills its GPU, then gets a second one (GPU 3 is shared and partly used: not that)
    assert (f.place(req(P4G, tenant=5, dedicated=True)).gpu_id, f.used_mask(2)) == (2, 0x7F)
    assert not f.place(req(P3G, tenant=5, dedicated=True))
    f.release(3, f.instances(3)[0].start)
    d4 = f.place(req(P3G, tenant=5, dedicated=True))
    assert d4.gpu_id == 3 and d4.newly_dedicated


def test_dedicated_request_no_capacity_when_no_empty_gpu():
    f = Fleet([gpu(1, instances=[(P1G, 6, 2)])])
    nc = f.place(req(P1G, tenant=5, dedicated=True))
    assert isinstance(nc, NoCapacity) and nc.dedicated
    assert "dedicated to tenant 5" in nc.reason and "no empty shared GPU" in nc.reason


def test_dedication_ends_when_empty_unless_sticky():
    f = Fleet([gpu(1), gpu(2, dedicated=9, sticky=True)])
    d = f.place(req(P1G, tenant=5, dedicated=True))
    assert d.gpu_id == 1  # GPU 2 belongs to tenant 9 (sticky, empty)
    r = f.release(1, d.start)
    assert r.dedication_ended and f.dedicated_tenant(1) is None
    assert f.place(req(P1G, tenant=9, dedicated=True)).gpu_id == 2
    r = f.release(2, f.instances(2)[0].start)
    assert not r.dedication_ended and f.dedicated_tenant(2) == 9
    assert f.place(req(P1G, tenant=4)).gpu_id == 1
    f.dedicate(2, None)
    assert f.dedicated_tenant(2) is None
    f.check_invariants()


def test_non_dedicated_request_may_use_own_dedicated_gpu():
    f = Fleet([gpu(1, dedicated=4, sticky=True, instances=[(P3G, 4, 4)]), gpu(2)])
    d = f.place(req(P4G, tenant=4))
    assert d.gpu_id == 1 and d.dedicated


def test_first_fit_baseline():
    f = Fleet([gpu(3), gpu(1), gpu(2)], policy=FIRST_FIT)
    d = f.place(req(P1G))
    assert (d.gpu_id, d.start) == (1, 0)
    assert f.place(req(P3G)).gpu_id == 1 and f.instances(1)[-1].start == 4
    assert "first fit" in d.reason
    with pytest.raises(ValueError):
        Fleet(policy="random")


def test_release_and_state_api():
    f = Fleet([gpu(1, node=2)])
    d = f.place(req(P2G, tenant=3))
    assert f.compute_used(1) == 2 and f.free_starts(1, P2G) == tuple(s for s in (0, 2, 4) if s != d.start)
    r = f.release(1, d.start)
    assert r.instance == Instance(P2G, d.start, 3)
    assert f.free_mask(1) == 0xFF
    with pytest.raises(KeyError):
        f.release(1, d.start)
    snap = f.remove_gpu(1)
    assert snap.gpu_id == 1 and len(f) == 0 and 1 not in f


def test_choose_records_nothing():
    f = Fleet([gpu(1)])
    d = f.choose(req(P1G))
    assert d and f.used_mask(1) == 0
    f.record(1, d.profile_id, d.start, 1)
    assert f.used_mask(1) == 1 << d.start
    with pytest.raises(ValueError):
        f.record(1, P1G, d.start, 1)


def test_add_gpu_rejects_bad_states():
    f = Fleet()
    with pytest.raises(ValueError, match="invalid layout"):
        f.add_gpu(gpu(1, instances=[(P3G, 0, 1), (P4G, 0, 1)]))
    with pytest.raises(ValueError, match="dedicated"):
        f.add_gpu(gpu(2, dedicated=1, instances=[(P1G, 0, 2)]))
    f.add_gpu(gpu(3))
    with pytest.raises(ValueError, match="already"):
        f.add_gpu(gpu(3))


def test_fragmentation_and_utilization():
    f = Fleet([gpu(1), gpu(2)])
    assert f.fragmentation() == 0.0 and f.utilization() == 0.0
    f.place(req(P1G))  # @6 on GPU 1: slices 4, 5, 7 cannot host a 3g any more
    assert f.fragmentation() == pytest.approx(3 / 15)
    assert f.utilization() == pytest.approx(1 / 16)


def test_large_fleet_packs_small_slices_tightly():
    """10,000 GPUs: 2,000 1g slices fill GPUs one after another (best fit), never spread out.
    (Speed is measured in tests/bench/placement.py, not asserted here.)"""
    f = Fleet([gpu(i, node=i // 8) for i in range(10_000)])
    for _ in range(2000):
        assert f.place(req(P1G))
    used = [g for g in f.gpu_ids() if f.used_mask(g)]
    assert len(used) == -(-2000 // 7)  # ceil(2000 / 7) GPUs, all but one full


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------

GEOS = st.sampled_from([H100, H200])
REQUESTS = st.builds(
    lambda geo, pid, tenant, dedicated: Request(
        geo, tenant, profile_id=None if pid == "whole" else pid, whole_gpu=pid == "whole", dedicated=dedicated
    ),
    GEOS,
    st.sampled_from([*ALL_PIDS, P1G, P1G, P2G, "whole"]),
    st.integers(1, 3),
    st.booleans(),
)
OPS = st.lists(
    st.one_of(st.tuples(st.just("place"), REQUESTS), st.tuples(st.just("release"), st.integers(0, 10**6))), max_size=40
)


def test_free_places_follow_the_tenancy_rule():
    """Free places for a tenant: its own dedicated GPUs and the shared ones; a dedicated request only the empty
    shared ones; never another tenant's dedicated GPU."""
    f = Fleet([gpu(1), gpu(2, instances=[(P3G, 0, 3)]), gpu(3, dedicated=1, sticky=True),
               gpu(4, instances=[(P1G, 6, 2)], dedicated=2), gpu(5, geo=H200)])
    one_g = len(geometry(H100).profile_by_id(P1G).starts)  # 7 starts on an empty H100
    assert f.free_places(req(P1G)) == one_g + 3 + one_g  # GPUs 1, 2 (4 slices left: starts 4, 5, 6), 3
    assert f.free_places(req(P1G, dedicated=True)) == one_g + one_g  # GPU 3 and the empty shared GPU 1
    assert f.free_places(req(P1G, tenant=2)) == one_g + 3 + (one_g - 1)  # GPUs 1, 2 and its own GPU 4
    assert f.free_places(req(whole=True)) == 2  # the empty shared GPU 1 and its own empty GPU 3
    assert f.free_places(req(whole=True, tenant=3)) == 1  # GPU 1 only
    assert f.free_places(req(P1G, geo=H200)) == len(geometry(H200).profile_by_id(P1G).starts)
    with pytest.raises(ValueError):
        f.free_places(Request(H100, 1))


@st.composite
def fleets(draw):
    n = draw(st.integers(1, 4))
    states = []
    for i in range(n):
        geo = draw(GEOS)
        owner = draw(st.sampled_from([None, None, 2]))
        states.append(GpuState(i * 3 + 1, geo, i // 2, (), owner, dedication_sticky=owner is not None))
    return states


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states=fleets(), ops=OPS, policy=st.sampled_from([BEST_FIT, FIRST_FIT]))
def test_random_place_release_sequences(states, ops, policy):
    f = Fleet(states, policy=policy)
    live: list[tuple[int, int]] = []
    for op, arg in ops:
        if op == "release":
            if live:
                gpu_id, start = live.pop(arg % len(live))
                f.release(gpu_id, start)
        else:
            hosts = oracle_hosts(f, arg)
            assert f.free_places(arg) == len(hosts), arg  # the catalog's "free now": the same rule
            before = {s.gpu_id: s for s in f.states()}
            d = f.place(arg)
            if isinstance(d, NoCapacity):
                assert hosts == [], (arg, hosts, d.reason)  # completeness
            else:
                assert (d.gpu_id, d.start) in hosts, (arg, d)  # soundness, incl. tenancy
                assert str(d.gpu_id) in d.reason
                if arg.dedicated:
                    assert f.dedicated_tenant(d.gpu_id) == arg.tenant_id
                    assert d.newly_dedicated == (before[d.gpu_id].dedicated_tenant_id is None)
                live.append((d.gpu_id, d.start))
        for s in f.states():
            assert_layout_ok(s)
            assert valid_layout(s.geometry, [(i.profile_id, i.start) for i in s.instances])
        f.check_invariants()


@settings(max_examples=200, deadline=None)
@given(states=fleets(), ops=OPS)
def test_rebuilding_from_states_gives_the_same_fleet(states, ops):
    """What the Django side does: snapshot to plain states, rebuild, keep placing identically."""
    f = Fleet(states)
    live = []
    for op, arg in ops:
        if op == "release" and live:
            f.release(*live.pop(arg % len(live)))
        elif op == "place":
            d = f.place(arg)
            if d:
                live.append((d.gpu_id, d.start))
    g = Fleet(list(f.states()))
    g.check_invariants()
    assert list(g.states()) == list(f.states())
    for r in [Request(H100, 1, P1G), Request(H200, 2, P3G), Request(H100, 2, P2G, dedicated=True)]:
        assert f.choose(r) == g.choose(r)


@settings(max_examples=200, deadline=None)
@given(layout=st.lists(st.tuples(st.sampled_from(ALL_PIDS), st.integers(0, 7)), max_size=8))
def test_can_place_matches_the_oracle(layout):
    placed = []
    for pid, start in layout:
        if oracle_fits(H100, placed, pid, start):
            placed.append(Instance(pid, start, 1))
    f = Fleet([GpuState(1, H100, 0, placed)])
    for pid in ALL_PIDS:
        for start in range(8):
            assert f.can_place(1, pid, start) == oracle_fits(H100, placed, pid, start)
            assert valid_layout(H100, [(i.profile_id, i.start) for i in placed] + [(pid, start)]) == (
                oracle_fits(H100, placed, pid, start)
            )


# --------------------------------------------------------------------------------------------
# Cross-check with the pynvml simulator, when it is there
# --------------------------------------------------------------------------------------------

HAVE_SIM = importlib.util.find_spec("marketplace.hardware.nvml_sim") is not None

SIM_REQUESTS = st.builds(
    lambda geo, pid, tenant: Request(geo, tenant, profile_id=pid),
    GEOS,
    st.sampled_from([*ALL_PIDS, P1G, P1G, P1G2, P2G]),
    st.integers(1, 3),
)
SIM_FLEET = [H100, H200, H100]


@pytest.mark.skipif(not HAVE_SIM, reason="marketplace.hardware.nvml_sim is not there")
@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.one_of(st.tuples(st.just("place"), SIM_REQUESTS), st.tuples(st.just("release"), st.integers(0, 10**6))),
        max_size=30,
    ),
    policy=st.sampled_from([BEST_FIT, FIRST_FIT]),
)
def test_every_placement_is_accepted_by_the_nvml_simulator(ops, policy):
    """Each decision is created with nvmlDeviceCreateGpuInstanceWithPlacement on the simulator and
    must succeed; each release is a GI destroy; a NoCapacity means the simulator's remaining
    capacity for that profile is 0 on every GPU of the model; the layouts stay identical."""
    import pynvml

    from marketplace.hardware.nvml_sim import SimNvml

    nv = SimNvml(fleet=SIM_FLEET)
    nv.nvmlInit()
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(len(SIM_FLEET))]
        f = Fleet([GpuState(i, geo, 0) for i, geo in enumerate(SIM_FLEET)], policy=policy)
        gis: dict[tuple[int, int], object] = {}
        for op, arg in ops:
            if op == "release":
                if gis:
                    key = sorted(gis)[arg % len(gis)]
                    nv.nvmlGpuInstanceDestroy(gis.pop(key))
                    f.release(*key)
            else:
                d = f.place(arg)
                if d:
                    pl = pynvml.c_nvmlGpuInstancePlacement_t()
                    pl.start, pl.size = d.start, d.size
                    gis[(d.gpu_id, d.start)] = nv.nvmlDeviceCreateGpuInstanceWithPlacement(
                        handles[d.gpu_id], d.profile_id, pl
                    )
                else:
                    for i, geo in enumerate(SIM_FLEET):
                        if geo == arg.geometry:
                            assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(handles[i], arg.profile_id) == 0
            for i in range(len(SIM_FLEET)):
                sim = set()
                for p in geometry(SIM_FLEET[i]).profiles:
                    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handles[i], p.nvml_constant)
                    assert info.id == p.profile_id
                    count = ctypes.c_uint(0)
                    arr = (pynvml.c_nvmlGpuInstance_t * 8)()
                    nv.nvmlDeviceGetGpuInstances(handles[i], p.profile_id, arr, ctypes.byref(count))
                    for k in range(count.value):
                        gi = nv.nvmlGpuInstanceGetInfo(arr[k])
                        sim.add((gi.profileId, gi.placement.start))
                assert sim == {(x.profile_id, x.start) for x in f.instances(i)}
    finally:
        nv.nvmlShutdown()
