"""Tenancy data: users, tenants (with quotas), memberships, invitations, API keys."""

from __future__ import annotations

from decimal import Decimal
from typing import ClassVar

from django.conf import settings
from django.contrib.auth.models import AbstractUser, BaseUserManager
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models.functions import Lower
from django.utils import timezone

from .roles import Role
from .scoping import TenantScopedQuerySet


class UserManager(BaseUserManager):
    use_in_migrations = True

    def _create(self, email, password, **extra):
        if not email:
            raise ValueError("email is required")
        user = self.model(email=self.normalize_email(email).lower(), **extra)
        user.set_password(password)
        user.save(using=self._db)
        return user

    def create_user(self, email, password=None, **extra):
        extra.setdefault("is_staff", False)
        extra.setdefault("is_superuser", False)
        return self._create(email, password, **extra)

    def create_superuser(self, email, password=None, **extra):
        extra.setdefault("is_staff", True)
        extra.setdefault("is_superuser", True)
        return self._create(email, password, **extra)


class User(AbstractUser):
    """A person. Logs in with an email address; belongs to tenants through memberships.
    MSP operators are staff users with the tenants.operate permission."""

    # Django's documented way to drop an inherited field; django-stubs types it as AbstractUser's CharField.
    username = None  # type: ignore[assignment]
    email = models.EmailField("email address", unique=True)
    full_name = models.CharField(max_length=200, blank=True)

    USERNAME_FIELD = "email"
    REQUIRED_FIELDS: ClassVar[list[str]] = []
    # An email-login manager (create_user(email, ...)), as Django documents for custom user models; the stubs
    # type AbstractUser.objects as the username-based contrib.auth UserManager.
    objects: ClassVar[UserManager] = UserManager()  # type: ignore[assignment]

    class Meta:
        constraints = [models.UniqueConstraint(Lower("email"), name="user_email_ci_unique")]

    def __str__(self) -> str:
        return self.email

    @property
    def is_operator(self) -> bool:
        """Active staff holding tenants.operate (a superuser holds every permission), as
        ``has_perm("tenants.operate")`` through the ModelBackend answers it, in one EXISTS query instead of the
        backend's two that read every permission of the user and of its groups (every API request of a staff
        user asks this once); kept on the instance, as the backend keeps its permission cache."""
        if not (self.is_active and self.is_staff):
            return False
        if self.is_superuser:
            return True
        holds = getattr(self, "_operate_perm", None)
        if holds is None:
            from django.contrib.auth.models import Permission

            holds = Permission.objects.filter(content_type__app_label="tenants", codename="operate").filter(
                models.Q(user=self) | models.Q(group__user=self)).exists()
            self._operate_perm = holds
        return holds


CURRENCIES = [("USD", "US dollar"), ("EUR", "Euro"), ("GBP", "Pound sterling"), ("CHF", "Swiss franc"),
              ("JPY", "Japanese yen"), ("CAD", "Canadian dollar"), ("AUD", "Australian dollar")]


#: a tenant's billing address: at most this many characters and lines (it fills the invoice's address block)
BILLING_ADDRESS_MAX = 500
BILLING_ADDRESS_LINES = 6
TAX_ID = RegexValidator(r"^[A-Za-z0-9][A-Za-z0-9 ./-]{1,31}$",
                        "a tax id: 2-32 letters, digits, spaces, '.', '-' or '/', starting with a letter or digit")


def validate_billing_address(value: str) -> None:
    lines = [ln for ln in value.splitlines() if ln.strip()]
    if len(lines) > BILLING_ADDRESS_LINES:
        raise ValidationError(f"at most {BILLING_ADDRESS_LINES} lines (this has {len(lines)})")
    if any(len(ln) > 100 for ln in lines):
        raise ValidationError("at most 100 characters a line")


