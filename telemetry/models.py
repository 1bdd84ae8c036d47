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
    latency_ms = models.PositiveIntegerField(null=True, blank=True,
                                             help_text="the gateway's time to the last byte; empty: reported usage")
    adapter = models.CharField(max_length=64, blank=True, default="",
                               help_text="the LoRA adapter the request selected (its name); empty: the base model")
    api_key = models.CharField(max_length=16, blank=True, default="",
                               help_text="the prefix of the API key the gateway served the request for; empty: "
                                         "none (reported usage, a portal session)")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "event_id"], name="usage_event_idempotency"),
            models.CheckConstraint(condition=models.Q(input_tokens__gte=0, output_tokens__gte=0, requests__gte=0),
                                   name="usage_event_non_negative"),
        ]
        indexes = [models.Index(fields=["tenant", "ts"]),
                   models.Index(fields=["deployment", "ts"], condition=models.Q(latency_ms__isnull=False),
                                name="usage_event_served_latency")]

    def __str__(self) -> str:
        return f"{self.tenant_id}:{self.event_id}"


class UsageHourly(models.Model):
    """Usage per (tenant, deployment, LoRA adapter, API key, hour), kept up to date as events arrive. `billed_*`
    is what a finalized invoice has charged for this hour; a late event makes the totals exceed it and the
    difference goes onto the next invoice as an adjustment. The API key (its prefix; empty: none) only splits the
    usage: the invoice's lines are per deployment and adapter, whatever the keys, each with its shares per key
    (billing.keys)."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="usage_hours")
    deployment = models.ForeignKey("marketplace.ModelDeployment", on_delete=models.PROTECT, related_name="usage_hours")
    hour = models.DateTimeField(help_text="start of the UTC hour")
    adapter = models.CharField(max_length=64, blank=True, default="",
                               help_text="the LoRA adapter's name; empty: the base model (an adapter is its own line)")
    api_key = models.CharField(max_length=16, blank=True, default="",
                               help_text="the prefix of the API key the usage was served for; empty: none")
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
        constraints = [models.UniqueConstraint(fields=["tenant", "deployment", "adapter", "api_key", "hour"],
                                               name="usage_hour_unique")]
        # (api_key, hour): a key's month (the gateway's per-key token allowance, at each snapshot refresh)
        indexes = [models.Index(fields=["tenant", "hour"]), models.Index(fields=["hour"]),
                   models.Index(fields=["api_key", "hour"], name="usage_hour_key")]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.deployment_id}@{self.hour:%Y-%m-%d %H}"


class UsageDaily(models.Model):
    """UsageHourly summed per (tenant, deployment, UTC day): a SECOND COPY of the hourly rollups, kept for speed
    (a 30-day chart reads ~30 rows a deployment instead of ~720). The database keeps it: triggers on
    telemetry_usagehourly (migration telemetry 0013_usage_daily) add every insert, update and
    delete of an hourly row's sums to its day, whoever writes it (ingest, the rating, a fixture, raw SQL), in the
    same transaction; a day's row goes when its last hour does. tests/unit/test_usage_daily.py holds it equal to
    the hourly rows' sums. Read only: never written by Python."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.DO_NOTHING, related_name="+", db_constraint=False)
    deployment = models.ForeignKey("marketplace.ModelDeployment", on_delete=models.DO_NOTHING, related_name="+",
                                   db_constraint=False)
    day = models.DateTimeField(help_text="start of the UTC day")
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)
    events = models.BigIntegerField(default=0)
    hours = models.IntegerField(default=0, help_text="how many hourly rows the day's sums are of")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "deployment", "day"], name="usage_day_unique")]
        indexes = [models.Index(fields=["day"])]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.deployment_id}@{self.day:%Y-%m-%d}"


