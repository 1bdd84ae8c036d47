"""Invoices (one per tenant per calendar month: draft while open, finalized once, then immutable),
their lines, spend-limit notices, and outbound webhooks with a delivery log."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.scoping import TenantScopedQuerySet

#: Invoice.parties and CreditNote.parties (billing.documents.parties writes them)
PARTIES_HELP = ("the issuer (the MSP's settings) and the customer (the tenant's billing details) as printed, frozen "
                "when the invoice is finalized or the credit note issued; empty on a draft: the current ones")


class Invoice(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        FINALIZED = "finalized", "Finalized"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="invoices")
    period_start = models.DateField(help_text="first day of the month (UTC)")
    period_end = models.DateField(help_text="first day of the next month")
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DRAFT)
    number = models.CharField(max_length=32, unique=True, null=True, blank=True, help_text="given at finalization")
    total = models.DecimalField(max_digits=14, decimal_places=2, default=0)
    rated_at = models.DateTimeField(null=True, blank=True, help_text="when the draft was last rated")
    finalized_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    parties = models.JSONField(null=True, blank=True, editable=False, help_text=PARTIES_HELP)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-period_start", "tenant_id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "period_start"], name="one_invoice_per_tenant_month"),
            models.CheckConstraint(condition=models.Q(status="draft", number__isnull=True)
                                   | models.Q(status="finalized", number__isnull=False),
                                   name="invoice_number_iff_finalized"),
        ]

    def __str__(self) -> str:
        return self.number or f"draft {self.tenant_id} {self.period_start:%Y-%m}"


class InvoiceLine(models.Model):
    """One priced line. Usage lines: amount = quantity x unit_price, rounded to the cent. A
    commitment top-up (reserved plan's monthly minimum not reached by the month's charges at that
    plan) has quantity 1, unit "top-up" and unit_price = amount; `plan` is the reserved plan,
    usage_from/usage_to the first and last moment reserved capacity was held under it, and the
    description says how it was computed (see marketplace.services.billing)."""

    class Kind(models.TextChoices):
        SLICE_HOURS = "slice_hours", "Slice hours"
        INPUT_TOKENS = "input_tokens", "Input tokens"
        OUTPUT_TOKENS = "output_tokens", "Output tokens"
        ADJUSTMENT_INPUT = "adjustment_input", "Late input tokens from a finalized period"
        ADJUSTMENT_OUTPUT = "adjustment_output", "Late output tokens from a finalized period"
        COMMITMENT_TOPUP = "commitment_topup", "Commitment top-up"
        COMMITMENT_CREDIT = "commitment_credit", "Commitment credit (late usage toward a settled commitment)"
        CORRECTION = "correction", "Corrected charge (from a credit note)"

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    kind = models.CharField(max_length=24, choices=Kind.choices)
    tier = models.ForeignKey("marketplace.Tier", on_delete=models.PROTECT, related_name="+")
    plan = models.ForeignKey("marketplace.PricePlan", on_delete=models.PROTECT, related_name="+")
    allocation = models.ForeignKey("marketplace.Allocation", null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+")
    deployment = models.ForeignKey("marketplace.ModelDeployment", null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+")
    description = models.CharField(max_length=300)
    quantity = models.DecimalField(max_digits=24, decimal_places=6, help_text="hours, or millions of tokens")
    unit = models.CharField(max_length=16)
    unit_price = models.DecimalField(max_digits=12, decimal_places=4)
    amount = models.DecimalField(max_digits=14, decimal_places=2)
    usage_from = models.DateTimeField()
    usage_to = models.DateTimeField()

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "invoice__tenant_id"

    class Meta:
        ordering = ["invoice_id", "kind", "tier_id", "usage_from", "pk"]

    def __str__(self) -> str:
        return f"{self.description}: {self.amount}"


class InvoiceLineKey(models.Model):
    """A token line's share per API key: the tokens each key was served under the line and its part of the
    line's amount (largest remainder to the cent: the shares of a line sum to its amount exactly). Written with
    the line (billing.keys); frozen with the invoice. `api_key` is the key's prefix; "" for usage that was
    served without one (recorded before keys were metered)."""

    line = models.ForeignKey(InvoiceLine, on_delete=models.CASCADE, related_name="key_shares")
    api_key = models.CharField(max_length=16, blank=True, default="")
    tokens = models.BigIntegerField()
    amount = models.DecimalField(max_digits=14, decimal_places=2)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "line__invoice__tenant_id"

    class Meta:
        ordering = ["line_id", "api_key"]
        constraints = [models.UniqueConstraint(fields=["line", "api_key"], name="one_share_per_line_key")]

    def __str__(self) -> str:
        return f"{self.api_key or '(no key)'}: {self.amount}"


class InvoiceSequence(models.Model):
    """Invoice numbers without gaps: one row per year, locked while a number is taken."""

    year = models.PositiveIntegerField(unique=True)
    last = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.year}: {self.last}"


class SpendNotice(models.Model):
    class Level(models.TextChoices):
        WARN = "warn", "Warning threshold reached"
        BLOCK = "block", "Limit reached: new orders blocked"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="spend_notices")
    period_start = models.DateField()
    level = models.CharField(max_length=8, choices=Level.choices)
    spend = models.DecimalField(max_digits=14, decimal_places=2)
    limit = models.DecimalField(max_digits=14, decimal_places=2)
    at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-at"]
        constraints = [models.UniqueConstraint(fields=["tenant", "period_start", "level"], name="one_notice_per_level")]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.period_start:%Y-%m} {self.level}"


class WebhookEndpoint(models.Model):
    """Where events are POSTed, signed with HMAC-SHA256 of the body with `secret`. No tenant: the
    MSP's own endpoint, which receives every tenant's events."""

    EVENTS = ["credit_note.issued", "invoice.finalized", "spend_limit.reached", "spend_limit.warning"]

    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE,
                               related_name="webhooks")
    url = models.URLField(max_length=500)
    secret = models.CharField(max_length=100, editable=False)
    events = models.JSONField(default=list)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.url


class WebhookDelivery(models.Model):
    """One event for one endpoint. Pending until delivered or given up (failed, with a reason): every pending
    delivery has a time by which its next attempt is due (`next_attempt_at`), so one whose retry was lost or
    whose worker was killed mid-attempt is queued again by the sweep (services.webhooks.sweep)."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        DELIVERED = "delivered", "Delivered"
        FAILED = "failed", "Failed (gave up)"

    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=40)
    event_key = models.CharField(max_length=120, help_text="what the event is about, e.g. invoice:42")
    payload = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, help_text="the detail, for operators")
    last_reason = models.CharField(max_length=200, blank=True, help_text="a generic reason, for tenants")
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(
        null=True, blank=True, default=timezone.now,
        help_text="pending: when the next attempt is due (during an attempt: when it is overdue); else empty")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "endpoint__tenant_id"

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["endpoint", "event", "event_key"],
                                               name="one_delivery_per_event")]
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="webhook_delivery_due")]

    def __str__(self) -> str:
        return f"{self.event} -> {self.endpoint_id} ({self.status})"


