"""The GPU catalog: models, MIG profiles with their legal placements, server platforms.
Seeded from marketplace/data/catalog.json by services.catalog.sync_catalog (figures sourced there)."""

from __future__ import annotations

from django.db import models


class GpuModel(models.Model):
    key = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=80)
    nvml_name = models.CharField(max_length=80, help_text="what nvmlDeviceGetName returns")
    pci_device_id = models.CharField(max_length=12)
    memory_gb = models.PositiveIntegerField()
    memory_mib = models.PositiveIntegerField()
    bandwidth_tbps = models.DecimalField(max_digits=5, decimal_places=2)
    tdp_watts = models.PositiveIntegerField()
    sm_count = models.PositiveIntegerField()
    fp8 = models.BooleanField(default=True)
    memory_slices = models.PositiveSmallIntegerField(default=8)
    compute_slices = models.PositiveSmallIntegerField(default=7)
    max_gpu_instances = models.PositiveSmallIntegerField(default=7)

    class Meta:
        ordering = ["memory_gb", "key"]

    def __str__(self) -> str:
        return self.name


class MigProfile(models.Model):
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.CASCADE, related_name="profiles")
    name = models.CharField(max_length=24)
    nvml_constant = models.PositiveSmallIntegerField(help_text="NVML_GPU_INSTANCE_PROFILE_* value")
    profile_id = models.PositiveSmallIntegerField(help_text="info.id, nvidia-smi's ID; what Create takes")
    memory_slices = models.PositiveSmallIntegerField()
    compute_slices = models.PositiveSmallIntegerField()
    memory_gb = models.PositiveIntegerField()
    memory_mib = models.PositiveIntegerField()
    sm_count = models.PositiveIntegerField()
    max_count = models.PositiveSmallIntegerField()
    media_extensions = models.BooleanField(default=False)

    class Meta:
        ordering = ["gpu_model", "memory_slices", "compute_slices", "name"]
        constraints = [
            models.UniqueConstraint(fields=["gpu_model", "profile_id"], name="profile_id_unique_per_model"),
            models.UniqueConstraint(fields=["gpu_model", "name"], name="profile_name_unique_per_model"),
            models.CheckConstraint(condition=models.Q(memory_slices__gte=1, memory_slices__lte=8),
                                   name="profile_memory_slices_range"),
            models.CheckConstraint(condition=models.Q(compute_slices__gte=1, compute_slices__lte=7),
                                   name="profile_compute_slices_range"),
        ]

    def __str__(self) -> str:
        return f"{self.gpu_model.key} {self.name}"


class MigPlacement(models.Model):
    """One legal (start, size) for a profile, in memory slices. A GPU instance references one of
    these rows, so an illegal start cannot be stored."""

    profile = models.ForeignKey(MigProfile, on_delete=models.CASCADE, related_name="placements")
    start = models.PositiveSmallIntegerField()
    size = models.PositiveSmallIntegerField()

    class Meta:
        ordering = ["profile", "start"]
        constraints = [
            models.UniqueConstraint(fields=["profile", "start"], name="placement_unique"),
            models.CheckConstraint(condition=models.Q(size__gte=1) & models.Q(start__lte=8 - models.F("size")),
                                   name="placement_within_gpu"),
        ]

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}:{self.size}"


class ServerPlatform(models.Model):
    key = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=120)
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="platforms")
    gpu_count = models.PositiveSmallIntegerField()
    vendor = models.CharField(max_length=60, blank=True)
    model = models.CharField(max_length=120, blank=True, help_text="the vendor's model name")
    interconnect = models.CharField(max_length=200, blank=True, help_text="GPU-to-GPU: NVLink / NVSwitch")
    cpu = models.CharField(max_length=200, blank=True)
    system_memory = models.CharField(max_length=120, blank=True)
    power = models.CharField(max_length=120, blank=True)
    form_factor = models.CharField(max_length=120, blank=True)
    source_url = models.URLField(max_length=300, blank=True, help_text="public source of these figures")

    class Meta:
        ordering = ["vendor", "key"]

    def __str__(self) -> str:
        return self.name
