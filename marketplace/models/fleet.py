"""The fleet: nodes (one Celery queue each), their GPUs, GPU instances and slot occupancy.

Overlap is impossible by construction: every GPU instance owns one GpuSlot row per memory slice
it covers, and (gpu, slot) is unique, so two instances that share a slice cannot both commit, even
from concurrent transactions. At most one +me instance per GPU is a partial unique constraint.
Illegal starts cannot be stored because an instance references a MigPlacement row.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.scoping import TenantScopedQuerySet

from .catalog import GpuModel, MigPlacement, ServerPlatform


class Node(models.Model):
    class State(models.TextChoices):
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        OFFLINE = "offline", "Offline"
        MAINTENANCE = "maintenance", "Maintenance"

    hostname = models.CharField(max_length=253, unique=True)
    platform = models.ForeignKey(ServerPlatform, on_delete=models.PROTECT, related_name="nodes")
    queue = models.CharField(max_length=200, unique=True, help_text="Celery queue its worker consumes")
    state = models.CharField(max_length=16, choices=State.choices, default=State.READY)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    serving_address = models.GenericIPAddressField(
        default="127.0.0.1", help_text="the node-private address its slices' Triton servers bind")
    serving_port_min = models.PositiveIntegerField(default=20000, help_text="first port of its servers' pool")
    serving_port_max = models.PositiveIntegerField(default=20999, help_text="last port of its servers' pool")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["hostname"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(serving_port_min__gte=1024, serving_port_max__lte=65535,
                                   serving_port_max__gte=models.F("serving_port_min") + 2),
                name="node_serving_port_pool_valid"),
        ]

    def __str__(self) -> str:
        return self.hostname

    @staticmethod
    def queue_for(hostname: str) -> str:
        return f"node.{hostname}"


class Gpu(models.Model):
    class State(models.TextChoices):
        OK = "ok", "OK"
        FAULTED = "faulted", "Faulted"
        MAINTENANCE = "maintenance", "Maintenance"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64, unique=True)
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="gpus")
    mig_mode = models.BooleanField(default=True, help_text="MIG enabled (slices); off = sold whole")
    state = models.CharField(max_length=16, choices=State.choices, default=State.OK)
    dedicated_tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.SET_NULL,
                                         related_name="dedicated_gpus")
    dedicated_sticky = models.BooleanField(
        default=False, help_text="an operator's reservation: stays dedicated when the GPU is empty")
    numa_node = models.SmallIntegerField(
        null=True, blank=True, help_text="the NUMA node NVML reports (memory affinity); empty: not reported, "
                                         "group placement uses the platform's table")
    nvlink_domain = models.SmallIntegerField(
        null=True, blank=True, help_text="GPUs of one node with the same value are NVLink peers (NVML P2P status); "
                                         "empty with numa_node set: no NVLink peer")

    class Meta:
        ordering = ["node__hostname", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_index_unique_per_node")]

    def __str__(self) -> str:
        return self.label

    @staticmethod
    def label_for(hostname: str, index: int) -> str:
        """The one way every page names a GPU: its node and its NVML index, as nvidia-smi shows it."""
        return f"{hostname} · GPU {index}"

    @property
    def label(self) -> str:
        return Gpu.label_for(self.node.hostname, self.index)


class GpuInstance(models.Model):
    """A GPU instance (MIG slice) or a whole GPU (placement empty, all 8 slots) held by a tenant."""

    class State(models.TextChoices):
        RESERVED = "reserved", "Reserved"  # slots held in the DB, nothing on the GPU yet
        CREATED = "created", "Created"  # exists on the GPU (GI + CI, MIG UUID known)
        DESTROYING = "destroying", "Destroying"

    gpu = models.ForeignKey(Gpu, on_delete=models.PROTECT, related_name="instances")
    placement = models.ForeignKey(MigPlacement, null=True, blank=True, on_delete=models.PROTECT,
                                  related_name="+", help_text="empty: the whole GPU (MIG off)")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="gpu_instances")
    start = models.PositiveSmallIntegerField()
    size = models.PositiveSmallIntegerField()
    media_extensions = models.BooleanField(default=False)
    state = models.CharField(max_length=16, choices=State.choices, default=State.RESERVED)
    gi_id = models.IntegerField(null=True, blank=True)
    ci_id = models.IntegerField(null=True, blank=True)
    mig_uuid = models.CharField(max_length=64, blank=True)
    reason = models.CharField(max_length=500, blank=True, help_text="why the engine chose this GPU and start")
    group_lead = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="group_members",
        help_text="a multi-GPU group's other GPUs point to its first one (the allocation's instance); "
                  "releasing the first releases them all")
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"
    #: not stored: the tenant-safe account of the placement, set by services.fleet.place_instance on the
    #: instance it returns (``reason`` is the operators' diagnostic)
    summary: str

    class Meta:
        ordering = ["gpu_id", "start"]
        constraints = [
            models.UniqueConstraint(fields=["gpu"], condition=models.Q(media_extensions=True),
                                    name="one_media_extension_instance_per_gpu"),
            models.CheckConstraint(condition=models.Q(size__gte=1) & models.Q(start__lte=8 - models.F("size")),
                                   name="instance_within_gpu"),
            models.CheckConstraint(
                condition=models.Q(placement__isnull=False) | models.Q(start=0, size=8),
                name="whole_gpu_spans_all_slots"),
        ]

    def __str__(self) -> str:
        what = "whole GPU" if self.placement_id is None else f"{self.start}:{self.size}"
        return f"{self.gpu} {what}"

    @property
    def slot_range(self) -> range:
        return range(self.start, self.start + self.size)


class GpuSlot(models.Model):
    """Occupancy of one memory slice (0..7) of one GPU. Unique per (gpu, slot): no overlap."""

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="slots")
    slot = models.PositiveSmallIntegerField()
    instance = models.ForeignKey(GpuInstance, on_delete=models.CASCADE, related_name="slots")

    class Meta:
        ordering = ["gpu_id", "slot"]
        constraints = [
            models.UniqueConstraint(fields=["gpu", "slot"], name="gpu_slot_unique"),
            models.CheckConstraint(condition=models.Q(slot__lte=7), name="gpu_slot_range"),
        ]

    def __str__(self) -> str:
        return f"{self.gpu_id}:{self.slot}"
