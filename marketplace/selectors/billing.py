"""Reads for billing."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from django.db.models import (
    BooleanField,
    Case,
    DecimalField,
    ExpressionWrapper,
    F,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Coalesce

from marketplace.models import CreditNote, CreditNoteLine, Invoice, InvoiceLine, WebhookEndpoint
from tenants.models import Tenant
from tenants.scoping import Principal


def invoices(principal: Principal):
    """Invoices with their lines and credit notes (one invoice's page)."""
    return Invoice.objects.visible_to(principal, "billing").select_related("tenant").prefetch_related(
        Prefetch("lines", queryset=InvoiceLine.objects.select_related("tier").order_by("pk")),
        Prefetch("credit_notes", queryset=CreditNote.objects.order_by("pk")))


def invoice_list(principal: Principal):
    """Invoices for a list: no lines (a list shows none; they grow with usage), credit notes only."""
    return Invoice.objects.visible_to(principal, "billing").select_related("tenant").prefetch_related(
        Prefetch("credit_notes", queryset=CreditNote.objects.order_by("pk")))


MONEY = DecimalField(max_digits=14, decimal_places=2)


def spend(principal: Principal, period_start: date, *, tenant: str | None = None, warning: bool | None = None,
          blocked: bool | None = None) -> QuerySet:
    """Each visible tenant's spend in the month of `period_start` against its limit, as one query: the
    month's invoice as last rated (a draft's total as of its rated_at, by the rating beat or a refresh;
    a finalized one's final total); nothing is rated or written here. No invoice: nothing was used.
    Filters: tenant (slug), warning (spend at or past the warning ratio), blocked (at or past the block
    ratio). Rows: Tenant objects with spend, currency, rated_at, status, ratio, warn, is_blocked."""
    month = Invoice.objects.filter(tenant=OuterRef("pk"), period_start=period_start)
    qs = Tenant.objects.visible_to(principal, "billing").annotate(
        spend=Coalesce(Subquery(month.values("total")[:1]), Value(0), output_field=MONEY),
        invoice_currency=Subquery(month.values("currency")[:1]),
        rated_at=Subquery(month.values("rated_at")[:1]),
        finalized_at=Subquery(month.values("finalized_at")[:1]),
        invoice_status=Subquery(month.values("status")[:1]),
    )
    limited = Q(monthly_spend_limit__isnull=False, monthly_spend_limit__gt=0)
    warn_at = ExpressionWrapper(F("monthly_spend_limit") * F("spend_warn_ratio"), output_field=MONEY)
    block_at = ExpressionWrapper(F("monthly_spend_limit") * F("spend_block_ratio"), output_field=MONEY)
    qs = qs.annotate(
        warn=Case(When(limited & Q(spend__gte=warn_at), then=Value(True)), default=Value(False),
                  output_field=BooleanField()),
        is_blocked=Case(When(limited & Q(spend__gte=block_at), then=Value(True)), default=Value(False),
                        output_field=BooleanField()),
    )
    if tenant:
        qs = qs.filter(slug=tenant)
    if warning is not None:
        qs = qs.filter(warn=warning)
    if blocked is not None:
        qs = qs.filter(is_blocked=blocked)
    return qs.order_by("slug")


def credit_notes(principal: Principal):
    return CreditNote.objects.visible_to(principal, "billing").select_related(
        "tenant", "invoice", "recharged_on").prefetch_related(
        Prefetch("lines", queryset=CreditNoteLine.objects.order_by("pk")))


def webhook_endpoints(principal: Principal):
    return WebhookEndpoint.objects.visible_to(principal, "manage_tenant").select_related("tenant")


def plan_month_estimate(plan, slices: int = 1, month: date | None = None) -> dict:
    """What `slices` slices at `plan` held for a whole calendar month (default: next month, the first whole one
    an order placed now can hold) are charged before tokens, by the rating itself (`billing.rate_month`, the
    invoices' rule, on slices held all month; nothing is read or written): the slice-hours line and, for a
    reserved plan, the commitment top-up (one commitment however many slices are held at once). Tokens are
    charged on top."""
    from django.utils import timezone

    from marketplace.services import billing

    month = month or billing.next_month(billing.month_of(timezone.now()))
    start, end = billing.bounds(month)
    held = [billing.Held(plan.tier_id, plan.kind, start, None)] * slices
    inputs = billing.MonthInputs(plan.currency, billing.PlanBook(plan.currency, [plan]), held, [],
                                 {plan.tier_id: plan.tier}, {})
    drafts, _unpriced, _late = billing.rate_month(inputs, start, end, end)
    slice_hours = sum((d.amount for d in drafts if d.kind == InvoiceLine.Kind.SLICE_HOURS), Decimal(0))
    top_up = sum((d.amount for d in drafts if d.kind == InvoiceLine.Kind.COMMITMENT_TOPUP), Decimal(0))
    return {"month": month, "hours": int(billing.seconds(end - start) / 3600), "slices": slices,
            "slice_hours": slice_hours, "top_up": top_up, "total": slice_hours + top_up,
            "commitment": plan.monthly_commit}
