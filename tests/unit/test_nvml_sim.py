"""The NVML simulator against the MIG rules (gpu.md 1.6, 1.7, 2.5, 3.2) and NvmlClient on top of it.

Plain functions, no database: run with ``pytest tests/unit/test_nvml_sim.py -p no:django``.
"""

from __future__ import annotations

import ctypes
import re
from itertools import pairwise

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.hardware import nvml_sim
from marketplace.hardware.geometry import geometry
from marketplace.hardware.nvml import NvmlClient, get_backend
from marketplace.hardware.nvml_sim import SimNvml

H100, H200 = "h100-sxm-80gb", "h200-sxm-141gb"
EXPECTED = {  # NVML constant -> (profile id, H100 name, H200 name, memory slices, starts)
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, "1g.10gb", "1g.18gb", 1, [0, 1, 2, 3, 4, 5, 6]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, "1g.10gb+me", "1g.18gb+me", 1, [0, 1, 2, 3, 4, 5, 6]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, "1g.20gb", "1g.35gb", 2, [0, 2, 4, 6]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, "2g.20gb", "2g.35gb", 2, [0, 2, 4]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, "3g.40gb", "3g.71gb", 4, [0, 4]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, "4g.40gb", "4g.71gb", 4, [0]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, "7g.80gb", "7g.141gb", 8, [0]),
}
UUID_RE = r"[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def nv(tmp_path):
    sim = SimNvml(fleet=f"{H100}*2,{H200}*2", state_path=tmp_path / "state.json", mig_enabled={3: False})
    sim.nvmlInit()
    yield sim
    sim.nvmlShutdown()


def place(start: int, size: int):
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))


def create(nv, idx: int, profile_id: int, start: int, size: int | None = None):
    h = nv.nvmlDeviceGetHandleByIndex(idx)
    if size is None:
        size = geometry(nv.fleet[idx]).profile_by_id(profile_id).memory_slices
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, place(start, size))


def placements(nv, h, profile_id: int) -> list[tuple[int, int]]:
    count = ctypes.c_uint()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    assert nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count)) == 0
    return [(p.start, p.size) for p in arr[: count.value]]


def live_gis(nv, idx: int) -> list[tuple[int, int, int, int]]:
    """(gi id, profile id, start, size) of every GI, via pynvml calls only."""
    h = nv.nvmlDeviceGetHandleByIndex(idx)
    out = []
    for p in geometry(nv.fleet[idx]).profiles:
        arr = (pynvml.c_nvmlGpuInstance_t * 8)()
        count = ctypes.c_uint()
        nv.nvmlDeviceGetGpuInstances(h, p.profile_id, arr, ctypes.byref(count))
        for gi in arr[: count.value]:
            info = nv.nvmlGpuInstanceGetInfo(gi)
            out.append((info.id, info.profileId, info.placement.start, info.placement.size))
    return sorted(out)


# ----------------------------------------------------------------------------- profiles


@pytest.mark.parametrize("idx,model", [(0, H100), (2, H200)])
def test_profile_constants_map_to_real_ids(nv, idx, model):
    h = nv.nvmlDeviceGetHandleByIndex(idx)
    geo = geometry(model)
    for const, (pid, n100, n200, mem_slices, _starts) in EXPECTED.items():
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, const)
        assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
        assert info.version == pynvml.nvmlGpuInstanceProfileInfo_v2
        assert info.id == pid
        name = n100 if model == H100 else n200
        assert info.name == f"MIG {name}"
        p = geo.profile_by_id(pid)
        assert (info.sliceCount, info.instanceCount, info.memorySizeMB) == (
            p.compute_slices,
            p.max_count,
            p.memory_mib,
        )
        assert p.memory_slices == mem_slices
        v1 = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, const, version=1)
        assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t) and v1.id == pid
        assert nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, pid).id == pid


def test_catalog_engine_counts_match_mig_guide():
    for model in (H100, H200):
        geo = geometry(model)
        got = [(p.decoders, p.jpegs, p.ofas, p.copy_engines) for p in geo.profiles]
        assert got == [(1, 1, 0, 1), (1, 1, 1, 1), (1, 1, 0, 1), (2, 2, 0, 2), (3, 3, 0, 3), (4, 4, 0, 4), (7, 7, 1, 8)]
        assert [p.sm_count for p in geo.profiles] == [16, 16, 26, 32, 60, 64, 132]


