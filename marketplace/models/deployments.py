"""Triton model deployments: a tenant's model on one of its allocations (slice)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.scoping import TenantScopedQuerySet

from .orders import Allocation

LIVE_DEPLOYMENT_STATES = ("pending", "loading", "ready", "unloading", "failed")


class ModelDeployment(models.Model):
    class State(models.TextChoices):
        PENDING = "pending", "Pending"  # stored, task queued
        LOADING = "loading", "Loading"  # repository written, load requested
        READY = "ready", "Ready"  # Triton reports the model ready
        UNLOADING = "unloading", "Unloading"
        REMOVED = "removed", "Removed"
        FAILED = "failed", "Failed"

    allocation = models.ForeignKey(Allocation, on_delete=models.PROTECT, related_name="deployments")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="deployments")
    name = models.CharField(max_length=64)
    backend = models.CharField(max_length=32)
    spec = models.JSONField(help_text="the ModelSpec (config and files) Tessera writes to the repository")
    memory_mb = models.PositiveIntegerField(help_text="declared memory need on the slice")
    repository = models.ForeignKey("marketplace.ModelRepository", null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="deployments", help_text="the tenant's own repository it came from")
    library_model = models.ForeignKey("marketplace.LibraryModel", null=True, blank=True, on_delete=models.PROTECT,
                                      related_name="deployments", help_text="the library model it serves")
    adapters = models.ManyToManyField("marketplace.LoraAdapter", blank=True, related_name="deployments",
                                      help_text="LoRA adapters served with a library model (vLLM multi-LoRA)")
    context = models.PositiveIntegerField(default=0, help_text="max context (tokens) the fit reserved cache for")
    concurrency = models.PositiveIntegerField(default=1, help_text="concurrent sequences the fit reserved cache for")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    failure_reason = models.CharField(max_length=1000, blank=True)
    waiting_reason = models.CharField(max_length=300, blank=True,
                                      help_text="what a pending model waits for (the slice's server to be up)")
    waiting_since = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["allocation", "name"], condition=~models.Q(state="removed"),
                                    name="one_live_deployment_per_name_per_slice"),
        ]

    def __str__(self) -> str:
        return f"{self.name} on allocation {self.allocation_id} ({self.state})"