class TritonServedHourly(models.Model):
    """What the slice's Triton server reports it served (from its inference statistics), per hour,
    so operators can compare it with what was metered."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    deployment = models.ForeignKey("marketplace.ModelDeployment", on_delete=models.CASCADE, related_name="served_hours")
    hour = models.DateTimeField()
    requests = models.BigIntegerField(default=0, help_text="inference_count increase within the hour")
    failures = models.BigIntegerField(default=0)
    execution_ns = models.BigIntegerField(
        default=0, help_text="model execution time within the hour (Triton batch_stats compute input+infer+output)")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        constraints = [models.UniqueConstraint(fields=["deployment", "hour"], name="served_hour_unique")]
        # the fleet's hours: the console's metered-vs-served page, the scrape's check and the planner read a
        # window of hours across every deployment
        indexes = [models.Index(fields=["hour"])]

    def __str__(self) -> str:
        return f"{self.deployment_id}@{self.hour:%Y-%m-%d %H}: {self.requests}"


class TritonCounter(models.Model):
    """The last cumulative counters scraped from a deployment's Triton statistics (to take deltas;
    a counter that went down means the server restarted)."""

    deployment = models.OneToOneField("marketplace.ModelDeployment", on_delete=models.CASCADE,
                                      related_name="triton_counter")
    inference_count = models.BigIntegerField(default=0)
    fail_count = models.BigIntegerField(default=0)
    execution_ns = models.BigIntegerField(default=0)
    scraped_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.inference_count}"


# --- GPU telemetry (NVML collector) -----------------------------------------------------------

class Resolution(models.TextChoices):
    RAW = "raw", "Raw (one per collection)"
    FIVE_MIN = "5m", "5-minute averages"
    HOUR = "1h", "Hourly averages"


class GpuSample(models.Model):
    """One GPU's telemetry at one time and resolution. Raw rows are what the collector read; 5m and
    1h rows are averages of the raw rows in the bucket (``samples`` of them), with ``energy_j`` the
    last cumulative counter value in the bucket. ``utilization`` is NVML's percent and is null under
    MIG (NotSupported); ``activity`` (0..1) is always set: utilization/100 when NVML reports it, else
    the compute-slice-weighted activity estimate of the GPU's slices (see MigSample)."""

    id = models.BigAutoField(primary_key=True)
    gpu = models.ForeignKey("marketplace.Gpu", on_delete=models.CASCADE, related_name="samples")
    resolution = models.CharField(max_length=3, choices=Resolution.choices, default=Resolution.RAW)
    ts = models.DateTimeField(help_text="raw: when read; rollups: start of the bucket (UTC)")
    samples = models.PositiveIntegerField(default=1)
    utilization = models.FloatField(null=True, blank=True)
    utilization_samples = models.PositiveIntegerField(default=0, help_text="how many had a utilization")
    activity = models.FloatField(default=0.0)
    memory_used_mb = models.FloatField()
    memory_total_mb = models.FloatField()
    power_w = models.FloatField()
    energy_j = models.FloatField(help_text="cumulative counter (since driver load)")
    temperature_c = models.FloatField()
    sm_clock_mhz = models.FloatField()
    mig = models.BooleanField(default=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu", "resolution", "ts"], name="gpu_sample_unique")]
        indexes = [models.Index(fields=["resolution", "ts"])]

    def __str__(self) -> str:
        return f"{self.gpu_id}/{self.resolution}@{self.ts:%Y-%m-%d %H:%M}"


class NodeActivity(models.Model):
    """GpuSample's activity summed per (node, resolution, time): a SECOND COPY of the GPU samples, kept for speed
    (the per-node heatmap reads ~8x fewer rows than one a GPU, with no join). The database keeps it: triggers on
    telemetry_gpusample (migration telemetry 0014_node_activity) add every insert, update and delete of a sample
    to its node's row in the same transaction, whoever writes it (the collector, the downsampler, the pruner, a
    fixture); a row goes when its last sample does. tests/unit/test_node_activity.py holds it equal to the
    samples' sums. Read only: never written by Python."""

    id = models.BigAutoField(primary_key=True)
    node = models.ForeignKey("marketplace.Node", on_delete=models.DO_NOTHING, related_name="+", db_constraint=False)
    resolution = models.CharField(max_length=3, choices=Resolution.choices)
    ts = models.DateTimeField()
    activity_samples = models.FloatField(default=0.0, help_text="sum of activity x samples over the node's GPUs")
    samples = models.BigIntegerField(default=0)
    gpus = models.IntegerField(default=0, help_text="how many GPU samples the sums are of")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "resolution", "ts"], name="node_activity_unique")]
        indexes = [models.Index(fields=["resolution", "ts"])]

    def __str__(self) -> str:
        return f"{self.node_id}/{self.resolution}@{self.ts:%Y-%m-%d %H:%M}"