def test_invalid_and_unsupported_constants(nv):
    h = nv.nvmlDeviceGetHandleByIndex(0)
    for const in (pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE, 0x8, 0xA, 0x11):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nv.nvmlDeviceGetGpuInstanceProfileInfo(h, const)
    for const in (pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT, 0x40, -1):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nv.nvmlDeviceGetGpuInstanceProfileInfo(h, const)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h, 0, version=3)


@pytest.mark.parametrize("idx", [0, 2])
def test_possible_placements_equal_catalog_starts(nv, idx):
    h = nv.nvmlDeviceGetHandleByIndex(idx)
    for const, (pid, _a, _b, size, starts) in EXPECTED.items():
        assert placements(nv, h, pid) == [(s, size) for s in starts]
        assert geometry(nv.fleet[idx]).profile_by_constant(const).starts == tuple(starts)
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 1)()  # +me has 7 placements, instanceCount 1
    count = ctypes.c_uint()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, 20, small, ctypes.byref(count))
    assert count.value == 7


# ----------------------------------------------------------------------------- create / destroy


def test_create_with_valid_placement_and_info(nv):
    gi = create(nv, 0, 9, 4)
    assert isinstance(gi, pynvml.c_nvmlGpuInstance_t)
    info = nv.nvmlGpuInstanceGetInfo(gi)
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (2, 9, 4, 4)
    assert nv.nvmlDeviceGetGpuInstanceById(nv.nvmlDeviceGetHandleByIndex(0), 2) is not None
    # the struct itself (not byref) is accepted too
    gi2 = nv.nvmlDeviceCreateGpuInstanceWithPlacement(
        nv.nvmlDeviceGetHandleByIndex(0), 19, pynvml.c_nvmlGpuInstancePlacement_t(0, 1)
    )
    assert nv.nvmlGpuInstanceGetInfo(gi2).id == 7  # 1g at start s -> GI 7 + s


@pytest.mark.parametrize(
    "profile_id,start,size",
    [(9, 2, 4), (9, 4, 3), (14, 6, 2), (14, 1, 2), (19, 7, 1), (0, 0, 7), (5, 4, 4), (15, 1, 2)],
)
def test_create_with_invalid_placement(nv, profile_id, start, size):
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        create(nv, 0, profile_id, start, size)
    assert live_gis(nv, 0) == []


def test_unknown_profile_id_and_stale_handles(nv):
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        create(nv, 0, 3, 0, 1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(4)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetName(pynvml.c_nvmlDevice_t())
    gi = create(nv, 0, 19, 3)
    nv.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetInfo(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceDestroy(gi)


def test_overlap_is_insufficient_resources(nv):
    create(nv, 0, 14, 2)  # 2g at 2:2
    for pid, start in [(19, 2), (19, 3), (15, 2), (9, 0), (5, 0), (0, 0), (14, 2)]:
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            create(nv, 0, pid, start)
    create(nv, 0, 19, 1)
    create(nv, 0, 9, 4)


def test_media_extension_profile_max_one(nv):
    create(nv, 0, 20, 0)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(nv, 0, 20, 3)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 20) == 0
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 6


def test_two_3g_fill_the_gpu(nv):
    create(nv, 0, 9, 0)
    create(nv, 0, 9, 4)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    for p in geometry(H100).profiles:
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.profile_id) == 0
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            nv.nvmlDeviceCreateGpuInstance(h, p.profile_id)
    assert [g[0] for g in live_gis(nv, 0)] == [1, 2]


def test_7g_excludes_everything(nv):
    create(nv, 2, 0, 0)
    h = nv.nvmlDeviceGetHandleByIndex(2)
    for p in geometry(H200).profiles:
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.profile_id) == 0
        for s in p.starts:
            with pytest.raises(pynvml.NVMLError_InsufficientResources):
                create(nv, 2, p.profile_id, s)
    assert live_gis(nv, 2) == [(0, 0, 0, 8)]


