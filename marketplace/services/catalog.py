"""Writes for the catalog: upsert GPU models, MIG profiles, placements and platforms from the data file."""

from __future__ import annotations

from decimal import Decimal

from django.db import transaction

from marketplace.hardware.geometry import raw_catalog
from marketplace.models import GpuModel, MigPlacement, MigProfile, ServerPlatform

MODEL_FIELDS = ["name", "nvml_name", "pci_device_id", "memory_gb", "memory_mib", "tdp_watts", "sm_count", "fp8",
                "memory_slices", "compute_slices", "max_gpu_instances"]
PLATFORM_FIELDS = ["name", "gpu_count", "vendor", "model", "interconnect", "cpu", "system_memory", "power",
                   "form_factor", "source_url"]
PROFILE_FIELDS = ["name", "nvml_constant", "memory_slices", "compute_slices", "memory_gb", "memory_mib",
                  "sm_count", "max_count", "media_extensions"]


@transaction.atomic
def sync_catalog(data: dict | None = None) -> dict[str, int]:
    """Idempotent: running it twice changes nothing; a corrected figure in the file is applied."""
    data = data or raw_catalog()
    counts = {"gpu_models": 0, "profiles": 0, "placements": 0, "platforms": 0}
    for m in data["gpu_models"]:
        model, _ = GpuModel.objects.update_or_create(
            key=m["key"],
            defaults={**{f: m[f] for f in MODEL_FIELDS}, "bandwidth_tbps": Decimal(m["bandwidth_tbps"])},
        )
        counts["gpu_models"] += 1
        for p in data["mig_profiles"][m["key"]]:
            profile, _ = MigProfile.objects.update_or_create(
                gpu_model=model, profile_id=p["profile_id"], defaults={f: p[f] for f in PROFILE_FIELDS}
            )
            counts["profiles"] += 1
            MigPlacement.objects.filter(profile=profile).exclude(start__in=p["starts"]).delete()
            for start in p["starts"]:
                MigPlacement.objects.update_or_create(profile=profile, start=start,
                                                      defaults={"size": p["memory_slices"]})
                counts["placements"] += 1
    for pl in data["platforms"]:
        ServerPlatform.objects.update_or_create(
            key=pl["key"],
            defaults={**{f: pl.get(f, "") for f in PLATFORM_FIELDS},
                      "gpu_model": GpuModel.objects.get(key=pl["gpu_model"])},
        )
        counts["platforms"] += 1
    return counts
