"""An in-process simulator of the pynvml calls Tessera makes (pure Python, no Django).

``SimNvml`` has the same function names, argument orders, return shapes and error classes as
``pynvml`` (nvidia-ml-py 13.615.71), so code written as ``nv = backend(); nv.nvmlInit()`` cannot tell
it from ``import pynvml as nv``. Constants and ctypes struct classes are pynvml's own (attribute
access falls through to the real module); pynvml functions the simulator does not implement raise
``NVMLError_FunctionNotFound``, as a driver lacking the symbol would.

Rules simulated (sources: NVIDIA's MIG User Guide, https://docs.nvidia.com/datacenter/tesla/mig-user-guide/ ,
for profiles, placements and GI numbering; the NVML API reference and nvml.h comments,
https://docs.nvidia.com/deploy/nvml-api/ , for calls, return codes and what MIG device handles support;
``nvidia-smi mig -lgip`` / ``-lgipp`` captures on H100 and H200 boards for profile ids and placements):

* profile info is asked for with ``NVML_GPU_INSTANCE_PROFILE_*`` constants and returns the real
  profile id (19/20/15/14/9/5/0); every later call takes that id;
* a GI placement is (start, size) in memory slices; start must be in the profile's list, size must
  be the profile's memory-slice count (else InvalidArgument); overlap or a profile's instance
  limit gives InsufficientResources;
* GI ids follow the binary-tree numbering (0 whole, 1-2 halves, 3-6 quarters, 7-14 eighths);
  CI ids start at 0 inside each GI;
* automatic placement picks the free placement that blocks the fewest still-possible placements
  of other profiles, lowest start on a tie (reproduces the MIG guide's examples);
* GI destroy while CIs exist -> InUse; CI destroy while marked in use -> InUse;
* MIG calls on a GPU whose current MIG mode is 0 -> NotSupported (possible placements excepted,
  as nvml.h documents);
* ``nvmlDeviceGetUtilizationRates`` -> NotSupported while MIG is on; power, temperature, clocks
  and energy are parent-only (NotSupported on MIG device handles); memory info works on both;
* every function except ``nvmlInit`` raises Uninitialized before ``nvmlInit``.

Handles are real pynvml ctypes pointer types (``c_nvmlDevice_t``, ``c_nvmlGpuInstance_t``,
``c_nvmlComputeInstance_t``) whose address encodes (kind, GPU index, serial). A GI/CI handle whose
instance was destroyed is stale and gives InvalidArgument, as on a real GPU.

State (MIG mode, GIs, CIs, energy counters, simulated load) lives in a JSON file when a state path
is given (constructor; setting ``TESSERA_NVML_SIM_STATE``): written atomically (temp file +
``os.replace``) under an ``fcntl`` lock, and re-read whenever the file changed, so two processes
or a restarted worker see the same GPU state, as a real GPU keeps its instances. Without a path the
state is in memory only. If the stored fleet (models and node name) differs from the configured
one, the stored state is discarded: it is different hardware.

Fleet spec: ``"h100-sxm-80gb*4,h200-sxm-141gb*4"`` (default eight H100), node name (default ``sim-node``),
GPUs with MIG off (``mig_off`` indices or the ``mig_enabled`` argument): constructor arguments, which
``nvml.get_backend`` takes from the settings ``TESSERA_NVML_SIM_FLEET``, ``TESSERA_NVML_SIM_NODE`` and
``TESSERA_NVML_SIM_MIG_OFF``. The simulator itself reads no environment variable.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pynvml as _pynvml

from .geometry import CiProfile, GpuGeometry, Profile, geometry
from .topology import NVLINKS_PER_GPU, NodeTopology, cpu_mask, hgx_8gpu, pcie_server

DEFAULT_FLEET = "h100-sxm-80gb*8"
DEFAULT_NODE = "sim-node"
MIB = 1024 * 1024
STATE_VERSION = 1
DRIVER_VERSION = "570.133.20-sim"
NVML_VERSION = "12.570.133.20-sim"
CUDA_DRIVER_VERSION = 12080
TEMP_TAU_S = 90.0  # thermal time constant of the simulated heatsink
UUID_NAMESPACE = uuid.UUID("5b0f1f8e-6a43-4c1e-9d38-7e55e7a0c0de")

_KIND_GPU, _KIND_MIG, _KIND_GI, _KIND_CI = 1, 2, 3, 4
_HANDLE_MAGIC = 0x7E55

NVMLError = _pynvml.NVMLError


def _err(code: int) -> _pynvml.NVMLError:
    return _pynvml.NVMLError(code)


def parse_fleet(spec: str | Iterable[str] | None) -> list[str]:
    """``"h100-sxm-80gb*4,h200-sxm-141gb*2"`` or a list of keys -> list of geometry keys (validated)."""
    if spec is None:
        spec = DEFAULT_FLEET
    if isinstance(spec, str):
        items: list[str] = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            key, _, n = part.partition("*")
            items.extend([key.strip()] * (int(n) if n else 1))
    else:
        items = list(spec)
    for key in items:
        geometry(key)  # KeyError for an unknown model
    return items


def gi_id_for(start: int, size: int) -> int:
    """Binary-tree GI numbering of the 8 memory slices: 0 whole, 1-2 halves, 3-6 quarters, 7-14 eighths."""
    return {8: 0, 4: 1, 2: 3, 1: 7}[size] + start // size


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


# --------------------------------------------------------------------------------------------
# ctypes helpers: pynvml passes byref(...) objects, pointers, or arrays straight through.
# --------------------------------------------------------------------------------------------


def _deref(ref: Any) -> Any:
    """The ctypes object behind byref(x) / pointer(x) / x."""
    if ref is None:
        return None
    obj = getattr(ref, "_obj", None)  # CArgObject from byref()
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def _capacity(array_ref: Any, count_obj: Any) -> int:
    arr = _deref(array_ref)
    try:
        n = len(arr)
    except TypeError:
        n = 1
    given = getattr(count_obj, "value", 0) or 0
    return min(n, given) if given else n


def _fill_placements(placementsRef: Any, countRef: Any, starts: Iterable[int], size: int) -> int:
    """pynvml's placement-array convention: ``placementsRef=None`` writes only the count; an array
    smaller than the count (its length, or a smaller non-zero count passed in) -> InsufficientSize."""
    count = _deref(countRef)
    if count is None:
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
    starts = list(starts)
    n = len(starts)
    if placementsRef is None:
        count.value = n
        return _pynvml.NVML_SUCCESS
    if _capacity(placementsRef, count) < n:
        count.value = n
        raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    arr = _deref(placementsRef)
    for i, s in enumerate(starts):
        arr[i].start = s
        arr[i].size = size
    count.value = n
    return _pynvml.NVML_SUCCESS


def _fill_handles(arrayRef: Any, countRef: Any, handles: list[Any]) -> int:
    """pynvml's instance-array convention (GetGpuInstances, GetComputeInstances): None -> count only;
    an array shorter than the count -> InsufficientSize with the count set."""
    count = _deref(countRef)
    if count is None:
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
    count.value = len(handles)
    if arrayRef is None:
        return _pynvml.NVML_SUCCESS
    arr = _deref(arrayRef)
    if len(arr) < len(handles):
        raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, h in enumerate(handles):
        arr[i] = h
    return _pynvml.NVML_SUCCESS


def _handle_addr(handle: Any) -> int | None:
    if handle is None:
        return None
    if isinstance(handle, int):
        return handle
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None


def _make_handle(ptr_type: Any, kind: int, gpu: int, serial: int) -> Any:
    addr = (_HANDLE_MAGIC << 48) | (kind << 44) | (gpu << 36) | serial
    return ctypes.cast(ctypes.c_void_p(addr), ptr_type)


def _decode(handle: Any) -> tuple[int, int, int] | None:
    addr = _handle_addr(handle)
    if not addr or (addr >> 48) != _HANDLE_MAGIC:
        return None
    return (addr >> 44) & 0xF, (addr >> 36) & 0xFF, addr & ((1 << 36) - 1)


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------


class SimNvml:
    """A module-like object with pynvml's function names. See the module docstring."""

    SIMULATED = True

    def __init__(
        self,
        fleet: str | Iterable[str] | None = None,
        state_path: str | os.PathLike[str] | None = None,
        node: str | None = None,
        mig_enabled: bool | Mapping[int, bool] | Iterable[bool] | None = None,
        clock: Callable[[], float] = time.time,
        *,
        mig_off: Iterable[int] = (),
        create_latency_s: float = 0.0,
        topology: NodeTopology | None = None,
    ) -> None:
        self.fleet = parse_fleet(fleet)
        self.node = node or DEFAULT_NODE
        self.state_path = Path(state_path) if state_path else None
        self.create_latency_s = create_latency_s
        self._mig_off = frozenset(mig_off)
        self._mig_default = self._mig_modes(mig_enabled)
        self._clock = clock
        self._refcount = 0
        self._lock = threading.RLock()
        self._state: dict[str, Any] | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._geos: list[GpuGeometry] = [geometry(k) for k in self.fleet]
        self._uuids = [self._gpu_uuid(i) for i in range(len(self.fleet))]
        # The catalog's platforms are all HGX 8-GPU boards (topology.py T1/T2); another fleet size is a PCIe server.
        self.topology = topology or (hgx_8gpu() if len(self.fleet) == 8 else pcie_server(len(self.fleet)))

    # ---------------------------------------------------------------- configuration / state

    def _mig_modes(self, mig_enabled: Any) -> list[int]:
        n = len(self.fleet)
        if mig_enabled is None:
            return [0 if i in self._mig_off else 1 for i in range(n)]
        if isinstance(mig_enabled, bool):
            return [int(mig_enabled)] * n
        if isinstance(mig_enabled, Mapping):
            return [int(bool(mig_enabled.get(i, True))) for i in range(n)]
        modes = [int(bool(x)) for x in mig_enabled]
        return (modes + [1] * n)[:n]

    def _gpu_uuid(self, index: int) -> str:
        return "GPU-" + str(uuid.uuid5(UUID_NAMESPACE, f"tessera-sim/{self.node}/gpu/{index}"))

    def _signature(self) -> dict[str, Any]:
        return {"node": self.node, "fleet": self.fleet}

    def _fresh_state(self) -> dict[str, Any]:
        now = self._clock()
        gpus = []
        for i, geo in enumerate(self._geos):
            gpus.append(
                {
                    "mig_current": self._mig_default[i],
                    "mig_pending": self._mig_default[i],
                    "next_serial": 1,
                    "gis": [],
                    "energy_mj": 0.0,
                    "t0": now,
                    "temp0": float(geo.sim.idle_temp_c),
                    "activity": {"device": 0.0, "device_mem": None, "gis": {}},
                }
            )
        return {"version": STATE_VERSION, **self._signature(), "gpus": gpus}

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self.state_path is None:  # in memory only: no file
            return None
        try:
            st = os.stat(self.state_path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read_file(self) -> dict[str, Any] | None:
        if self.state_path is None:
            return None
        try:
            data = json.loads(self.state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if data.get("version") != STATE_VERSION or {k: data.get(k) for k in ("node", "fleet")} != self._signature():
            return None
        return data

    def _write_file(self, state: dict[str, Any]) -> None:
        path = self.state_path
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._stamp = self._file_stamp()

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        assert self.state_path is not None
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.state_path) + ".lock", "a+") as lf:
            fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lf.fileno(), fcntl.LOCK_UN)

    def _load(self) -> dict[str, Any]:
        """Current state; re-read from the file whenever another process replaced it."""
        if self.state_path is None:
            if self._state is None:
                self._state = self._fresh_state()
            return self._state
        stamp = self._file_stamp()
        if self._state is not None and stamp is not None and stamp == self._stamp:
            return self._state
        data = self._read_file() if stamp is not None else None
        if data is None:
            with self._file_lock():
                data = self._read_or_create()
        self._state = data
        self._stamp = self._file_stamp()
        return data

    def _read_or_create(self) -> dict[str, Any]:
        """Under the file lock: the stored state, or a fresh GPU's written down."""
        data = self._read_file()
        if data is None:
            data = self._fresh_state()
            self._write_file(data)
        return data

    @contextlib.contextmanager
    def _mutate(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write under the file lock; the body gets the freshest state."""
        with self._lock:
            if self.state_path is None:
                yield self._load()
                return
            with self._file_lock():
                data = self._read_or_create()
                # pin the cache to this copy so reads inside the body see (and mutate) it
                self._state = data
                self._stamp = self._file_stamp()
                yield data
                self._write_file(data)
                self._state = data

    def reset_state(self) -> None:
        """Forget every GI/CI and counter (like a power cycle); for tests and demos."""
        with self._lock:
            if self.state_path is None:
                self._state = self._fresh_state()
                return
            with self._file_lock():
                self._state = self._fresh_state()
                self._write_file(self._state)

    # ---------------------------------------------------------------- handle helpers

    def _check_init(self) -> None:
        if self._refcount <= 0:
            raise _err(_pynvml.NVML_ERROR_UNINITIALIZED)

    def _dev(self, handle: Any, allow_mig: bool = False) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None]:
        """(gpu index, gi, ci) for a device handle; gi/ci only for MIG device handles."""
        self._check_init()
        dec = _decode(handle)
        if dec is None:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        kind, gpu, serial = dec
        if gpu >= len(self.fleet):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if kind == _KIND_GPU:
            return gpu, None, None
        if kind == _KIND_MIG:
            if not allow_mig:
                raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
            gi, ci = self._find_ci(gpu, serial)
            if ci is None:
                raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return gpu, gi, ci
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _gpu_state(self, gpu: int) -> dict[str, Any]:
        return self._load()["gpus"][gpu]

    def _find_gi(self, gpu: int, serial: int) -> dict[str, Any] | None:
        for gi in self._gpu_state(gpu)["gis"]:
            if gi["serial"] == serial:
                return gi
        return None

    def _find_ci(self, gpu: int, serial: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        for gi in self._gpu_state(gpu)["gis"]:
            for ci in gi["cis"]:
                if ci["serial"] == serial:
                    return gi, ci
        return None, None

    def _gi(self, handle: Any) -> tuple[int, dict[str, Any]]:
        self._check_init()
        dec = _decode(handle)
        if dec is None or dec[0] != _KIND_GI or dec[1] >= len(self.fleet):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi = self._find_gi(dec[1], dec[2])
        if gi is None:  # destroyed: stale handle
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return dec[1], gi

    def _ci(self, handle: Any) -> tuple[int, dict[str, Any], dict[str, Any]]:
        self._check_init()
        dec = _decode(handle)
        if dec is None or dec[0] != _KIND_CI or dec[1] >= len(self.fleet):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi, ci = self._find_ci(dec[1], dec[2])
        if ci is None or gi is None:  # a compute instance is always found inside its GPU instance
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return dec[1], gi, ci

    def _dev_handle(self, gpu: int) -> Any:
        return _make_handle(_pynvml.c_nvmlDevice_t, _KIND_GPU, gpu, 0)

    def _gi_handle(self, gpu: int, gi: dict[str, Any]) -> Any:
        return _make_handle(_pynvml.c_nvmlGpuInstance_t, _KIND_GI, gpu, gi["serial"])

    def _ci_handle(self, gpu: int, ci: dict[str, Any]) -> Any:
        return _make_handle(_pynvml.c_nvmlComputeInstance_t, _KIND_CI, gpu, ci["serial"])

    def _mig_handle(self, gpu: int, ci: dict[str, Any]) -> Any:
        return _make_handle(_pynvml.c_nvmlDevice_t, _KIND_MIG, gpu, ci["serial"])

    def _require_mig(self, gpu: int) -> None:
        if not self._gpu_state(gpu)["mig_current"]:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _profile_by_id(self, gpu: int, profile_id: int, code: int) -> Profile:
        try:
            return self._geos[gpu].profile_by_id(int(profile_id))
        except (KeyError, TypeError, ValueError):
            raise _err(code) from None

    def _mig_devices(self, gpu: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """MIG devices (one per CI) in NVML index order: by GI id, then CI id."""
        out = []
        for gi in sorted(self._gpu_state(gpu)["gis"], key=lambda g: g["id"]):
            for ci in sorted(gi["cis"], key=lambda c: c["id"]):
                out.append((gi, ci))
        return out

    # ---------------------------------------------------------------- init / system

    def nvmlInit(self) -> None:
        with self._lock:
            self._refcount += 1
            self._stamp = None  # re-read the state file on init
            self._load()

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._check_init()
            self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return DRIVER_VERSION

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._check_init()
        return NVML_VERSION

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check_init()
        return CUDA_DRIVER_VERSION

    nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion

    # ---------------------------------------------------------------- devices

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.fleet)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check_init()
        if not isinstance(index, int) or not 0 <= index < len(self.fleet):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._dev_handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid_: str | bytes) -> Any:
        self._check_init()
        if isinstance(uuid_, bytes):
            uuid_ = uuid_.decode()
        if uuid_ in self._uuids:
            return self._dev_handle(self._uuids.index(uuid_))
        for gpu in range(len(self.fleet)):
            for _gi, ci in self._mig_devices(gpu):
                if ci["uuid"] == uuid_:
                    return self._mig_handle(gpu, ci)
        raise _err(_pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu, gi, ci = self._dev(handle, allow_mig=True)
        geo = self._geos[gpu]
        if ci is None:
            return geo.nvml_name
        assert gi is not None  # a compute instance lives in a GPU instance
        return f"{geo.nvml_name} MIG {self._ci_name(gpu, gi, ci)}"

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu, _gi, ci = self._dev(handle, allow_mig=True)
        return self._uuids[gpu] if ci is None else ci["uuid"]

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        gpu, _gi, _ci = self._dev(handle)
        return gpu

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        """The N of /dev/nvidiaN: the driver numbers them in PCI order, as it does the indices here."""
        gpu, _gi, _ci = self._dev(handle)
        return gpu

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        gpu, _gi, _ci = self._dev(handle, allow_mig=True)
        major, _, minor = self._geos[gpu].compute_capability.partition(".")
        return (int(major), int(minor or 0))

    # ---------------------------------------------------------------- MIG mode

    # ---------------------------------------------------------------- topology (topology.py T1-T6)

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a, _gi, _ci = self._dev(device1)
        b, _gi, _ci = self._dev(device2)
        return self.topology.common_ancestor(a, b)

    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int:
        a, _gi, _ci = self._dev(device1)
        b, _gi, _ci = self._dev(device2)
        if p2pIndex not in (_pynvml.NVML_P2P_CAPS_INDEX_READ, _pynvml.NVML_P2P_CAPS_INDEX_WRITE,
                            _pynvml.NVML_P2P_CAPS_INDEX_NVLINK, _pynvml.NVML_P2P_CAPS_INDEX_ATOMICS):
            return _pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        return self.topology.p2p_status(a, b)

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        gpu, _gi, _ci = self._dev(device)
        if not 0 <= link < _pynvml.NVML_NVLINK_MAX_LINKS:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.topology.gpu(gpu).nvlink_domain is None or link >= NVLINKS_PER_GPU:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetCpuAffinity(self, device: Any, cpuSetSize: int) -> list[int]:
        gpu, _gi, _ci = self._dev(device)
        return cpu_mask(self.topology.gpu(gpu).cpus, cpuSetSize)

    def nvmlDeviceGetMemoryAffinity(self, device: Any, nodeSetSize: int, scope: int) -> list[int]:
        gpu, _gi, _ci = self._dev(device)
        return cpu_mask((self.topology.gpu(gpu).numa_node,), nodeSetSize)  # a bitmask of NUMA nodes, same layout

    def nvmlDeviceGetNumaNodeId(self, device: Any) -> int:
        """Only where the GPU is itself a NUMA node (Grace Hopper); never on an x86 HGX server (T5)."""
        self._dev(device)
        raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu, _gi, _ci = self._dev(device)
        st = self._gpu_state(gpu)
        return [st["mig_current"], st["mig_pending"]]

    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        """Simulated: takes effect at once (as after a successful GPU reset); returns activationStatus.

        Disabling while GPU instances exist returns NVML_ERROR_IN_USE as the activation status and
        leaves the mode pending, like a GPU that could not be reset."""
        gpu, _gi, _ci = self._dev(device)
        if mode not in (0, 1):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._mutate() as state:
            st = state["gpus"][gpu]
            st["mig_pending"] = mode
            if mode == 0 and st["gis"]:
                return _pynvml.NVML_ERROR_IN_USE
            st["mig_current"] = mode
        return _pynvml.NVML_SUCCESS

    # ---------------------------------------------------------------- GPU-instance profiles

    def _fill_gi_profile(self, c_info: Any, gpu: int, p: Profile) -> Any:
        c_info.id = p.profile_id
        c_info.isP2pSupported = 0
        c_info.sliceCount = p.compute_slices
        c_info.instanceCount = p.max_count
        c_info.multiprocessorCount = p.sm_count
        c_info.copyEngineCount = p.copy_engines
        c_info.decoderCount = p.decoders
        c_info.encoderCount = p.encoders
        c_info.jpegCount = p.jpegs
        c_info.ofaCount = p.ofas
        c_info.memorySizeMB = p.memory_mib
        if hasattr(type(c_info), "name"):
            c_info.name = f"MIG {p.name}".encode()
        return c_info

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        gpu, _gi, _ci = self._dev(device)
        if version == 2:
            c_info = _pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        elif version == 1:
            c_info = _pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise _err(_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not isinstance(profile, int) or profile < 0 or profile >= _pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._require_mig(gpu)
        try:
            p = self._geos[gpu].profile_by_constant(profile)
        except KeyError:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED) from None
        return self._fill_gi_profile(c_info, gpu, p)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        gpu, _gi, _ci = self._dev(device)
        self._require_mig(gpu)
        p = self._profile_by_id(gpu, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._fill_gi_profile(_pynvml.c_nvmlGpuInstanceProfileInfo_v2_t(), gpu, p)

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    # ---------------------------------------------------------------- placement rules

    @staticmethod
    def _mask(start: int, size: int) -> int:
        return ((1 << size) - 1) << start

    def _used_mask(self, gpu: int) -> int:
        m = 0
        for gi in self._gpu_state(gpu)["gis"]:
            m |= self._mask(gi["start"], gi["size"])
        return m

    def _free_starts(self, gpu: int, p: Profile) -> list[int]:
        used = self._used_mask(gpu)
        return [s for s in p.starts if not (used & self._mask(s, p.memory_slices))]

    def _live_count(self, gpu: int, profile_id: int) -> int:
        return sum(1 for gi in self._gpu_state(gpu)["gis"] if gi["profile_id"] == profile_id)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        gpu, _gi, _ci = self._dev(device)
        self._require_mig(gpu)
        p = self._profile_by_id(gpu, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        left = p.max_count - self._live_count(gpu, p.profile_id)
        return max(0, min(left, len(self._free_starts(gpu, p))))

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """All placements of the profile, whatever exists already (nvml.h), with MIG on or off.

        ``placementsRef=None`` writes only the count. An array smaller than the count (its length,
        or the count passed in if that is non-zero and smaller) -> InsufficientSize, count set."""
        gpu, _gi, _ci = self._dev(device)
        p = self._profile_by_id(gpu, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _fill_placements(placementsRef, countRef, p.starts, p.memory_slices)

    nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements

    def _auto_start(self, gpu: int, p: Profile) -> int | None:
        """nvmlDeviceCreateGpuInstance's choice (gpu.md 1.7 heuristic)."""
        free = self._free_starts(gpu, p)
        if not free:
            return None
        used = self._used_mask(gpu)
        others = [
            self._mask(s, q.memory_slices)
            for q in self._geos[gpu].profiles
            if q.profile_id != p.profile_id
            for s in q.starts
            if not (used & self._mask(s, q.memory_slices))
        ]

        def blocked(start: int) -> int:
            m = self._mask(start, p.memory_slices)
            return sum(1 for o in others if o & m)

        return min(free, key=lambda s: (blocked(s), s))

    def _create_gi(self, device: Any, profileId: int, start: int | None, size: int | None) -> Any:
        gpu, _gi, _ci = self._dev(device)
        with self._mutate() as state:
            st = state["gpus"][gpu]
            if not st["mig_current"]:
                raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
            p = self._profile_by_id(gpu, profileId, _pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if start is None:
                if self._live_count(gpu, p.profile_id) >= p.max_count:
                    raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
                start = self._auto_start(gpu, p)
                if start is None:
                    raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            else:
                if start not in p.starts or size != p.memory_slices:
                    raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
                if self._used_mask(gpu) & self._mask(start, p.memory_slices):
                    raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
                if self._live_count(gpu, p.profile_id) >= p.max_count:
                    raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            if len(st["gis"]) >= self._geos[gpu].max_gpu_instances:
                raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            serial = st["next_serial"]
            st["next_serial"] = serial + 1
            gi = {
                "id": gi_id_for(start, p.memory_slices),
                "profile_id": p.profile_id,
                "start": start,
                "size": p.memory_slices,
                "serial": serial,
                "next_ci_serial": 0,
                "cis": [],
            }
            st["gis"].append(gi)
            return self._gi_handle(gpu, gi)

    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        return self._create_gi(device, profileId, None, None)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        pl = _deref(placement)
        if pl is None or not hasattr(pl, "start") or not hasattr(pl, "size"):
            self._dev(device)
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = self._create_gi(device, profileId, int(pl.start), int(pl.size))
        self._latency()
        return handle

    def _latency(self) -> None:
        """Real GI creation takes a while (the driver reconfigures the GPU); the state is already
        committed when the call is still running, so a process killed now leaves the GI behind.
        ``create_latency_s`` (setting TESSERA_NVML_SIM_CREATE_LATENCY_S, default 0) sets how long the call takes."""
        if self.create_latency_s > 0:
            time.sleep(self.create_latency_s)

    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        gpu, _gi, _ci = self._dev(device)
        self._require_mig(gpu)
        p = self._profile_by_id(gpu, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        gis = sorted((g for g in self._gpu_state(gpu)["gis"] if g["profile_id"] == p.profile_id), key=lambda g: g["id"])
        return _fill_handles(gpuInstancesRef, countRef, [self._gi_handle(gpu, gi) for gi in gis])

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpu, _gi, _ci = self._dev(device)
        self._require_mig(gpu)
        for gi in self._gpu_state(gpu)["gis"]:
            if gi["id"] == gpuInstanceId:
                return self._gi_handle(gpu, gi)
        raise _err(_pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gpu, gi = self._gi(gpuInstance)
        info = _pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._dev_handle(gpu)
        info.id = gi["id"]
        info.profileId = gi["profile_id"]
        info.placement.start = gi["start"]
        info.placement.size = gi["size"]
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        gpu, gi = self._gi(gpuInstance)
        with self._mutate() as state:
            st = state["gpus"][gpu]
            live = next((g for g in st["gis"] if g["serial"] == gi["serial"]), None)
            if live is None:
                raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if live["cis"]:
                raise _err(_pynvml.NVML_ERROR_IN_USE)
            self._fold_energy(state, gpu)
            st["gis"].remove(live)
            st["activity"]["gis"].pop(str(live["id"]), None)
        return _pynvml.NVML_SUCCESS

    # ---------------------------------------------------------------- compute instances

    def _gi_profile(self, gpu: int, gi: dict[str, Any]) -> Profile:
        return self._geos[gpu].profile_by_id(gi["profile_id"])

    def _ci_profile(self, gpu: int, gi: dict[str, Any], profile: int, code: int) -> tuple[Profile, CiProfile]:
        p = self._gi_profile(gpu, gi)
        for c in p.ci_profiles:
            if c.nvml_constant == profile:
                return p, c
        raise _err(code)

    def _ci_name(self, gpu: int, gi: dict[str, Any], ci: dict[str, Any]) -> str:
        p = self._gi_profile(gpu, gi)
        if ci["size"] == p.compute_slices:
            return p.name
        return f"{ci['size']}c.{p.name}"

    def _ci_sms(self, p: Profile, slices: int) -> int:
        if slices == p.compute_slices:
            return p.sm_count
        return p.sm_count * slices // p.compute_slices

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        gpu, gi = self._gi(device)  # pynvml names the GI handle 'device'
        if version == 2:
            c_info = _pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        elif version == 1:
            c_info = _pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            raise _err(_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not isinstance(profile, int) or not 0 <= profile < _pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not isinstance(engProfile, int) or not 0 <= engProfile < _pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        p, c = self._ci_profile(gpu, gi, profile, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        c_info.id = c.profile_id
        c_info.sliceCount = c.compute_slices
        c_info.instanceCount = c.max_count
        c_info.multiprocessorCount = self._ci_sms(p, c.compute_slices)
        c_info.sharedCopyEngineCount = p.copy_engines
        c_info.sharedDecoderCount = p.decoders
        c_info.sharedEncoderCount = p.encoders
        c_info.sharedJpegCount = p.jpegs
        c_info.sharedOfaCount = p.ofas
        if hasattr(type(c_info), "name"):
            nm = p.name if c.compute_slices == p.compute_slices else f"{c.compute_slices}c.{p.name}"
            c_info.name = f"MIG {nm}".encode()
        return c_info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    @staticmethod
    def _ci_used(gi: dict[str, Any]) -> int:
        m = 0
        for ci in gi["cis"]:
            m |= ((1 << ci["size"]) - 1) << ci["start"]
        return m

    def _ci_free_starts(self, gi: dict[str, Any], c: CiProfile) -> list[int]:
        used = self._ci_used(gi)
        return [s for s in c.starts if not (used & (((1 << c.compute_slices) - 1) << s))]

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any, profileId: int) -> int:
        gpu, gi = self._gi(gpuInstance)
        _p, c = self._ci_profile(gpu, gi, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        live = sum(1 for ci in gi["cis"] if ci["profile_id"] == c.profile_id)
        return max(0, min(c.max_count - live, len(self._ci_free_starts(gi, c))))

    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(
        self, gpuInstance: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        gpu, gi = self._gi(gpuInstance)
        _p, c = self._ci_profile(gpu, gi, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _fill_placements(placementsRef, countRef, c.starts, c.compute_slices)

    def _create_ci(self, gpuInstance: Any, profileId: int, start: int | None, size: int | None) -> Any:
        gpu, gi0 = self._gi(gpuInstance)
        with self._mutate() as state:
            st = state["gpus"][gpu]
            gi = next((g for g in st["gis"] if g["serial"] == gi0["serial"]), None)
            if gi is None:
                raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
            _p, c = self._ci_profile(gpu, gi, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
            free = self._ci_free_starts(gi, c)
            if start is None:
                if not free:
                    raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
                start = free[0]
            elif start not in c.starts or size != c.compute_slices:
                raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
            elif start not in free:
                raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            if sum(1 for ci in gi["cis"] if ci["profile_id"] == c.profile_id) >= c.max_count:
                raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            used_ids = {ci["id"] for ci in gi["cis"]}
            ci_id = next(i for i in range(64) if i not in used_ids)
            serial = st["next_serial"]
            st["next_serial"] = serial + 1
            mig_uuid = "MIG-" + str(
                uuid.uuid5(UUID_NAMESPACE, f"{self._uuids[gpu]}/gi/{gi['id']}/ci/{ci_id}/serial/{serial}")
            )
            ci = {
                "id": ci_id,
                "profile_id": c.profile_id,
                "start": start,
                "size": c.compute_slices,
                "serial": serial,
                "uuid": mig_uuid,
                "in_use": False,
            }
            gi["cis"].append(ci)
            return self._ci_handle(gpu, ci)

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        return self._create_ci(gpuInstance, profileId, None, None)

    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        self, gpuInstance: Any, profileId: int, placement: Any
    ) -> Any:
        pl = _deref(placement)
        if pl is None or not hasattr(pl, "start"):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._create_ci(gpuInstance, profileId, int(pl.start), int(pl.size))

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        gpu, gi = self._gi(gpuInstance)
        _p, c = self._ci_profile(gpu, gi, profileId, _pynvml.NVML_ERROR_NOT_SUPPORTED)
        cis = sorted((x for x in gi["cis"] if x["profile_id"] == c.profile_id), key=lambda x: x["id"])
        return _fill_handles(computeInstancesRef, countRef, [self._ci_handle(gpu, ci) for ci in cis])

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        gpu, gi = self._gi(gpuInstance)
        for ci in gi["cis"]:
            if ci["id"] == computeInstanceId:
                return self._ci_handle(gpu, ci)
        raise _err(_pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        gpu, gi, ci = self._ci(computeInstance)
        info = _pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._dev_handle(gpu)
        info.gpuInstance = self._gi_handle(gpu, gi)
        info.id = ci["id"]
        info.profileId = ci["profile_id"]
        info.placement.start = ci["start"]
        info.placement.size = ci["size"]
        return info

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        gpu, gi0, ci0 = self._ci(computeInstance)
        with self._mutate() as state:
            st = state["gpus"][gpu]
            gi = next((g for g in st["gis"] if g["serial"] == gi0["serial"]), None)
            ci = next((c for c in gi["cis"] if c["serial"] == ci0["serial"]), None) if gi else None
            if ci is None or gi is None:
                raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if ci.get("in_use"):
                raise _err(_pynvml.NVML_ERROR_IN_USE)
            gi["cis"].remove(ci)
        return _pynvml.NVML_SUCCESS

    # ---------------------------------------------------------------- MIG device handles

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu, _gi, _ci = self._dev(device)
        if not self._gpu_state(gpu)["mig_current"]:
            return 0
        return self._geos[gpu].compute_slices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu, _gi, _ci = self._dev(device)
        self._require_mig(gpu)
        if not isinstance(index, int) or not 0 <= index < self._geos[gpu].compute_slices:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devs = self._mig_devices(gpu)
        if index >= len(devs):
            raise _err(_pynvml.NVML_ERROR_NOT_FOUND)
        return self._mig_handle(gpu, devs[index][1])

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> ctypes.c_uint:
        self._check_init()
        dec = _decode(device)
        if dec is None:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if dec[0] == _KIND_MIG:
            self._dev(device, allow_mig=True)  # stale -> InvalidArgument
        return ctypes.c_uint(1 if dec[0] == _KIND_MIG else 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        gpu, _gi, ci = self._dev(migDevice, allow_mig=True)
        if ci is None:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._dev_handle(gpu)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        _gpu, gi, ci = self._dev(device, allow_mig=True)
        if ci is None:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert gi is not None  # a compute instance lives in a GPU instance
        return gi["id"]

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        _gpu, _gi, ci = self._dev(device, allow_mig=True)
        if ci is None:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return ci["id"]

    def nvmlDeviceGetAttributes(self, device: Any) -> Any:
        gpu, gi, ci = self._dev(device, allow_mig=True)
        if ci is None or gi is None:  # a whole GPU (or a GPU instance) has no compute-instance attributes
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        p = self._gi_profile(gpu, gi)
        a = _pynvml.c_nvmlDeviceAttributes()
        a.multiprocessorCount = self._ci_sms(p, ci["size"])
        a.sharedCopyEngineCount = p.copy_engines
        a.sharedDecoderCount = p.decoders
        a.sharedEncoderCount = p.encoders
        a.sharedJpegCount = p.jpegs
        a.sharedOfaCount = p.ofas
        a.gpuInstanceSliceCount = p.compute_slices
        a.computeInstanceSliceCount = ci["size"]
        a.memorySizeMB = p.memory_mib
        return a

    nvmlDeviceGetAttributes_v2 = nvmlDeviceGetAttributes

    # ---------------------------------------------------------------- load hook + physics

    def set_activity(
        self,
        gpu_index: int,
        gi_id: int | None = None,
        utilization: float = 0.0,
        memory_fraction: float | None = None,
    ) -> None:
        """Simulated load. ``gi_id=None``: the whole GPU (also a floor under MIG). ``utilization`` 0..1;
        ``memory_fraction`` of the GPU's/slice's memory in use (default follows utilization)."""
        if not 0 <= gpu_index < len(self.fleet):
            raise IndexError(gpu_index)
        u = min(1.0, max(0.0, float(utilization)))
        mf = None if memory_fraction is None else min(1.0, max(0.0, float(memory_fraction)))
        with self._mutate() as state:
            st = state["gpus"][gpu_index]
            self._fold_energy(state, gpu_index)
            if gi_id is None:
                st["activity"]["device"] = u
                st["activity"]["device_mem"] = mf
            else:
                if not any(g["id"] == gi_id for g in st["gis"]):
                    raise KeyError(f"GPU {gpu_index} has no GPU instance {gi_id}")
                st["activity"]["gis"][str(gi_id)] = {"util": u, "mem": mf}

    def set_compute_instance_in_use(self, gpu_index: int, gi_id: int, ci_id: int, in_use: bool = True) -> None:
        """Mark a CI as having processes (e.g. Triton), so destroying it gives InUse."""
        with self._mutate() as state:
            for gi in state["gpus"][gpu_index]["gis"]:
                if gi["id"] == gi_id:
                    for ci in gi["cis"]:
                        if ci["id"] == ci_id:
                            ci["in_use"] = bool(in_use)
                            return
            raise KeyError((gpu_index, gi_id, ci_id))

    def _effective_util(self, st: dict[str, Any], gpu: int) -> float:
        act = st["activity"]
        if not st["mig_current"]:
            return act["device"]
        geo = self._geos[gpu]
        total = 0.0
        for gi in st["gis"]:
            a = act["gis"].get(str(gi["id"]))
            if a:
                total += a["util"] * geo.profile_by_id(gi["profile_id"]).compute_slices / geo.compute_slices
        return min(1.0, max(total, act["device"]))

    def _idle_watts(self, gpu: int) -> float:
        return self._geos[gpu].sim.idle_watts + ((gpu * 7) % 5) - 2  # small fixed per-board spread

    def _power_w(self, st: dict[str, Any], gpu: int) -> float:
        geo = self._geos[gpu]
        idle = self._idle_watts(gpu)
        return idle + (geo.tdp_watts * 0.98 - idle) * self._effective_util(st, gpu)

    def _target_temp(self, st: dict[str, Any], gpu: int) -> float:
        sim = self._geos[gpu].sim
        return sim.idle_temp_c + (sim.max_temp_c - sim.idle_temp_c) * self._effective_util(st, gpu)

    def _fold_energy(self, state: dict[str, Any], gpu: int) -> None:
        """Integrate energy and temperature up to now before the load changes."""
        st = state["gpus"][gpu]
        now = max(self._clock(), st["t0"])
        st["energy_mj"] = st["energy_mj"] + self._power_w(st, gpu) * (now - st["t0"]) * 1000.0
        st["temp0"] = self._temp_at(st, gpu, now)
        st["t0"] = now

    def _temp_at(self, st: dict[str, Any], gpu: int, now: float) -> float:
        target = self._target_temp(st, gpu)
        dt = max(0.0, now - st["t0"])
        return target + (st["temp0"] - target) * math.exp(-dt / TEMP_TAU_S)

    def _parent_only(self, handle: Any) -> tuple[int, dict[str, Any]]:
        gpu, _gi, _ci = self._dev(handle)  # MIG handle -> NotSupported
        return gpu, self._gpu_state(gpu)

    # ---------------------------------------------------------------- telemetry

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu, _gi, _ci = self._dev(handle, allow_mig=True)
        st = self._gpu_state(gpu)
        if st["mig_current"]:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        u = _pynvml.c_nvmlUtilization_t()
        util = self._effective_util(st, gpu)
        u.gpu = _round_half_up(util * 100)
        u.memory = _round_half_up(util * 55)
        return u

    def _mem_used_mib(self, gpu: int, st: dict[str, Any], gi: dict[str, Any] | None) -> tuple[int, int]:
        geo = self._geos[gpu]
        if gi is not None:
            p = geo.profile_by_id(gi["profile_id"])
            a = st["activity"]["gis"].get(str(gi["id"]))
            total = p.memory_mib
            if not a:
                return 0, total
            frac = a["mem"] if a["mem"] is not None else (0.05 + 0.8 * a["util"] if a["util"] > 0 else 0.0)
            return int(total * frac), total
        total = geo.memory_mib
        if st["mig_current"]:
            used = sum(self._mem_used_mib(gpu, st, g)[0] for g in st["gis"])
            return min(total, used), total
        a = st["activity"]
        if a["device_mem"] is not None:
            frac = a["device_mem"]
        else:
            frac = 0.05 + 0.8 * a["device"] if a["device"] > 0 else 0.0
        return int(total * frac), total

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu, gi, _ci = self._dev(handle, allow_mig=True)
        st = self._gpu_state(gpu)
        used, total = self._mem_used_mib(gpu, st, gi)
        if version:
            if version != _pynvml.nvmlMemory_v2:
                raise _err(_pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            m = _pynvml.c_nvmlMemory_v2_t()
            m.version = version
            m.reserved = 0
        else:
            m = _pynvml.c_nvmlMemory_t()
        m.total = total * MIB
        m.used = used * MIB
        m.free = (total - used) * MIB
        return m

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu, st = self._parent_only(handle)
        return int(self._power_w(st, gpu) * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        gpu, st = self._parent_only(handle)
        now = max(self._clock(), st["t0"])
        return int(st["energy_mj"] + self._power_w(st, gpu) * (now - st["t0"]) * 1000.0)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        gpu, _st = self._parent_only(handle)
        return self._geos[gpu].tdp_watts * 1000

    nvmlDeviceGetPowerManagementLimit = nvmlDeviceGetEnforcedPowerLimit
    nvmlDeviceGetPowerManagementDefaultLimit = nvmlDeviceGetEnforcedPowerLimit

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu, st = self._parent_only(handle)
        if sensor != _pynvml.NVML_TEMPERATURE_GPU:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _round_half_up(self._temp_at(st, gpu, max(self._clock(), st["t0"])))

    def _clock_mhz(self, gpu: int, st: dict[str, Any], type_: int, maximum: bool) -> int:
        sim = self._geos[gpu].sim
        if type_ in (_pynvml.NVML_CLOCK_GRAPHICS, _pynvml.NVML_CLOCK_SM):
            if maximum:
                return sim.sm_clock_max_mhz
            util = self._effective_util(st, gpu)
            if util <= 0:
                return sim.sm_clock_idle_mhz
            # boost under light load, slight power-limited droop under heavy load
            return int(sim.sm_clock_max_mhz - 225 * max(0.0, util - 0.5) * 2)
        if type_ == _pynvml.NVML_CLOCK_MEM:
            return sim.mem_clock_mhz
        if type_ == _pynvml.NVML_CLOCK_VIDEO:
            return sim.video_clock_mhz
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:  # pynvml's name
        gpu, st = self._parent_only(handle)
        return self._clock_mhz(gpu, st, type, maximum=False)

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        gpu, st = self._parent_only(handle)
        return self._clock_mhz(gpu, st, type, maximum=True)

    # ---------------------------------------------------------------- module-like fallthrough

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined on the class: constants/structs from real pynvml,
        # and FunctionNotFound for pynvml functions the simulator lacks.
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(_pynvml, name)
        if name.startswith("nvml") and callable(value):

            def _missing(*args: Any, **kwargs: Any) -> Any:
                raise _err(_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

            _missing.__name__ = name
            return _missing
        return value


_MODULE: SimNvml | None = None
_MODULE_KEY: tuple[Any, ...] | None = None
_MODULE_LOCK = threading.Lock()


def module(
    fleet: str | Iterable[str] | None = None,
    state_path: str | os.PathLike[str] | None = None,
    node: str | None = None,
    mig_off: Iterable[int] = (),
    create_latency_s: float = 0.0,
) -> SimNvml:
    """The process-wide simulator (what ``import pynvml`` would be), configured from the arguments (the
    ``TESSERA_NVML_SIM_*`` settings, see ``nvml.get_backend``); a new one is made when they change."""
    global _MODULE, _MODULE_KEY
    off = tuple(sorted(set(mig_off)))
    key = (tuple(parse_fleet(fleet)), str(state_path or ""), node or DEFAULT_NODE, off, create_latency_s)
    with _MODULE_LOCK:
        if _MODULE is None or key != _MODULE_KEY:
            _MODULE = SimNvml(fleet=list(key[0]), state_path=key[1] or None, node=key[2], mig_off=off,
                              create_latency_s=create_latency_s)
            _MODULE_KEY = key
        return _MODULE
