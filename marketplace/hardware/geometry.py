"""MIG geometry: the catalog data file, loaded once into plain immutable objects.

This module is pure Python (no Django) so that the simulator, the placement engine and the
benchmarks can use it without a database. The Django catalog (GpuModel, MigProfile) is seeded
from the same file by ``marketplace.services.catalog.sync_catalog``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).resolve().parent.parent / "data" / "catalog.json"


@dataclass(frozen=True)
class CiProfile:
    """A compute-instance profile inside a GPU instance. Its NVML profile id equals its constant."""

    nvml_constant: int  # NVML_COMPUTE_INSTANCE_PROFILE_* (0=1_SLICE, 1=2_SLICE, 2=3_SLICE, 3=4_SLICE, 4=7_SLICE)
    compute_slices: int
    max_count: int
    starts: tuple[int, ...]  # CI placements, in compute slices within the GI

    @property
    def profile_id(self) -> int:
        return self.nvml_constant


@dataclass(frozen=True)
class SimParams:
    """Simulator-only telemetry figures (catalog 'sim' block; not NVIDIA specifications)."""

    idle_watts: float = 70.0
    idle_temp_c: float = 33.0
    max_temp_c: float = 82.0
    sm_clock_idle_mhz: int = 345
    sm_clock_max_mhz: int = 1980
    mem_clock_mhz: int = 2619
    video_clock_mhz: int = 1545


@dataclass(frozen=True)
class Profile:
    name: str
    nvml_constant: int  # NVML_GPU_INSTANCE_PROFILE_* value passed to GetGpuInstanceProfileInfo
    profile_id: int  # info.id: what Create/Placements/GetGpuInstances take; nvidia-smi's "ID"
    memory_slices: int  # placement size
    compute_slices: int
    memory_gb: int
    memory_mib: int
    sm_count: int
    max_count: int
    starts: tuple[int, ...]
    media_extensions: bool
    # Added with the simulator (defaults keep older constructors working). Source S1 (MIG User Guide).
    copy_engines: int = 0
    decoders: int = 0
    jpegs: int = 0
    ofas: int = 0
    encoders: int = 0
    memory_fraction: str = ""
    l2_fraction: str = ""
    ci_profiles: tuple[CiProfile, ...] = ()  # compute-instance profiles this GI profile accepts

    def slots(self, start: int) -> range:
        return range(start, start + self.memory_slices)


@dataclass(frozen=True)
class GpuGeometry:
    key: str
    name: str
    nvml_name: str
    pci_device_id: int
    memory_gb: int
    memory_mib: int
    memory_slices: int
    compute_slices: int
    max_gpu_instances: int
    profiles: tuple[Profile, ...]
    tdp_watts: int = 700
    compute_capability: str = "9.0"
    sim: SimParams = SimParams()

    def profile_by_id(self, profile_id: int) -> Profile:
        for p in self.profiles:
            if p.profile_id == profile_id:
                return p
        raise KeyError(profile_id)

    def profile_by_name(self, name: str) -> Profile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise KeyError(name)

    def profile_by_constant(self, constant: int) -> Profile:
        for p in self.profiles:
            if p.nvml_constant == constant:
                return p
        raise KeyError(constant)


@cache
def raw_catalog() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA_FILE.read_text())
    return data


@cache
def all_geometries() -> dict[str, GpuGeometry]:
    data = raw_catalog()
    ci_table = {
        int(k): tuple(
            CiProfile(
                nvml_constant=c["nvml_constant"],
                compute_slices=c["compute_slices"],
                max_count=c["max_count"],
                starts=tuple(c["starts"]),
            )
            for c in v
        )
        for k, v in data.get("compute_instance_profiles", {}).items()
        if not k.startswith("_")
    }
    out: dict[str, GpuGeometry] = {}
    for m in data["gpu_models"]:
        profiles = tuple(
            Profile(
                name=p["name"],
                nvml_constant=p["nvml_constant"],
                profile_id=p["profile_id"],
                memory_slices=p["memory_slices"],
                compute_slices=p["compute_slices"],
                memory_gb=p["memory_gb"],
                memory_mib=p["memory_mib"],
                sm_count=p["sm_count"],
                max_count=p["max_count"],
                starts=tuple(p["starts"]),
                media_extensions=p["media_extensions"],
                copy_engines=p.get("copy_engines", 0),
                decoders=p.get("decoders", 0),
                jpegs=p.get("jpegs", 0),
                ofas=p.get("ofas", 0),
                encoders=p.get("encoders", 0),
                memory_fraction=p.get("memory_fraction", ""),
                l2_fraction=p.get("l2_fraction", ""),
                ci_profiles=ci_table.get(p["compute_slices"], ()),
            )
            for p in data["mig_profiles"][m["key"]]
        )
        out[m["key"]] = GpuGeometry(
            key=m["key"],
            name=m["name"],
            nvml_name=m["nvml_name"],
            pci_device_id=int(m["pci_device_id"], 16),
            memory_gb=m["memory_gb"],
            memory_mib=m["memory_mib"],
            memory_slices=m["memory_slices"],
            compute_slices=m["compute_slices"],
            max_gpu_instances=m["max_gpu_instances"],
            profiles=profiles,
            tdp_watts=m.get("tdp_watts", 700),
            compute_capability=m.get("compute_capability", "9.0"),
            sim=SimParams(**{k: v for k, v in m.get("sim", {}).items() if k != "source"}),
        )
    return out


def geometry(key: str) -> GpuGeometry:
    return all_geometries()[key]
