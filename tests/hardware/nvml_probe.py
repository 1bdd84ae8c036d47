#!/usr/bin/env python
"""Read-only NVML probe: the same call sequence on the simulator or on real pynvml, for diffing.

    python tests/hardware/nvml_probe.py [--backend sim|pynvml] [--json]

It never creates or destroys GPU/compute instances and never changes MIG mode, clocks or power.
Every call is wrapped: an NVMLError is recorded by class name (e.g. "NVMLError_NotSupported")
instead of a value, so a sim report and a real H100/H200 report line up key by key.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GI_PROFILE_NAMES = {
    0x0: "1_SLICE",
    0x1: "2_SLICE",
    0x2: "3_SLICE",
    0x3: "4_SLICE",
    0x4: "7_SLICE",
    0x5: "8_SLICE",
    0x6: "6_SLICE",
    0x7: "1_SLICE_REV1",
    0x8: "2_SLICE_REV1",
    0x9: "1_SLICE_REV2",
}
PROFILE_FIELDS = (
    "id",
    "isP2pSupported",
    "sliceCount",
    "instanceCount",
    "multiprocessorCount",
    "copyEngineCount",
    "decoderCount",
    "encoderCount",
    "jpegCount",
    "ofaCount",
    "memorySizeMB",
    "name",
)
CI_FIELDS = (
    "id",
    "sliceCount",
    "instanceCount",
    "multiprocessorCount",
    "sharedCopyEngineCount",
    "sharedDecoderCount",
    "sharedEncoderCount",
    "sharedJpegCount",
    "sharedOfaCount",
    "name",
)


def load_backend(name: str) -> Any:
    if name == "pynvml":
        import pynvml

        return pynvml
    from marketplace.hardware.nvml import get_backend

    return get_backend("sim")


class Probe:
    def __init__(self, nv: Any) -> None:
        self.nv = nv

    def call(self, fn: str, *args: Any, conv=None) -> Any:
        """Run one NVML call; an NVMLError becomes {"error": "<class name>"}."""
        try:
            value = getattr(self.nv, fn)(*args)
        except self.nv.NVMLError as e:
            return {"error": type(e).__name__}
        except AttributeError:
            return {"error": "missing in this pynvml"}
        return conv(value) if conv else plain(value)

    def struct(self, value: Any, fields: tuple[str, ...]) -> dict:
        out = {}
        for f in fields:
            v = getattr(value, f, None)
            out[f] = v.decode() if isinstance(v, bytes) else v
        return out

    def array_call(self, fn: str, handle: Any, profile_id: int, elem: Any, size: int) -> Any:
        count = ctypes.c_uint(0)
        arr = (elem * size)()
        try:
            getattr(self.nv, fn)(handle, profile_id, arr, ctypes.byref(count))
        except self.nv.NVMLError as e:
            return {"error": type(e).__name__}, []
        return None, [arr[i] for i in range(count.value)]

    def placements(self, h: Any, profile_id: int) -> Any:
        count = ctypes.c_uint(0)
        fn = self.nv.nvmlDeviceGetGpuInstancePossiblePlacements
        try:
            fn(h, profile_id, None, ctypes.byref(count))
            arr = (self.nv.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
            fn(h, profile_id, arr, ctypes.byref(count))
        except self.nv.NVMLError as e:
            return {"error": type(e).__name__}
        return [[arr[i].start, arr[i].size] for i in range(count.value)]

    def gpu(self, index: int) -> dict:
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(index)
        util = self.call("nvmlDeviceGetUtilizationRates", h, conv=lambda u: {"gpu": u.gpu, "memory": u.memory})
        mem = self.call("nvmlDeviceGetMemoryInfo", h, conv=mem_dict)
        rep: dict[str, Any] = {
            "index": index,
            "name": self.call("nvmlDeviceGetName", h),
            "uuid": self.call("nvmlDeviceGetUUID", h),
            "mig_mode": self.call("nvmlDeviceGetMigMode", h),
            "memory": mem,
            "power_mw": self.call("nvmlDeviceGetPowerUsage", h),
            "power_limit_mw": self.call("nvmlDeviceGetEnforcedPowerLimit", h),
            "energy_mj": self.call("nvmlDeviceGetTotalEnergyConsumption", h),
            "temperature_c": self.call("nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU),
            "sm_clock_mhz": self.call("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM),
            "mem_clock_mhz": self.call("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": self.call("nvmlDeviceGetMaxClockInfo", h, nv.NVML_CLOCK_SM),
            "utilization": util,
            "max_mig_device_count": self.call("nvmlDeviceGetMaxMigDeviceCount", h),
            "gpu_instance_profiles": [],
            "gpu_instances": [],
            "mig_devices": [],
        }
        profile_ids = []
        for const in range(nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            entry: dict[str, Any] = {"constant": const, "constant_name": GI_PROFILE_NAMES.get(const, hex(const))}
            info = self.call(
                "nvmlDeviceGetGpuInstanceProfileInfo", h, const, conv=lambda v: self.struct(v, PROFILE_FIELDS)
            )
            entry["info"] = info
            if isinstance(info, dict) and "error" not in info:
                pid = info["id"]
                profile_ids.append(pid)
                entry["possible_placements"] = self.placements(h, pid)
                entry["remaining_capacity"] = self.call("nvmlDeviceGetGpuInstanceRemainingCapacity", h, pid)
            rep["gpu_instance_profiles"].append(entry)
            if isinstance(info, dict) and info.get("error") == "NVMLError_InvalidArgument":
                break
        for pid in profile_ids:
            err, gis = self.array_call("nvmlDeviceGetGpuInstances", h, pid, nv.c_nvmlGpuInstance_t, 8)
            if err:
                rep["gpu_instances"].append({"profile_id": pid, **err})
                continue
            for gi in gis:
                rep["gpu_instances"].append(self.gpu_instance(gi))
        max_mig = rep["max_mig_device_count"]
        for i in range(max_mig if isinstance(max_mig, int) else 0):
            try:
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except nv.NVMLError as e:
                rep["mig_devices"].append({"index": i, "error": type(e).__name__})
                continue
            rep["mig_devices"].append(
                {
                    "index": i,
                    "is_mig": self.call("nvmlDeviceIsMigDeviceHandle", m),
                    "name": self.call("nvmlDeviceGetName", m),
                    "uuid": self.call("nvmlDeviceGetUUID", m),
                    "gpu_instance_id": self.call("nvmlDeviceGetGpuInstanceId", m),
                    "compute_instance_id": self.call("nvmlDeviceGetComputeInstanceId", m),
                    "memory": self.call("nvmlDeviceGetMemoryInfo", m, conv=mem_dict),
                    "utilization": self.call(
                        "nvmlDeviceGetUtilizationRates", m, conv=lambda u: {"gpu": u.gpu, "memory": u.memory}
                    ),
                    "power_mw": self.call("nvmlDeviceGetPowerUsage", m),
                }
            )
        return rep

    def gpu_instance(self, gi: Any) -> dict:
        nv = self.nv
        info = nv.nvmlGpuInstanceGetInfo(gi)
        out: dict[str, Any] = {
            "id": info.id,
            "profile_id": info.profileId,
            "placement": [info.placement.start, info.placement.size],
            "compute_instance_profiles": [],
            "compute_instances": [],
        }
        for const in range(nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            ci_info = self.call(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                gi,
                const,
                nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                conv=lambda v: self.struct(v, CI_FIELDS),
            )
            out["compute_instance_profiles"].append({"constant": const, "info": ci_info})
            if isinstance(ci_info, dict) and "error" not in ci_info:
                err, cis = self.array_call(
                    "nvmlGpuInstanceGetComputeInstances", gi, ci_info["id"], nv.c_nvmlComputeInstance_t, 8
                )
                for ci in cis:
                    c = nv.nvmlComputeInstanceGetInfo(ci)
                    out["compute_instances"].append(
                        {"id": c.id, "profile_id": c.profileId, "placement": [c.placement.start, c.placement.size]}
                    )
        return out

    def run(self) -> dict:
        nv = self.nv
        report: dict[str, Any] = {"backend": "sim" if getattr(nv, "SIMULATED", False) else "pynvml"}
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            report["init"] = {"error": type(e).__name__}
            return report
        try:
            report["driver_version"] = self.call("nvmlSystemGetDriverVersion")
            report["nvml_version"] = self.call("nvmlSystemGetNVMLVersion")
            report["cuda_driver_version"] = self.call("nvmlSystemGetCudaDriverVersion")
            report["device_count"] = nv.nvmlDeviceGetCount()
            report["gpus"] = [self.gpu(i) for i in range(report["device_count"])]
        finally:
            nv.nvmlShutdown()
        return report


def plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, ctypes.c_uint):
        return v.value
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def mem_dict(m: Any) -> dict:
    return {"total": m.total, "used": m.used, "free": m.free}


def fmt(v: Any) -> str:
    if isinstance(v, dict) and set(v) == {"error"}:
        return f"<{v['error']}>"
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def text_report(r: dict) -> str:
    lines = [f"backend: {r['backend']}"]
    if "init" in r:
        return "\n".join(lines + [f"nvmlInit: {fmt(r['init'])}"])
    lines += [
        f"driver: {fmt(r['driver_version'])}  nvml: {fmt(r['nvml_version'])}  cuda: {fmt(r['cuda_driver_version'])}",
        f"device count: {r['device_count']}",
    ]
    for g in r["gpus"]:
        lines.append(f"GPU {g['index']}: {fmt(g['name'])}  {fmt(g['uuid'])}  MIG {fmt(g['mig_mode'])}")
        for k in ("memory", "power_mw", "power_limit_mw", "energy_mj", "temperature_c", "sm_clock_mhz",
                  "mem_clock_mhz", "max_sm_clock_mhz", "utilization", "max_mig_device_count"):
            lines.append(f"  {k}: {fmt(g[k])}")
        lines.append("  GPU instance profiles:")
        for p in g["gpu_instance_profiles"]:
            info = p["info"]
            if "error" in info:
                lines.append(f"    {p['constant']:#04x} {p['constant_name']:<13} {fmt(info)}")
                continue
            lines.append(
                f"    {p['constant']:#04x} {p['constant_name']:<13} id={info['id']:<3} {info['name']:<16}"
                f" slices={info['sliceCount']} inst={info['instanceCount']} sm={info['multiprocessorCount']}"
                f" mem={info['memorySizeMB']}MB ce={info['copyEngineCount']} dec={info['decoderCount']}"
                f" enc={info['encoderCount']} jpg={info['jpegCount']} ofa={info['ofaCount']}"
                f" p2p={info['isP2pSupported']} placements={fmt(p['possible_placements'])}"
                f" remaining={fmt(p['remaining_capacity'])}"
            )
        lines.append(f"  GPU instances: {len(g['gpu_instances'])}")
        for gi in g["gpu_instances"]:
            if "error" in gi:
                lines.append(f"    profile {gi['profile_id']}: <{gi['error']}>")
                continue
            lines.append(
                f"    GI {gi['id']} profile {gi['profile_id']} placement {gi['placement']} "
                f"CIs {[(c['id'], c['profile_id'], c['placement']) for c in gi['compute_instances']]}"
            )
        lines.append("  MIG devices:")
        for m in g["mig_devices"]:
            if "error" in m:
                lines.append(f"    [{m['index']}] <{m['error']}>")
            else:
                lines.append(
                    f"    [{m['index']}] {fmt(m['name'])} {fmt(m['uuid'])} GI {fmt(m['gpu_instance_id'])}"
                    f" CI {fmt(m['compute_instance_id'])} mem {fmt(m['memory'])}"
                    f" util {fmt(m['utilization'])} power {fmt(m['power_mw'])}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("sim", "pynvml"), default="sim")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report = Probe(load_backend(args.backend)).run()
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else text_report(report))
    return 0 if "init" not in report else 1


if __name__ == "__main__":
    raise SystemExit(main())