class BillingAlert(models.Model):
    """Something billing could not do and an operator must see: usage with no price in the invoice's
    currency (blocks finalization), a tenant whose rating or finalization failed in the beat. Open
    while `resolved_at` is empty; the next successful rating or finalization resolves it, saying why in
    `resolution` (unpriced usage: once a plan covers it, e.g. one back-dated over it). And usage events
    the consumer refused (unsigned or forged) that claimed this tenant: one open alert per burst, refreshed while
    refusals go on, resolved by an operator (admin action) after looking."""

    class Kind(models.TextChoices):
        UNPRICED = "unpriced", "Usage with no price in the invoice's currency"
        RATING_FAILED = "rating_failed", "Rating failed"
        FINALIZE_FAILED = "finalize_failed", "Finalization failed"
        REFUSED_USAGE = "refused_usage", "Usage events refused (unsigned or forged)"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="billing_alerts")
    period_start = models.DateField(null=True, blank=True)
    kind = models.CharField(max_length=24, choices=Kind.choices)
    message = models.CharField(max_length=1000)
    at = models.DateTimeField(default=timezone.now)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolution = models.CharField(max_length=300, blank=True, default="",
                                  help_text="why it was resolved (e.g. the re-rating that found every use priced)")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-at"]
        constraints = [models.UniqueConstraint(fields=["tenant", "period_start", "kind"],
                                               condition=models.Q(resolved_at__isnull=True),
                                               name="one_open_billing_alert")]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.kind}: {self.message[:60]}"


class CreditNote(models.Model):
    """A numbered, immutable correction of a finalized invoice (which itself never changes): the
    amounts credited per invoice line, and optionally the corrected charges, which the tenant's next
    invoice carries as `correction` lines (`recharged_on` once that invoice is finalized)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="credit_notes")
    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="credit_notes")
    number = models.CharField(max_length=32, unique=True, help_text="CN-<year>-<nnnnnn>, without gaps")
    currency = models.CharField(max_length=3)
    total = models.DecimalField(max_digits=14, decimal_places=2, help_text="credited (positive)")
    reason = models.CharField(max_length=500)
    recharge = models.JSONField(default=list, blank=True,
                                help_text="corrected charges [{description, amount}] for the next invoice")
    recharged_on = models.ForeignKey(Invoice, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    issued_at = models.DateTimeField(default=timezone.now)
    issued_by = models.CharField(max_length=254)
    parties = models.JSONField(null=True, blank=True, editable=False, help_text=PARTIES_HELP)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-issued_at", "-pk"]

    def __str__(self) -> str:
        return self.number


class CreditNoteLine(models.Model):
    credit_note = models.ForeignKey(CreditNote, on_delete=models.CASCADE, related_name="lines")
    invoice_line = models.ForeignKey(InvoiceLine, on_delete=models.PROTECT, related_name="credits")
    description = models.CharField(max_length=300)
    amount = models.DecimalField(max_digits=14, decimal_places=2, help_text="credited (positive)")

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "credit_note__tenant_id"

    class Meta:
        ordering = ["credit_note_id", "pk"]

    def __str__(self) -> str:
        return f"{self.description}: -{self.amount}"


class CreditNoteSequence(models.Model):
    """Credit-note numbers without gaps: one row per year, locked while a number is taken."""

    year = models.PositiveIntegerField(unique=True)
    last = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.year}: {self.last}"


class RatingRun(models.Model):
    """One run of the rating beat: each tenant rated by its own task (retried on its own); the task that
    finishes the last tenant finalizes the months that ended and records the summary."""

    period_start = models.DateField()
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    summary = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"rating {self.period_start:%Y-%m} at {self.started_at:%Y-%m-%d %H:%M}"


class RatingRunTenant(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        DONE = "done", "Rated"
        FAILED = "failed", "Failed"

    run = models.ForeignKey(RatingRun, on_delete=models.CASCADE, related_name="tenants")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    error = models.CharField(max_length=500, blank=True)
    notices = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "tenant"], name="rating_run_tenant_once")]
        indexes = [models.Index(fields=["run", "status"])]

    def __str__(self) -> str:
        return f"{self.run_id}/{self.tenant_id}: {self.status}"
