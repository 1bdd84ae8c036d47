"""Reads for billing."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from django.db.models import Exists, OuterRef, Prefetch, Q, QuerySet, Sum

from marketplace.models import CreditNote, CreditNoteLine, Invoice, InvoiceLine, InvoiceLineKey, WebhookEndpoint
from marketplace.services.billing import spend as spend_rule
from marketplace.services.billing.units import money
from tenants.models import ApiKey, Tenant
from tenants.scoping import Principal


def invoices(principal: Principal):
    """Invoices with their lines and credit notes (one invoice's page)."""
    return Invoice.objects.visible_to(principal, "billing").select_related("tenant").prefetch_related(
        Prefetch("lines", queryset=InvoiceLine.objects.select_related("tier").order_by("pk")),
        Prefetch("credit_notes", queryset=CreditNote.objects.order_by("pk")))


def invoice_head(principal: Principal):
    """Invoices without lines or credit notes, each with has_credit_notes (one invoice's page reads its lines
    with `invoice_lines` and, when it has any, its credit notes with `credit_notes_of`, as rows)."""
    return Invoice.objects.visible_to(principal, "billing").select_related("tenant").annotate(
        has_credit_notes=Exists(CreditNote.objects.filter(invoice_id=OuterRef("pk"))))


#: An invoice as a list shows it (a row of `invoice_list`): no lines (a list shows none; they grow with usage).
INVOICE_ROW = ("id", "number", "tenant__slug", "status", "period_start", "period_end", "currency", "total",
               "rated_at", "finalized_at")
#: An invoice line as its invoice's page shows it (a row of `invoice_lines`).
INVOICE_LINE_ROW = ("id", "kind", "tier__key", "allocation_id", "deployment_id", "description", "quantity", "unit",
                    "unit_price", "amount", "usage_from", "usage_to")


def invoice_list(principal: Principal) -> QuerySet:
    """Invoices for a list, as rows (dicts of INVOICE_ROW and has_credit_notes, no model instances): filter, order
    and paginate it, then add the credit notes of the page's rows that have any with `credit_notes_of` (one
    query, none when no row has any: corrections are rare)."""
    return Invoice.objects.visible_to(principal, "billing").values(
        *INVOICE_ROW, has_credit_notes=Exists(CreditNote.objects.filter(invoice_id=OuterRef("pk"))))


def invoice_lines(invoice_id: int) -> QuerySet:
    """One invoice's lines as rows (dicts of INVOICE_LINE_ROW), in order."""
    return InvoiceLine.objects.filter(invoice_id=invoice_id).order_by("pk").values(*INVOICE_LINE_ROW)


INPUT_KINDS = (InvoiceLine.Kind.INPUT_TOKENS, InvoiceLine.Kind.ADJUSTMENT_INPUT)


def key_breakdown(invoice: Invoice) -> dict:
    """An invoice's charges per API key (its token lines' key shares, billing.keys), in two queries: rows of
    key (the prefix; None: usage served without a key), key_name (the invoice's tenant's own key, else None),
    input_tokens, output_tokens and amount, largest amount first; `not_per_key`: the rest of the total (slice-hours,
    commitment top-ups and credits, corrections: charges of no one key). The rows' amounts and `not_per_key` sum to
    the invoice's total."""
    rows = list(InvoiceLineKey.objects.filter(line__invoice_id=invoice.pk).values("api_key").annotate(
        input_tokens=Sum("tokens", filter=Q(line__kind__in=INPUT_KINDS), default=0),
        output_tokens=Sum("tokens", filter=~Q(line__kind__in=INPUT_KINDS), default=0),
        amount=Sum("amount")).order_by("-amount", "api_key"))
    prefixes = [r["api_key"] for r in rows if r["api_key"]]
    names = dict(ApiKey.objects.filter(tenant_id=invoice.tenant_id, prefix__in=prefixes).values_list(
        "prefix", "name")) if prefixes else {}
    out = [{"key": r["api_key"] or None, "key_name": names.get(r["api_key"]), "input_tokens": r["input_tokens"],
            "output_tokens": r["output_tokens"], "amount": money(r["amount"])} for r in rows]
    return {"keys": out, "not_per_key": money(invoice.total - sum((r["amount"] for r in out), Decimal(0)))}


def credit_notes_of(invoice_ids) -> dict[int, list[dict]]:
    """The credit notes correcting each of `invoice_ids` (visible invoices: a note is its invoice's tenant's),
    as rows (id, number, total, issued_at) in order, in one query (none for no ids); an invoice without any
    is absent."""
    out: dict[int, list[dict]] = {}
    invoice_ids = list(invoice_ids)
    if not invoice_ids:
        return out
    for r in CreditNote.objects.filter(invoice_id__in=invoice_ids).order_by("pk").values(
            "invoice_id", "id", "number", "total", "issued_at"):
        out.setdefault(r["invoice_id"], []).append({k: r[k] for k in ("id", "number", "total", "issued_at")})
    return out


def spend(principal: Principal, period_start: date, *, tenant: str | None = None, warning: bool | None = None,
          blocked: bool | None = None) -> QuerySet:
    """Each visible tenant's spend figure in the month of `period_start` against its limit, as one query
    (billing.spend.figures: the month's invoice as last rated; nothing is rated or written here). Filters: tenant
    (slug), warning (at or past the warning ratio), blocked (at or past the block ratio), both by the spend rule
    itself (billing.spend.reached). Rows: dicts of billing.spend.ROW, in slug order."""
    tenants = Tenant.objects.visible_to(principal, "billing")
    if tenant:
        tenants = tenants.filter(slug=tenant)
    return spend_rule.figures(tenants, period_start, warn=warning, blocked=blocked).order_by("slug").values(
        *spend_rule.ROW)


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
