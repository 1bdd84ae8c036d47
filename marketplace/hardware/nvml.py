"""The one NVML entry point for the product: pick a backend, and do MIG work through pynvml names only.

``get_backend()`` returns the ``pynvml`` module or the simulator (``nvml_sim.module()``); both expose
the same functions, constants, structs and ``NVMLError_*`` classes. ``NvmlClient`` is written only
against pynvml names (no simulator extras), so it runs unchanged on a real H100/H200.

Errors: ``NVMLError`` subclasses propagate, except where a method documents otherwise:

* ``gpus()``: ``mig_current``/``mig_pending`` are None when the GPU has no MIG (NotSupported);
* ``profile_infos()``: profiles the GPU does not support (NotSupported) are skipped;
* ``create_slice()``: a GI that already exists with the same profile at the same start is adopted
  (its full-size CI created if missing) instead of failing; a CI failure on a new GI destroys
  that GI again before re-raising;
* ``destroy_slice()``: NotFound (already gone) returns False;
* ``telemetry()``: utilization is None when NVML says NotSupported (always, under MIG);
  MIG memory rows skip indices that are NotFound.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from marketplace.hardware import setting, setting_value
from marketplace.hardware.topology import GpuTopo, NodeTopology, cpus_of_mask

BACKEND_ENV = "TESSERA_NVML_BACKEND"
BACKENDS = ("sim", "pynvml")
MAX_GPU_INSTANCES = 8  # array size for GetGpuInstances (H100/H200 allow 7)



def get_backend(name: str | None = None) -> Any:
    """``"sim"`` (default) -> the process-wide simulator; ``"pynvml"`` -> the real pynvml module."""
    name = (name or setting(BACKEND_ENV) or "sim").strip().lower()
    if name == "pynvml":
        import pynvml

        return pynvml
    if name == "sim":
        from . import nvml_sim

        return nvml_sim.module(
            fleet=setting("TESSERA_NVML_SIM_FLEET"),
            state_path=setting("TESSERA_NVML_SIM_STATE"),
            node=setting("TESSERA_NVML_SIM_NODE"),
            mig_off=setting_value("TESSERA_NVML_SIM_MIG_OFF", []),
            create_latency_s=float(setting_value("TESSERA_NVML_SIM_CREATE_LATENCY_S", 0.0)),
        )
    raise ValueError(f"unknown NVML backend {name!r}; expected one of {BACKENDS}")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    mig_current: int | None  # None: the GPU has no MIG
    mig_pending: int | None
    memory_total: int  # bytes


@dataclass(frozen=True)
class ProfileInfo:
    constant: int  # NVML_GPU_INSTANCE_PROFILE_* asked for
    id: int  # profile id every later call takes (19/20/15/14/9/5/0)
    name: str
    slice_count: int
    instance_count: int
    multiprocessor_count: int
    memory_size_mb: int
    copy_engine_count: int
    decoder_count: int
    encoder_count: int
    jpeg_count: int
    ofa_count: int


@dataclass(frozen=True)
class SliceInfo:
    gi_id: int
    ci_id: int | None  # None: a GI without compute instance
    mig_uuid: str | None
    start: int
    size: int  # memory slices
    profile_id: int
    ci_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class MigMemory:
    gi_id: int
    ci_id: int
    uuid: str
    memory_used: int  # bytes
    memory_total: int


@dataclass(frozen=True)
class Telemetry:
    index: int
    uuid: str
    utilization_gpu: int | None  # percent; None when NotSupported (MIG on)
    utilization_memory: int | None
    memory_used: int  # bytes
    memory_total: int
    power_w: float
    energy_j: float
    temperature_c: int
    sm_clock_mhz: int
    power_limit_w: float
    mig: list[MigMemory] = field(default_factory=list)


class NvmlClient:
    """High-level MIG and telemetry operations over a pynvml-like backend.

    Call ``open()``/``close()`` (or use it as a context manager); ``nvmlInit`` is reference-counted.
    """

    def __init__(self, backend: Any = None) -> None:
        self.nv = backend if backend is not None else get_backend()

    def open(self) -> NvmlClient:
        self.nv.nvmlInit()
        return self

    def close(self) -> None:
        self.nv.nvmlShutdown()

    def __enter__(self) -> NvmlClient:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _h(self, index: int) -> Any:
        return self.nv.nvmlDeviceGetHandleByIndex(index)

    def _gi_profile_ids(self, h: Any) -> list[int]:
        ids = []
        for const in range(self.nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                ids.append(self.nv.nvmlDeviceGetGpuInstanceProfileInfo(h, const).id)
            except self.nv.NVMLError_NotSupported:
                continue
            except self.nv.NVMLError_InvalidArgument:
                break
        return ids

    def _gis(self, h: Any, profile_id: int) -> list[Any]:
        count = ctypes.c_uint(0)
        arr = (self.nv.c_nvmlGpuInstance_t * MAX_GPU_INSTANCES)()
        self.nv.nvmlDeviceGetGpuInstances(h, profile_id, arr, ctypes.byref(count))
        return [arr[i] for i in range(count.value)]

    def _ci_profiles(self, gi: Any) -> list[Any]:
        out = []
        for const in range(self.nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                out.append(
                    self.nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi, const, self.nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                    )
                )
            except (self.nv.NVMLError_NotSupported, self.nv.NVMLError_InvalidArgument):
                continue
        return out

    def _cis(self, gi: Any) -> list[Any]:
        out: list[Any] = []  # ctypes compute-instance handles
        for info in self._ci_profiles(gi):
            count = ctypes.c_uint(0)
            arr = (self.nv.c_nvmlComputeInstance_t * max(1, info.instanceCount))()
            self.nv.nvmlGpuInstanceGetComputeInstances(gi, info.id, arr, ctypes.byref(count))
            out.extend(arr[i] for i in range(count.value))
        return out

    def _mig_handles(self, h: Any) -> list[Any]:
        out = []
        for i in range(self.nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                out.append(self.nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i))
            except self.nv.NVMLError_NotFound:
                continue
        return out

    def _mig_uuids(self, h: Any) -> dict[tuple[int, int], str]:
        return {
            (self.nv.nvmlDeviceGetGpuInstanceId(m), self.nv.nvmlDeviceGetComputeInstanceId(m)): (
                self.nv.nvmlDeviceGetUUID(m)
            )
            for m in self._mig_handles(h)
        }

    def _slice(self, h: Any, gi: Any, uuids: dict | None = None) -> SliceInfo:
        gi_info = self.nv.nvmlGpuInstanceGetInfo(gi)
        ci_ids = tuple(sorted(self.nv.nvmlComputeInstanceGetInfo(ci).id for ci in self._cis(gi)))
        if uuids is None:
            uuids = self._mig_uuids(h)
        ci_id = ci_ids[0] if ci_ids else None
        return SliceInfo(
            gi_id=gi_info.id,
            ci_id=ci_id,
            mig_uuid=uuids.get((gi_info.id, ci_id)) if ci_id is not None else None,
            start=gi_info.placement.start,
            size=gi_info.placement.size,
            profile_id=gi_info.profileId,
            ci_ids=ci_ids,
        )

    # ------------------------------------------------------------------ reads

    def gpus(self) -> list[GpuInfo]:
        out = []
        for i in range(self.nv.nvmlDeviceGetCount()):
            h = self._h(i)
            try:
                cur, pend = self.nv.nvmlDeviceGetMigMode(h)
            except self.nv.NVMLError_NotSupported:
                cur = pend = None
            out.append(
                GpuInfo(
                    index=i,
                    uuid=self.nv.nvmlDeviceGetUUID(h),
                    name=self.nv.nvmlDeviceGetName(h),
                    mig_current=cur,
                    mig_pending=pend,
                    memory_total=self.nv.nvmlDeviceGetMemoryInfo(h).total,
                )
            )
        return out

    def topology(self, cpu_words: int = 8) -> NodeTopology:
        """The node's GPU topology as NVML reports it (pynvml names only; sources in topology.py): NVLink
        peers by ``nvmlDeviceGetP2PStatus(.., NVML_P2P_CAPS_INDEX_NVLINK)`` (GPUs that are peers of each other
        form one domain), the NUMA node by ``nvmlDeviceGetMemoryAffinity`` (scope NODE; its lowest set bit),
        the local CPUs by ``nvmlDeviceGetCpuAffinity`` (``cpu_words`` x 64 CPUs)."""
        nv = self.nv
        n = nv.nvmlDeviceGetCount()
        handles = [self._h(i) for i in range(n)]
        domain: list[int | None] = [None] * n
        next_domain = 0
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                try:
                    ok = nv.nvmlDeviceGetP2PStatus(handles[i], handles[j], nv.NVML_P2P_CAPS_INDEX_NVLINK)
                except nv.NVMLError_NotSupported:
                    ok = nv.NVML_P2P_STATUS_NOT_SUPPORTED
                if ok != nv.NVML_P2P_STATUS_OK:
                    continue
                if domain[i] is None and domain[j] is None:
                    domain[i] = domain[j] = next_domain
                    next_domain += 1
                elif domain[i] is None:
                    domain[i] = domain[j]
                elif domain[j] is None:
                    domain[j] = domain[i]
        gpus = []
        for i, h in enumerate(handles):
            try:
                nodes = cpus_of_mask(list(nv.nvmlDeviceGetMemoryAffinity(h, 1, nv.NVML_AFFINITY_SCOPE_NODE)))
            except nv.NVMLError_NotSupported:
                nodes = ()
            try:
                cpus = cpus_of_mask(list(nv.nvmlDeviceGetCpuAffinity(h, cpu_words)))
            except nv.NVMLError_NotSupported:
                cpus = ()
            gpus.append(GpuTopo(i, nodes[0] if nodes else 0, domain[i], cpus))
        return NodeTopology(tuple(gpus))

    def profile_infos(self, index: int) -> list[ProfileInfo]:
        h = self._h(index)
        out = []
        for const in range(self.nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                p = self.nv.nvmlDeviceGetGpuInstanceProfileInfo(h, const)
            except self.nv.NVMLError_NotSupported:
                continue
            except self.nv.NVMLError_InvalidArgument:
                break
            name = p.name.decode() if isinstance(p.name, bytes) else str(p.name)
            out.append(
                ProfileInfo(
                    constant=const,
                    id=p.id,
                    name=name.removeprefix("MIG "),
                    slice_count=p.sliceCount,
                    instance_count=p.instanceCount,
                    multiprocessor_count=p.multiprocessorCount,
                    memory_size_mb=p.memorySizeMB,
                    copy_engine_count=p.copyEngineCount,
                    decoder_count=p.decoderCount,
                    encoder_count=p.encoderCount,
                    jpeg_count=p.jpegCount,
                    ofa_count=p.ofaCount,
                )
            )
        return out

    def possible_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        """All (start, size) placements of the profile, in memory slices (two-step count/array call)."""
        h = self._h(index)
        count = ctypes.c_uint(0)
        self.nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
        arr = (self.nv.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
        self.nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
        return [(arr[i].start, arr[i].size) for i in range(count.value)]

    def slices(self, index: int) -> list[SliceInfo]:
        """Every GI on the GPU (with its CIs and the MIG UUID of its first CI), by GI id."""
        h = self._h(index)
        uuids = self._mig_uuids(h)
        out = [self._slice(h, gi, uuids) for pid in self._gi_profile_ids(h) for gi in self._gis(h, pid)]
        return sorted(out, key=lambda s: s.gi_id)

    # ------------------------------------------------------------------ writes

    def _find_gi(self, h: Any, profile_id: int, start: int) -> Any | None:
        for gi in self._gis(h, profile_id):
            if self.nv.nvmlGpuInstanceGetInfo(gi).placement.start == start:
                return gi
        return None

    def _ensure_full_ci(self, gi: Any) -> None:
        if self._cis(gi):
            return
        infos = self._ci_profiles(gi)
        if not infos:
            raise self.nv.NVMLError(self.nv.NVML_ERROR_NOT_SUPPORTED)
        # the full-size CI; among equal sizes the lowest constant (plain, not REV1)
        full = max(infos, key=lambda i: (i.sliceCount, -i.id))
        self.nv.nvmlGpuInstanceCreateComputeInstance(gi, full.id)

    def create_slice(self, index: int, profile_id: int, start: int) -> SliceInfo:
        """Create GI ``profile_id`` at ``start`` plus its full-size CI; return the slice.

        Idempotent: if a GI with this profile already sits at ``start``, it is adopted (and its CI
        created if missing) instead of failing with InsufficientResources. Any other conflict
        (overlap with a different GI, bad start) raises the NVMLError as NVML reports it."""
        h = self._h(index)
        gi = self._find_gi(h, profile_id, start)
        created = False
        if gi is None:
            sizes = {s for st, s in self.possible_placements(index, profile_id) if st == start} or {
                s for _st, s in self.possible_placements(index, profile_id)
            }
            placement = self.nv.c_nvmlGpuInstancePlacement_t(start, next(iter(sizes), 0))
            try:
                gi = self.nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(placement))
                created = True
            except self.nv.NVMLError_InsufficientResources:
                gi = self._find_gi(h, profile_id, start)  # lost a race with another creator?
                if gi is None:
                    raise
        try:
            self._ensure_full_ci(gi)
        except self.nv.NVMLError:
            if created:
                self.nv.nvmlGpuInstanceDestroy(gi)
            raise
        return self._slice(h, gi)

    def destroy_slice(self, index: int, gi_id: int) -> bool:
        """Destroy the GI's compute instances, then the GI. False if it was already gone (NotFound)."""
        h = self._h(index)
        try:
            gi = self.nv.nvmlDeviceGetGpuInstanceById(h, gi_id)
        except self.nv.NVMLError_NotFound:
            return False
        for ci in self._cis(gi):
            try:
                self.nv.nvmlComputeInstanceDestroy(ci)
            except self.nv.NVMLError_NotFound:
                pass
        try:
            self.nv.nvmlGpuInstanceDestroy(gi)
        except self.nv.NVMLError_NotFound:
            return False
        return True

    # ------------------------------------------------------------------ devices

    def device_nodes(self, index: int, gi_id: int | None = None, ci_id: int | None = None,
                     proc: str = "/proc/driver/nvidia/capabilities") -> list[str]:
        """The device nodes a process needs to use GPU ``index`` (or one MIG slice of it): the control and UVM
        nodes, ``/dev/nvidia<minor>`` and, for a slice, the capability nodes of its GPU and compute instances,
        whose minors the driver gives in ``<proc>/gpu<minor>/mig/gi<gi>/access`` and ``.../ci<ci>/access``
        (``DeviceFileMinor: N`` -> ``/dev/nvidia-caps/nvidia-capN``; NVIDIA MIG User Guide, "Device Nodes and
        Capabilities"). A capability file that is not there (no driver here) is skipped."""
        minor = self.nv.nvmlDeviceGetMinorNumber(self._h(index))
        nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", f"/dev/nvidia{minor}"]
        if gi_id is not None:
            access = [f"{proc}/gpu{minor}/mig/gi{gi_id}/access"]
            if ci_id is not None:
                access.append(f"{proc}/gpu{minor}/mig/gi{gi_id}/ci{ci_id}/access")
            for path in access:
                cap = _device_file_minor(path)
                if cap is not None:
                    nodes.append(f"/dev/nvidia-caps/nvidia-cap{cap}")
        return nodes

    # ------------------------------------------------------------------ telemetry

    def telemetry(self, index: int) -> Telemetry:
        h = self._h(index)
        try:
            u = self.nv.nvmlDeviceGetUtilizationRates(h)
            util_gpu, util_mem = u.gpu, u.memory
        except self.nv.NVMLError_NotSupported:
            util_gpu = util_mem = None
        mem = self.nv.nvmlDeviceGetMemoryInfo(h)
        mig: list[MigMemory] = []
        try:
            mig_mode = self.nv.nvmlDeviceGetMigMode(h)[0]
        except self.nv.NVMLError_NotSupported:
            mig_mode = 0
        if mig_mode:
            for m in self._mig_handles(h):
                mm = self.nv.nvmlDeviceGetMemoryInfo(m)
                mig.append(
                    MigMemory(
                        gi_id=self.nv.nvmlDeviceGetGpuInstanceId(m),
                        ci_id=self.nv.nvmlDeviceGetComputeInstanceId(m),
                        uuid=self.nv.nvmlDeviceGetUUID(m),
                        memory_used=mm.used,
                        memory_total=mm.total,
                    )
                )
        return Telemetry(
            index=index,
            uuid=self.nv.nvmlDeviceGetUUID(h),
            utilization_gpu=util_gpu,
            utilization_memory=util_mem,
            memory_used=mem.used,
            memory_total=mem.total,
            power_w=self.nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            energy_j=self.nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0,
            temperature_c=self.nv.nvmlDeviceGetTemperature(h, self.nv.NVML_TEMPERATURE_GPU),
            sm_clock_mhz=self.nv.nvmlDeviceGetClockInfo(h, self.nv.NVML_CLOCK_SM),
            power_limit_w=self.nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            mig=mig,
        )


def _device_file_minor(path: str) -> int | None:
    """``DeviceFileMinor: N`` of an nvidia-capabilities access file, or None when it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "DeviceFileMinor":
                    return int(value.strip())
    except (OSError, ValueError):
        return None
    return None
