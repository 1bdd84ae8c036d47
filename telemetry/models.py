"""Metering: usage events (idempotent by tenant + event id) and their hourly rollups; what Triton
itself reports it served, for comparison."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.scoping import TenantScopedQuerySet


class UsageEvent(models.Model):
    """One usage report from a tenant's inference gateway. (tenant, event_id) is the idempotency key."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="usage_events")
    deployment = models.ForeignKey("marketplace.ModelDeployment", on_delete=models.PROTECT, related_name="usage_events")
    event_id = models.CharField(max_length=100)
    ts = models.DateTimeField(help_text="when the inference happened (UTC)")
    input_tokens = models.BigIntegerField()
    output_tokens = models.BigIntegerField()
    requests = models.IntegerField(default=1)
    received_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "event_id"], name="usage_event_idempotency"),
            models.CheckConstraint(condition=models.Q(input_tokens__gte=0, output_tokens__gte=0, requests__gte=0),
                                   name="usage_event_non_negative"),
        ]
        indexes = [models.Index(fields=["tenant", "ts"])]

    def __str__(self) -> str:
        return f"{self.tenant_id}:{self.event_id}"


class UsageHourly(models.Model):
    """Usage per (tenant, deployment, hour), kept up to date as events arrive. `billed_*` is what a
    finalized invoice has charged for this hour; a late event makes the totals exceed it and the
    difference goes onto the next invoice as an adjustment."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="usage_hours")
    deployment = models.ForeignKey("marketplace.ModelDeployment", on_delete=models.PROTECT, related_name="usage_hours")
    hour = models.DateTimeField(help_text="start of the UTC hour")
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)
    events = models.BigIntegerField(default=0)
    billed_input_tokens = models.BigIntegerField(default=0)
    billed_output_tokens = models.BigIntegerField(default=0)
    billed_requests = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "deployment", "hour"], name="usage_hour_unique")]
        indexes = [models.Index(fields=["tenant", "hour"]), models.Index(fields=["hour"])]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.deployment_id}@{self.hour:%Y-%m-%d %H}"


class TritonServedHourly(models.Model):
    """What the slice's Triton server reports it served (from its inference statistics), per hour,
    so operators can compare it with what was metered."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    deployment = models.ForeignKey("marketplace.ModelDeployment", on_delete=models.CASCADE, related_name="served_hours")
    hour = models.DateTimeField()
    requests = models.BigIntegerField(default=0, help_text="inference_count increase within the hour")
    failures = models.BigIntegerField(default=0)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        constraints = [models.UniqueConstraint(fields=["deployment", "hour"], name="served_hour_unique")]

    def __str__(self) -> str:
        return f"{self.deployment_id}@{self.hour:%Y-%m-%d %H}: {self.requests}"


class TritonCounter(models.Model):
    """The last cumulative counters scraped from a deployment's Triton statistics (to take deltas;
    a counter that went down means the server restarted)."""

    deployment = models.OneToOneField("marketplace.ModelDeployment", on_delete=models.CASCADE,
                                      related_name="triton_counter")
    inference_count = models.BigIntegerField(default=0)
    fail_count = models.BigIntegerField(default=0)
    scraped_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.inference_count}"