class MigSample(models.Model):
    """One slice's (MIG instance, or a whole-GPU allocation) memory and estimated activity. NVML has
    no per-slice utilization without GPM/DCGM, so ``activity`` (0..1) is estimated from metering:
    tokens metered on the slice's deployments over the last hour, per second, over the tier's
    capacity in tokens/s (telemetry.services.collector.tier_capacity_tokens_per_s)."""

    id = models.BigAutoField(primary_key=True)
    gpu = models.ForeignKey("marketplace.Gpu", on_delete=models.CASCADE, related_name="mig_samples")
    mig_uuid = models.CharField(max_length=64, help_text="MIG device UUID; the GPU's UUID for a whole GPU")
    gi_id = models.IntegerField(null=True, blank=True)
    compute_slices = models.PositiveSmallIntegerField(default=0, help_text="of 7; 7 for a whole GPU")
    allocation = models.ForeignKey("marketplace.Allocation", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    resolution = models.CharField(max_length=3, choices=Resolution.choices, default=Resolution.RAW)
    ts = models.DateTimeField()
    samples = models.PositiveIntegerField(default=1)
    memory_used_mb = models.FloatField()
    memory_total_mb = models.FloatField()
    activity = models.FloatField(default=0.0)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu", "mig_uuid", "resolution", "ts"],
                                               name="mig_sample_unique")]
        indexes = [models.Index(fields=["resolution", "ts"]), models.Index(fields=["tenant", "resolution", "ts"]),
                   models.Index(fields=["gpu", "resolution", "ts"], name="mig_sample_gpu_time")]

    def __str__(self) -> str:
        return f"{self.mig_uuid}/{self.resolution}@{self.ts:%Y-%m-%d %H:%M}"


class CollectorError(models.Model):
    """A failed NVML read of one GPU (the collector records it and goes on with the others);
    ``count`` per (gpu, kind) is the Prometheus counter."""

    gpu = models.ForeignKey("marketplace.Gpu", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=80)
    count = models.BigIntegerField(default=0)
    last_message = models.CharField(max_length=500, blank=True)
    last_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu", "kind"], name="collector_error_unique")]

    def __str__(self) -> str:
        return f"{self.gpu_id} {self.kind} x{self.count}"


class UsageRefusal(models.Model):
    """Usage stream (or spool) entries the consumer refused and never billed, per reason (unsigned, malformed,
    unknown_key, forged: marketplace.gateway.signing); ``count`` is the Prometheus counter
    tessera_usage_refused_total."""

    reason = models.CharField(max_length=24, unique=True)
    count = models.BigIntegerField(default=0)
    last_at = models.DateTimeField(default=timezone.now)
    last_detail = models.CharField(max_length=500, blank=True, help_text="the last refused entry (id, source)")

    def __str__(self) -> str:
        return f"{self.reason} x{self.count}"


class EnergyRows(models.Model):
    """The rows of an energy rollup: with a GPU, that GPU's kWh in the period and the part no slice held
    (``unallocated_kwh``); without, one allocation's (or tenant's) compute-share kWh across the fleet; one row
    with neither and 0 kWh marks the period as rolled up."""

    id = models.BigAutoField(primary_key=True)
    gpu = models.ForeignKey("marketplace.Gpu", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    allocation = models.ForeignKey("marketplace.Allocation", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    kwh = models.FloatField(default=0.0)
    unallocated_kwh = models.FloatField(default=0.0)

    class Meta:
        abstract = True


class EnergyHourly(EnergyRows):
    """Energy of one completed UTC hour, apportioned once by the downsampling job (telemetry.services.energy
    rollup_hours) so that long-range power charts sum rows instead of re-reading every sample."""

    hour = models.DateTimeField(help_text="start of the UTC hour")

    class Meta:
        indexes = [models.Index(fields=["hour"]),
                   # the hours rolled up (one marker row each): what a chart checks before reading the rollup
                   models.Index(fields=["hour"], name="energy_hourly_marker",
                                condition=models.Q(gpu__isnull=True, allocation__isnull=True, tenant__isnull=True))]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}: {self.kwh:.3f} kWh"


class EnergyDaily(EnergyRows):
    """EnergyHourly summed per completed UTC day (telemetry.services.energy.rollup_days), once all 24 of its
    hours are rolled up: month-long power charts sum 30 rows per GPU and allocation instead of 720."""

    day = models.DateTimeField(help_text="start of the UTC day")

    class Meta:
        indexes = [models.Index(fields=["day"])]

    def __str__(self) -> str:
        return f"{self.day:%Y-%m-%d}: {self.kwh:.3f} kWh"


# --- The capacity planner's measurements, rolled up per hour (marketplace.services.planner_rollup) ----------

class PlannerRollupHour(models.Model):
    """One completed UTC hour whose planner figures are rolled up (PlannerShapeHourly, PlannerPowerHourly and,
    once its day is whole, PlannerDemandDaily). ``rolled_at`` is when it was read: usage rows updated after
    it (late events) make the downsampling job roll the hour again."""

    hour = models.DateTimeField(unique=True, help_text="start of the UTC hour")
    rolled_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H} rolled {self.rolled_at:%Y-%m-%d %H:%M}"