def test_mig_off_is_not_supported(nv):
    h = nv.nvmlDeviceGetHandleByIndex(3)
    assert nv.nvmlDeviceGetMigMode(h) == [0, 0]
    for call in (
        lambda: nv.nvmlDeviceGetGpuInstanceProfileInfo(h, 0),
        lambda: nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(0, 1)),
        lambda: nv.nvmlDeviceCreateGpuInstance(h, 19),
        lambda: nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19),
        lambda: nv.nvmlDeviceGetGpuInstances(h, 19, None, ctypes.byref(ctypes.c_uint())),
        lambda: nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    assert placements(nv, h, 9) == [(0, 4), (4, 4)]  # documented to work regardless of MIG mode
    util = nv.nvmlDeviceGetUtilizationRates(h)
    assert isinstance(util, pynvml.c_nvmlUtilization_t) and util.gpu == 0
    assert nv.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    create(nv, 3, 19, 0)


def test_auto_placement_follows_documented_order(nv):
    h = nv.nvmlDeviceGetHandleByIndex(0)
    starts = [nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(h, 19)).placement.start for _ in range(7)]
    assert starts == [6, 4, 5, 0, 1, 2, 3]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstance(h, 19)
    h1 = nv.nvmlDeviceGetHandleByIndex(1)
    for pid in (19, 19, 14):
        nv.nvmlDeviceCreateGpuInstance(h1, pid)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstance(h1, 9)  # the MIG guide's "3g last" failure
    assert [(g[2], g[3]) for g in live_gis(nv, 1)] == [(0, 2), (4, 1), (6, 1)]


def test_gi_destroy_with_ci_is_in_use_then_recreate(nv):
    gi = create(nv, 0, 14, 0)
    ci_info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    assert isinstance(ci_info, pynvml.c_nvmlComputeInstanceProfileInfo_v2_t)
    assert (ci_info.id, ci_info.sliceCount, ci_info.multiprocessorCount) == (1, 2, 32)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0)
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    cinfo = nv.nvmlComputeInstanceGetInfo(ci)
    assert (cinfo.id, cinfo.profileId, cinfo.placement.start, cinfo.placement.size) == (0, 1, 0, 2)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlGpuInstanceDestroy(gi)
    nv.set_compute_instance_in_use(0, 3, 0, True)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(ci)
    nv.set_compute_instance_in_use(0, 3, 0, False)
    assert nv.nvmlComputeInstanceDestroy(ci) == pynvml.NVML_SUCCESS
    assert nv.nvmlGpuInstanceDestroy(gi) == pynvml.NVML_SUCCESS
    assert live_gis(nv, 0) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetGpuInstanceById(nv.nvmlDeviceGetHandleByIndex(0), 3)
    gi2 = create(nv, 0, 14, 0)
    assert nv.nvmlGpuInstanceGetInfo(gi2).id == 3


def test_mig_device_handles_and_uuids(nv):
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi3 = create(nv, 0, 9, 0)
    for _ in range(3):
        nv.nvmlGpuInstanceCreateComputeInstance(gi3, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    gi1g = create(nv, 0, 19, 6)
    nv.nvmlGpuInstanceCreateComputeInstance(gi1g, 0)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    found = []
    for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except pynvml.NVMLError_NotFound:
            continue
        assert isinstance(m, pynvml.c_nvmlDevice_t)
        assert nv.nvmlDeviceIsMigDeviceHandle(m).value == 1
        parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        assert nv.nvmlDeviceGetUUID(parent) == nv.nvmlDeviceGetUUID(h)
        uid = nv.nvmlDeviceGetUUID(m)
        assert re.fullmatch("MIG-" + UUID_RE, uid)
        assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(uid)) == uid
        found.append((nv.nvmlDeviceGetGpuInstanceId(m), nv.nvmlDeviceGetComputeInstanceId(m), nv.nvmlDeviceGetName(m)))
    assert found == [
        (1, 0, "NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"),
        (1, 1, "NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"),
        (1, 2, "NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"),
        (13, 0, "NVIDIA H100 80GB HBM3 MIG 1g.10gb"),
    ]
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 4)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 7)
    assert nv.nvmlDeviceIsMigDeviceHandle(h).value == 0
    assert re.fullmatch("GPU-" + UUID_RE, nv.nvmlDeviceGetUUID(h))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceId(h)


