"""Orders and allocations with their lifecycle, and the event history of each allocation.

requested -> placed -> provisioning -> ready -> active -> releasing -> released; any step but
released can go to failed. Transitions are made only by services.allocations (one function each).

Tenants read their allocations and events: ``reason``, ``placement_reason`` and ``failure_reason``
are written for them; what only operators may read (the placement engine's diagnostic, with GPU and
node ids and fleet figures) goes to ``detail`` / ``placement_detail``.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from tenants.scoping import TenantScopedQuerySet

from .fleet import GpuInstance, Node
from .offers import PricePlan, Tier


class Order(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="orders")
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="orders")
    plan_kind = models.CharField(max_length=16, choices=PricePlan.Kind.choices, default=PricePlan.Kind.ON_DEMAND)
    quantity = models.PositiveSmallIntegerField(default=1)
    idempotency_key = models.CharField(max_length=100, blank=True,
                                       help_text="client key: re-sending the same order returns the first one")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "idempotency_key"], condition=~models.Q(idempotency_key=""),
                                    name="order_idempotency_key_unique"),
            models.CheckConstraint(condition=models.Q(quantity__gte=1, quantity__lte=64), name="order_quantity_range"),
        ]

    def __str__(self) -> str:
        return f"order {self.pk} {self.tenant_id} {self.tier_id} x{self.quantity}"


class Allocation(models.Model):
    class State(models.TextChoices):
        REQUESTED = "requested", "Requested"
        PLACED = "placed", "Placed"
        PROVISIONING = "provisioning", "Provisioning"
        READY = "ready", "Ready"
        ACTIVE = "active", "Active"
        RELEASING = "releasing", "Releasing"
        RELEASED = "released", "Released"
        FAILED = "failed", "Failed"

    order = models.ForeignKey(Order, on_delete=models.PROTECT, related_name="allocations")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="allocations")
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="allocations")
    state = models.CharField(max_length=16, choices=State.choices, default=State.REQUESTED)
    instance = models.OneToOneField(GpuInstance, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="allocation")
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.PROTECT, related_name="allocations")
    gpu_uuid = models.CharField(max_length=64, blank=True)
    mig_uuid = models.CharField(max_length=64, blank=True)
    start = models.PositiveSmallIntegerField(null=True, blank=True)
    size = models.PositiveSmallIntegerField(null=True, blank=True)
    placement_reason = models.CharField(max_length=500, blank=True,
                                        help_text="tenant-safe: what was placed, on which kind of GPU")
    placement_detail = models.CharField(max_length=500, blank=True,
                                        help_text="operators only: the placement engine's diagnostic")
    triton_url = models.CharField(max_length=200, blank=True, editable=False,
                                  help_text="HTTP endpoint of the slice's Triton server, set when the node worker "
                                            "has started it")
    triton_metrics_url = models.CharField(max_length=200, blank=True, editable=False,
                                          help_text="its Prometheus metrics endpoint")
    failure_reason = models.CharField(max_length=1000, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    activated_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["state", "updated_at"]), models.Index(fields=["tenant", "state"])]

    def __str__(self) -> str:
        return f"allocation {self.pk} ({self.state})"


# An allocation that holds (or is about to hold, or is giving back) a slice.
LIVE_STATES = (
    Allocation.State.REQUESTED,
    Allocation.State.PLACED,
    Allocation.State.PROVISIONING,
    Allocation.State.READY,
    Allocation.State.ACTIVE,
    Allocation.State.RELEASING,
)


def live_slices(path: str = "") -> Coalesce:
    """What counts against a tenant's slice quotas, as an aggregate over allocations (``path``: the lookup from the
    aggregated model to Allocation, e.g. ``"allocations__"`` from Tenant): a live slice or whole GPU counts 1, a
    live multi-GPU allocation its GPUs (``Tier.gpu_count``). orders.check_quota, the console's tenant pages use it."""
    return Coalesce(Sum(f"{path}tier__gpu_count", filter=models.Q(**{f"{path}state__in": LIVE_STATES})), 0)


class AllocationEvent(models.Model):
    allocation = models.ForeignKey(Allocation, on_delete=models.CASCADE, related_name="events")
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    actor = models.CharField(max_length=200, help_text='"user:<email>", "key:<prefix>", "task:<name>", "reconcile"')
    reason = models.CharField(max_length=1000, blank=True, help_text="tenant-safe: why, as the tenant may read it")
    detail = models.CharField(max_length=1000, blank=True,
                              help_text="operators only: the diagnostic (GPU and node ids, fleet figures)")
    at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "allocation__tenant_id"

    class Meta:
        ordering = ["at", "pk"]

    def __str__(self) -> str:
        return f"{self.allocation_id}: {self.from_state or '-'} -> {self.to_state}"


class DriftEvent(models.Model):
    """What reconcile found different between the database and a node's NVML, and what it did."""

    class Kind(models.TextChoices):
        ORPHAN_DESTROYED = "orphan_destroyed", "Orphan GPU instance destroyed"
        MISSING_RECREATED = "missing_recreated", "Missing GPU instance re-created"
        ADOPTED = "adopted", "GPU instance adopted"
        STUCK_REQUEUED = "stuck_requeued", "Stuck allocation re-queued"
        MODEL_RELOADED = "model_reloaded", "Model reloaded on its Triton server"
        SERVER_RESTARTED = "server_restarted", "Dead Triton server restarted"
        SERVER_STOPPED = "server_stopped", "Triton server without a live slice stopped"
        MODEL_UNLOADED = "model_unloaded", "Model Tessera did not deploy unloaded"
        SANDBOX_LIMIT = "sandbox_limit", "Model stopped at its sandbox's limit"
        MODEL_RESTARTED = "model_restarted", "Model whose processes died loaded again"
        METERING_MISMATCH = "metering_mismatch", "Metered requests differ from what Triton served"
        UNREACHABLE = "unreachable", "Node unreachable"
        ERROR = "error", "Reconcile error"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="drift_events")
    gpu_index = models.PositiveSmallIntegerField(null=True, blank=True)
    kind = models.CharField(max_length=24, choices=Kind.choices)
    detail = models.CharField(max_length=1000)
    allocation = models.ForeignKey(Allocation, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    at = models.DateTimeField(default=timezone.now)
    resolved = models.BooleanField(default=True, help_text="false: needs an operator")

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.node_id} {self.kind}"