#: the spend limit's two special values (marketplace.services.billing.spend holds the rule)
SPEND_LIMIT_HELP = "empty (null) = no limit; 0 = nothing may be spent; in the invoice's currency"


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        SUSPENDED = "suspended", "Suspended"

    name = models.CharField(max_length=200)
    slug = models.SlugField(
        max_length=63, unique=True,
        validators=[RegexValidator(r"^[a-z0-9][a-z0-9-]*$", "lowercase letters, digits and hyphens")],
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    billing_email = models.EmailField()
    currency = models.CharField(max_length=3, choices=CURRENCIES, default="USD")
    created_at = models.DateTimeField(default=timezone.now)
    suspended_at = models.DateTimeField(null=True, blank=True)
    suspended_reason = models.CharField(max_length=500, blank=True)

    # Quotas (data only here; ordering and metering enforce them).
    max_slices = models.PositiveIntegerField(default=16, help_text="max active slices, all tiers")
    max_slices_per_tier = models.PositiveIntegerField(default=8, help_text="max active slices of one tier")
    max_memory_gb = models.PositiveIntegerField(default=640, help_text="max GPU memory across slices")
    monthly_spend_limit = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True,
        validators=[MinValueValidator(Decimal("0"))], help_text=SPEND_LIMIT_HELP,
    )
    spend_warn_ratio = models.DecimalField(
        max_digits=4, decimal_places=2, default=Decimal("0.80"),
        validators=[MinValueValidator(Decimal("0"))],
    )
    spend_block_ratio = models.DecimalField(
        max_digits=4, decimal_places=2, default=Decimal("1.00"),
        validators=[MinValueValidator(Decimal("0"))],
    )

    max_concurrent_requests = models.PositiveIntegerField(
        default=64, help_text="inference requests in flight at once through the gateway, all keys together")
    max_key_requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="the most requests per minute the tenant's admins may give one API key; empty: TESSERA_GATEWAY_RPM")
    max_key_tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="the most tokens per minute the tenant's admins may give one API key; empty: TESSERA_GATEWAY_TPM")
    sso_email_domain = models.CharField(
        max_length=253, blank=True, default="",
        help_text="single sign-on: a person the identity provider signs in with a verified e-mail address at this "
                  "domain joins this tenant as a member; empty: by invitation only")

    # Billing details, printed on its invoices and credit notes (frozen on each at finalization or issue).
    billing_legal_name = models.CharField(
        max_length=200, blank=True, default="",
        help_text="the name invoices are made out to (empty: the tenant's name)")
    billing_address = models.TextField(
        max_length=BILLING_ADDRESS_MAX, blank=True, default="", validators=[validate_billing_address],
        help_text=f"postal address, one line per line (at most {BILLING_ADDRESS_LINES} lines)")
    billing_tax_id = models.CharField(
        max_length=32, blank=True, default="", validators=[TAX_ID],
        help_text="VAT or other tax id, e.g. DE123456789 (letters, digits, spaces, '.', '-', '/')")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "pk"

    class Meta:
        ordering = ["name"]
        permissions = [("operate", "Can operate the MSP console and see every tenant")]
        constraints = [
            models.CheckConstraint(condition=models.Q(spend_warn_ratio__lte=models.F("spend_block_ratio")),
                                   name="tenant_warn_le_block"),
            models.CheckConstraint(condition=models.Q(max_slices_per_tier__lte=models.F("max_slices")),
                                   name="tenant_tier_quota_le_total"),
            models.UniqueConstraint(fields=["sso_email_domain"], condition=~models.Q(sso_email_domain=""),
                                    name="tenant_sso_domain_unique"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["tenant_id", "user__email"]
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="membership_unique")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class Invitation(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                    on_delete=models.SET_NULL, related_name="+")
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(Lower("email"), "tenant", name="invitation_one_pending_per_email",
                                    condition=models.Q(accepted_at__isnull=True, revoked_at__isnull=True)),
        ]

    def __str__(self) -> str:
        return f"{self.email} -> {self.tenant_id} ({self.role})"

    @property
    def status(self) -> str:
        if self.accepted_at:
            return "accepted"
        if self.revoked_at:
            return "revoked"
        if self.expires_at <= timezone.now():
            return "expired"
        return "pending"


class ApiKey(models.Model):
    """An API key. The secret is shown once at creation; only its SHA-256 is stored.
    A key with no tenant is an MSP operator key (created by operators; sees every tenant)."""

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    hashed_key = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="gateway requests per minute; empty: TESSERA_GATEWAY_RPM")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="gateway tokens (input + output) per minute; empty: TESSERA_GATEWAY_TPM")
    monthly_token_allowance = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="tokens (input + output) this key may be served per calendar month (UTC); "
                                         "refused at the gateway once reached; empty: no allowance")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def status(self) -> str:
        if self.revoked_at:
            return "revoked"
        if self.expires_at and self.expires_at <= timezone.now():
            return "expired"
        return "active"


class AuditEvent(models.Model):
    """One staff or tenant-admin action, written in the same transaction as the change it records.
    Append-only: nothing in the application updates or deletes these rows."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=254, help_text='"user:<email>", "key:<prefix>" or "system:<what>"')
    actor_user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_events")
    action = models.CharField(max_length=64, db_index=True)
    target = models.CharField(max_length=254, blank=True)
    detail = models.JSONField(default=dict, blank=True)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [models.Index(fields=["tenant", "-at"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"