def test_deterministic_gpu_uuids(tmp_path):
    a = SimNvml(fleet=f"{H100}*2", node="n1")
    b = SimNvml(fleet=f"{H100}*2", node="n1", state_path=tmp_path / "s.json")
    c = SimNvml(fleet=f"{H100}*2", node="n2")
    for s in (a, b, c):
        s.nvmlInit()
    ua = [a.nvmlDeviceGetUUID(a.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    assert ua == [b.nvmlDeviceGetUUID(b.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    assert ua[0] != ua[1]
    assert ua[0] != c.nvmlDeviceGetUUID(c.nvmlDeviceGetHandleByIndex(0))


# ----------------------------------------------------------------------------- telemetry


def test_utilization_not_supported_under_mig_and_parent_only_telemetry(nv):
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetUtilizationRates(h)
    gi = create(nv, 0, 19, 0)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetUtilizationRates(m)
    for call in (nv.nvmlDeviceGetPowerUsage, nv.nvmlDeviceGetTotalEnergyConsumption):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(m)
    mem = nv.nvmlDeviceGetMemoryInfo(m)
    assert isinstance(mem, pynvml.c_nvmlMemory_t) and mem.total == 9984 * 1024 * 1024
    assert nv.nvmlDeviceGetMemoryInfo(h).total == 81559 * 1024 * 1024
    assert nv.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000


def test_energy_monotonic_and_power_follows_load(tmp_path):
    clock = FakeClock()
    nv = SimNvml(fleet=H100, state_path=tmp_path / "s.json", clock=clock)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    idle_mw = nv.nvmlDeviceGetPowerUsage(h)
    assert 60_000 <= idle_mw <= 100_000
    gi = create(nv, 0, 0, 0)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE)
    readings = [nv.nvmlDeviceGetTotalEnergyConsumption(h)]
    temps = [nv.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)]
    for step, util in enumerate([0.0, 1.0, 1.0, 0.5, 0.0, 0.9]):
        nv.set_activity(0, 0, util)
        clock.t += 30 + step
        readings.append(nv.nvmlDeviceGetTotalEnergyConsumption(h))
        temps.append(nv.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
    assert all(b > a for a, b in pairwise(readings))
    nv.set_activity(0, 0, 1.0)
    busy_mw = nv.nvmlDeviceGetPowerUsage(h)
    assert idle_mw < busy_mw <= 700_000
    before = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    clock.t += 10
    assert nv.nvmlDeviceGetTotalEnergyConsumption(h) - before == pytest.approx(busy_mw * 10, rel=1e-3)
    assert max(temps) > temps[0]
    assert nv.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) > 1000
    m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nv.nvmlDeviceGetMemoryInfo(m).used > 0
    clock.t -= 100  # a clock going backwards never makes the counter go down
    assert nv.nvmlDeviceGetTotalEnergyConsumption(h) >= before


def test_uninitialized_before_init_and_after_shutdown():
    nv = SimNvml(fleet=H100)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    nv.nvmlInit()
    nv.nvmlShutdown()
    assert nv.nvmlDeviceGetCount() == 1
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlShutdown()


def test_constants_and_missing_functions_fall_through():
    nv = SimNvml(fleet=H100)
    assert nv.NVML_GPU_INSTANCE_PROFILE_3_SLICE == 2
    assert nv.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    assert nv.NVMLError_InUse is pynvml.NVMLError_InUse
    nv.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetFanSpeed(nv.nvmlDeviceGetHandleByIndex(0))


# ----------------------------------------------------------------------------- persistence


def test_state_persists_across_instances(tmp_path):
    path = tmp_path / "gpu-state.json"
    a = SimNvml(fleet=f"{H100}*2", state_path=path)
    a.nvmlInit()
    gi = create(a, 1, 14, 2)
    a.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    uuid_a = a.nvmlDeviceGetUUID(a.nvmlDeviceGetMigDeviceHandleByIndex(a.nvmlDeviceGetHandleByIndex(1), 0))

    b = SimNvml(fleet=f"{H100}*2", state_path=path)  # a second process / a restarted worker
    b.nvmlInit()
    assert live_gis(b, 1) == [(4, 14, 2, 2)]
    hb = b.nvmlDeviceGetHandleByIndex(1)
    assert b.nvmlDeviceGetUUID(b.nvmlDeviceGetMigDeviceHandleByIndex(hb, 0)) == uuid_a
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(b, 1, 9, 0)
    create(b, 1, 19, 0)  # b's change is seen by a on its next call
    assert [g[0] for g in live_gis(a, 1)] == [4, 7]
    # a different fleet on the same file is different hardware: state starts over
    c = SimNvml(fleet=f"{H200}*2", state_path=path)
    c.nvmlInit()
    assert live_gis(c, 1) == []


# ----------------------------------------------------------------------------- NvmlClient


def test_client_round_trip_and_idempotent_create(nv):
    client = NvmlClient(nv)
    with client:
        gpus = client.gpus()
        assert [g.name for g in gpus] == ["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA H200"] * 2
        assert [(g.mig_current, g.mig_pending) for g in gpus] == [(1, 1)] * 3 + [(0, 0)]
        assert gpus[2].memory_total == 143771 * 1024 * 1024
        infos = client.profile_infos(2)
        assert [(p.constant, p.id, p.name) for p in infos] == [
            (0, 19, "1g.18gb"),
            (1, 14, "2g.35gb"),
            (2, 9, "3g.71gb"),
            (3, 5, "4g.71gb"),
            (4, 0, "7g.141gb"),
            (7, 20, "1g.18gb+me"),
            (9, 15, "1g.35gb"),
        ]
        assert client.possible_placements(0, 15) == [(0, 2), (2, 2), (4, 2), (6, 2)]

        s = client.create_slice(0, 9, 4)
        assert (s.gi_id, s.ci_id, s.start, s.size, s.profile_id) == (2, 0, 4, 4, 9)
        assert re.fullmatch("MIG-" + UUID_RE, s.mig_uuid)
        assert client.create_slice(0, 9, 4) == s  # idempotent
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            client.create_slice(0, 14, 4)  # a different profile overlapping is still an error
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            client.create_slice(0, 9, 2)
        t = client.create_slice(0, 19, 0)
        assert [x.gi_id for x in client.slices(0)] == [2, 7]
        assert client.slices(0)[1] == t

        # a GI left without CI (crash between the two steps) is adopted and completed
        h = nv.nvmlDeviceGetHandleByIndex(0)
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, place(2, 2))
        half = client.create_slice(0, 14, 2)
        assert half.ci_id == 0 and half.mig_uuid

        tel = client.telemetry(0)
        assert tel.utilization_gpu is None and tel.utilization_memory is None
        assert tel.power_w > 50 and tel.energy_j >= 0 and tel.temperature_c > 0
        assert tel.power_limit_w == 700
        assert sorted((m.gi_id, m.ci_id) for m in tel.mig) == [(2, 0), (4, 0), (7, 0)]
        assert client.telemetry(3).utilization_gpu == 0

        assert client.destroy_slice(0, 2) is True
        assert client.destroy_slice(0, 2) is False  # already gone
        assert [x.gi_id for x in client.slices(0)] == [4, 7]
        for x in client.slices(0):
            client.destroy_slice(0, x.gi_id)
        assert client.slices(0) == []


def test_create_latency_comes_from_the_argument_not_the_environment(monkeypatch, tmp_path):
    slept: list[float] = []
    monkeypatch.setattr(nvml_sim.time, "sleep", slept.append)
    monkeypatch.setenv("TESSERA_NVML_SIM_CREATE_LATENCY_S", "30")  # not read: settings pass it in
    for latency in (0.0, 2.5):
        sim = SimNvml(fleet=H100, state_path=tmp_path / f"{latency}.json", create_latency_s=latency)
        sim.nvmlInit()
        create(sim, 0, 19, 0)
    assert slept == [2.5]


def test_get_backend_selection(request, tmp_path):
    dj = request.getfixturevalue("settings")  # pytest-django's (``settings`` here is hypothesis')
    # the TESSERA_NVML_* settings (parsed from the environment in marketplace.settings) configure the simulator
    dj.TESSERA_NVML_BACKEND = ""
    dj.TESSERA_NVML_SIM_FLEET = f"{H200}*3"
    dj.TESSERA_NVML_SIM_STATE = str(tmp_path / "env-state.json")
    dj.TESSERA_NVML_SIM_MIG_OFF = [1]
    dj.TESSERA_NVML_SIM_CREATE_LATENCY_S = 0.0
    nv = get_backend()
    assert isinstance(nv, SimNvml) and nv.fleet == [H200] * 3
    assert get_backend("sim") is nv is nvml_sim.module(fleet=f"{H200}*3", state_path=tmp_path / "env-state.json",
                                                        mig_off=[1])
    assert nv._mig_default == [1, 0, 1]
    assert get_backend("pynvml") is pynvml
    dj.TESSERA_NVML_BACKEND = "pynvml"
    assert get_backend() is pynvml
    with pytest.raises(ValueError):
        get_backend("cuda")


# ----------------------------------------------------------------------------- property test


def allowed(geo, gis: list[tuple[int, int]], profile_id: int, start: int, size: int) -> bool:
    """gpu.md 1.6 rules: start in list, right size, no overlap, instance count."""
    p = geo.profile_by_id(profile_id)
    if start not in p.starts or size != p.memory_slices:
        return False
    used = set()
    for pid, s in gis:
        used |= set(geo.profile_by_id(pid).slots(s))
    if used & set(p.slots(start)):
        return False
    return sum(1 for pid, _ in gis if pid == profile_id) < p.max_count


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("create"),
            st.sampled_from([19, 20, 15, 14, 9, 5, 0]),
            st.integers(0, 7),
            st.sampled_from([None, None, None, 1, 2, 4, 8]),
        ),
        st.tuples(st.just("destroy"), st.integers(0, 14), st.just(0), st.just(None)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from([H100, H200]), seq=ops)