class PlannerRollupDay(models.Model):
    """One UTC day whose PlannerDemandDaily rows are written from all 24 of its rolled-up hours. Rolling one of
    its hours again deletes this marker in the hour's transaction, so a run stopped between its hours and its
    days leaves the day unmarked (read from the usage rows) until a later run writes it again."""

    day = models.DateTimeField(unique=True, help_text="start of the UTC day")
    rolled_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.day:%Y-%m-%d} rolled {self.rolled_at:%Y-%m-%d %H:%M}"


class PlannerShapeHourly(models.Model):
    """One hour's measuring sums for one shape (the tier's GPU model and MIG profile; no profile: a whole GPU),
    each additive over hours (the busiest slice-hour is a maximum): metered tokens and requests on the
    (deployment, hour) pairs Triton reported execution for, Triton's execution time and requests on the pairs
    that were metered, the busiest allocation's tokens, and all metered input and output tokens."""

    id = models.BigAutoField(primary_key=True)
    hour = models.DateTimeField(help_text="start of the UTC hour")
    gpu_model = models.ForeignKey("marketplace.GpuModel", null=True, blank=True, on_delete=models.CASCADE,
                                  related_name="+")
    profile = models.ForeignKey("marketplace.MigProfile", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="+")
    tokens = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)
    execution_ns = models.BigIntegerField(default=0)
    served_requests = models.BigIntegerField(default=0)
    peak_tokens = models.BigIntegerField(default=0, help_text="the busiest allocation's tokens in the hour")
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)

    class Meta:
        indexes = [models.Index(fields=["hour"])]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H} {self.gpu_model_id}/{self.profile_id}: {self.tokens}"


class PlannerPowerHourly(models.Model):
    """One hour's least-squares sums of power against activity over one GPU model's samples of one
    resolution (n, Σx, Σy, Σx², Σxy): additive, so a window's power line is fitted from its hours' sums."""

    id = models.BigAutoField(primary_key=True)
    hour = models.DateTimeField(help_text="start of the UTC hour")
    gpu_model = models.ForeignKey("marketplace.GpuModel", on_delete=models.CASCADE, related_name="+")
    resolution = models.CharField(max_length=3, choices=Resolution.choices)
    n = models.BigIntegerField(default=0)
    sx = models.FloatField(default=0.0)
    sy = models.FloatField(default=0.0)
    sxx = models.FloatField(default=0.0)
    sxy = models.FloatField(default=0.0)

    class Meta:
        indexes = [models.Index(fields=["resolution", "hour"])]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H} {self.gpu_model_id}/{self.resolution}: {self.n}"


class PlannerDemandDaily(models.Model):
    """One UTC day's busiest hour of one tenant's model name (all its deployments of that name together), in
    tokens, written once all 24 hours of the day are rolled up (PlannerRollupHour; the day's marker is
    PlannerRollupDay): the day's maximum of the hourly sums, so a window's busiest hour is the maximum over its
    days and the hours around them."""

    id = models.BigAutoField(primary_key=True)
    day = models.DateTimeField(help_text="start of the UTC day")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=64, help_text="the deployment name")
    tokens = models.BigIntegerField(default=0)

    class Meta:
        indexes = [models.Index(fields=["day"])]

    def __str__(self) -> str:
        return f"{self.day:%Y-%m-%d} {self.tenant_id}/{self.name}: {self.tokens}"
