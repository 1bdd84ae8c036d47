"""What the MSP sells: tiers (GPU model + MIG profile, or a whole GPU) and their price plans.

A plan is in force from `effective_from` until the next plan of the same tier, kind and currency
starts. A price change is a new plan row; rows whose time has come are never edited, so rating
an old hour always finds the price of that hour.
"""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from tenants.models import CURRENCIES

from .catalog import GpuModel, MigProfile

ZERO = 0
#: GPUs a multi-GPU tier may sell together (marketplace.placement_groups.GROUP_SIZES says the same)
GPU_GROUP_SIZES = (1, 2, 4, 8)


class Tier(models.Model):
    key = models.SlugField(max_length=60, unique=True)
    name = models.CharField(max_length=120, help_text='e.g. "H200 premium 3g.71gb"')
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="tiers")
    profile = models.ForeignKey(MigProfile, null=True, blank=True, on_delete=models.PROTECT, related_name="tiers",
                                help_text="empty: the whole GPU (MIG off)")
    dedicated = models.BooleanField(default=False, help_text="slices of this tier never share a GPU with others")
    gpu_count = models.PositiveSmallIntegerField(
        default=1, choices=[(n, f"{n} GPU{'s' if n > 1 else ''}") for n in GPU_GROUP_SIZES],
        help_text="whole GPUs per allocation (MIG off, one node, one NVLink domain; prices are per group-hour); "
                  "1 for a slice tier")
    description = models.TextField(blank=True)
    allowed_backends = models.CharField(
        max_length=200, default="python,onnxruntime,vllm,tensorrtllm,ensemble",
        help_text="Triton backends tenants may deploy on this tier (comma-separated; the MSP chooses)")
    host_memory_mib = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(256)],
        help_text="host memory (MiB) a slice's sandbox may use, its models' processes, /tmp and /dev/shm together; "
                  "empty: as much as the slice has GPU memory")
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["gpu_model__memory_gb", "key"]
        constraints = [
            models.CheckConstraint(condition=models.Q(gpu_count__in=GPU_GROUP_SIZES), name="tier_gpu_count_group_size"),
            models.CheckConstraint(condition=models.Q(gpu_count=1) | models.Q(profile__isnull=True),
                                   name="tier_group_is_whole_gpus"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def memory_gb(self) -> int:
        """GPU memory of one allocation: the slice's, or every GPU of the group's. Its SQL twin is
        :func:`memory_gb_sums` (check_quota's), held equal by tests/unit/test_group_orders.py's property test."""
        profile = self.profile  # None without a query when profile_id is None
        return profile.memory_gb if profile is not None else self.gpu_model.memory_gb * self.gpu_count

    @property
    def backends(self) -> list[str]:
        return [b.strip() for b in self.allowed_backends.split(",") if b.strip()]

    @property
    def memory_mib(self) -> int:
        profile = self.profile
        return profile.memory_mib if profile is not None else self.gpu_model.memory_mib * self.gpu_count

    @property
    def gpu_memory_mib(self) -> int:
        """Memory of one GPU (or the slice) of an allocation: what one tensor-parallel rank may use."""
        profile = self.profile
        return profile.memory_mib if profile is not None else self.gpu_model.memory_mib

    @property
    def host_memory_allowance_mib(self) -> int:
        """The host memory a slice of this tier may use (its sandbox's limit)."""
        return self.host_memory_mib or self.memory_mib


class PricePlan(models.Model):
    class Kind(models.TextChoices):
        ON_DEMAND = "on_demand", "On demand"
        RESERVED = "reserved", "Reserved (monthly commit)"

    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="plans")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.ON_DEMAND)
    currency = models.CharField(max_length=3, choices=CURRENCIES, default="USD")
    price_per_slice_hour = models.DecimalField(max_digits=12, decimal_places=4, validators=[MinValueValidator(0)])
    price_per_1m_input_tokens = models.DecimalField(max_digits=12, decimal_places=4,
                                                    validators=[MinValueValidator(0)])
    price_per_1m_output_tokens = models.DecimalField(max_digits=12, decimal_places=4,
                                                     validators=[MinValueValidator(0)])
    monthly_commit = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True,
                                         validators=[MinValueValidator(0)],
                                         help_text="reserved plans: minimum billed per month")
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["tier", "kind", "currency", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["tier", "kind", "currency", "effective_from"], name="plan_unique_start"),
            models.CheckConstraint(
                condition=models.Q(kind="on_demand", monthly_commit__isnull=True)
                | models.Q(kind="reserved", monthly_commit__isnull=False),
                name="plan_commit_only_when_reserved"),
        ]

    def __str__(self) -> str:
        return f"{self.tier.key} {self.kind} {self.currency} from {self.effective_from:%Y-%m-%d}"


def memory_gb_sums(prefix: str = "tier__") -> dict:
    """The SQL twin of :attr:`Tier.memory_gb`, summed over allocations (``prefix``: the path to the tier): the
    slices' profile memory plus the whole-GPU tiers' GPU memory times their GPU count. Aggregate both and add them
    (None: nothing of that kind). Held equal to the Python rule by a property test."""
    from django.db.models import F, Q, Sum

    return {"mem_profile": Sum(f"{prefix}profile__memory_gb", filter=Q(**{f"{prefix}profile__isnull": False})),
            "mem_whole": Sum(F(f"{prefix}gpu_model__memory_gb") * F(f"{prefix}gpu_count"),
                             filter=Q(**{f"{prefix}profile__isnull": True}))}