def test_random_create_destroy_matches_geometry_rules(model, seq):
    geo = geometry(model)
    nv = SimNvml(fleet=model)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    model_gis: dict[int, tuple[int, int]] = {}  # gi id -> (profile id, start)
    for op, a, b, c in seq:
        if op == "create":
            size = geo.profile_by_id(a).memory_slices if c is None else c
            ok = allowed(geo, list(model_gis.values()), a, b, size)
            try:
                gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, a, place(b, size))
            except (pynvml.NVMLError_InvalidArgument, pynvml.NVMLError_InsufficientResources):
                assert not ok
                continue
            assert ok
            info = nv.nvmlGpuInstanceGetInfo(gi)
            model_gis[info.id] = (a, b)
        else:
            try:
                gi = nv.nvmlDeviceGetGpuInstanceById(h, a)
            except pynvml.NVMLError_NotFound:
                assert a not in model_gis
                continue
            nv.nvmlGpuInstanceDestroy(gi)
            del model_gis[a]
        slots: list[int] = []
        for _gid, _pid, s, sz in live_gis(nv, 0):
            slots.extend(range(s, s + sz))
        assert len(slots) == len(set(slots)), "overlapping GPU instances"
        assert sorted((g, p, s) for g, (p, s) in model_gis.items()) == [(g, p, s) for g, p, s, _ in live_gis(nv, 0)]


def test_device_nodes_of_a_gpu_and_of_a_mig_slice(nv, tmp_path):
    """/dev/nvidia<minor> (minor from nvmlDeviceGetMinorNumber), the control and UVM nodes and, for a slice,
    the capability nodes whose minors the driver gives in its access files (NVIDIA MIG User Guide, "Device
    Nodes and Capabilities")."""
    client = NvmlClient(nv)
    assert nv.nvmlDeviceGetMinorNumber(nv.nvmlDeviceGetHandleByIndex(2)) == 2
    whole = client.device_nodes(2, proc=str(tmp_path))
    assert whole == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia2"]
    gi = tmp_path / "gpu1" / "mig" / "gi5"
    (gi / "ci0").mkdir(parents=True)
    (gi / "access").write_text("DeviceFileMinor: 48\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    (gi / "ci0" / "access").write_text("DeviceFileMinor: 49\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    nodes = client.device_nodes(1, gi_id=5, ci_id=0, proc=str(tmp_path))
    assert nodes[3:] == ["/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap48", "/dev/nvidia-caps/nvidia-cap49"]
    assert client.device_nodes(1, gi_id=6, ci_id=0, proc=str(tmp_path))[3:] == ["/dev/nvidia1"]  # unreadable
