"""Invoices: one per tenant and month, a draft while the month is open, finalized once after it ends.

A draft is re-rated (`refresh`) by the rating beat (billing.runs) and on request; finalizing it numbers it
(`TSR-<year>-<nnnnnn>`, no gaps), freezes it and marks the rolled-up usage it charged as billed: a finalized
invoice never changes (corrections are credit notes, billing.credit_notes). Every tenant with usage or held
capacity in a month gets that month's invoice (`ensure_invoices`, run by the beat before month-end finalization).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import TruncMonth
from django.utils import timezone

from marketplace.models import Allocation, BillingAlert, CreditNote, Invoice, InvoiceLine, InvoiceSequence
from marketplace.services import webhooks
from marketplace.services.dbretry import retry_on_conflict
from telemetry.models import UsageHourly
from tenants import audit
from tenants.errors import Conflict, ServiceError
from tenants.models import Tenant

from .alerts import alert, note_unpriced, resolve_alerts
from .documents import link, parties
from .keys import write_shares
from .rating import L, rate
from .units import bounds, month_of, months, next_month

log = logging.getLogger("tessera.billing")


def draft_for(tenant: Tenant, period_start: date) -> Invoice:
    invoice, _ = Invoice.objects.get_or_create(
        tenant=tenant, period_start=period_start,
        defaults={"period_end": next_month(period_start), "currency": tenant.currency})
    return invoice


@retry_on_conflict
@transaction.atomic
def refresh(invoice: Invoice, now: datetime | None = None) -> Invoice:
    """Re-rate a draft from the current usage, in the invoice's own currency. A finalized invoice
    is never touched."""
    invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice.pk)
    if invoice.status != Invoice.Status.DRAFT:
        raise Conflict(f"invoice {invoice.number} is finalized and cannot change")
    rated = rate(invoice.tenant, invoice.period_start, now, invoice.currency, invoice.pk)
    invoice.lines.all().delete()
    lines = InvoiceLine.objects.bulk_create([d.line(invoice) for d in rated.drafts])
    write_shares(lines, rated.drafts)
    invoice.total = sum((line.amount for line in lines), Decimal(0))
    invoice.rated_at = timezone.now()
    invoice.save(update_fields=["total", "rated_at"])
    note_unpriced(invoice, rated)
    return invoice


def current_invoice(tenant: Tenant, now: datetime | None = None) -> Invoice:
    """The current month's invoice, re-rated if it is a draft (a write: beat, explicit refresh, demo)."""
    now = now or timezone.now()
    invoice = draft_for(tenant, month_of(now))
    return refresh(invoice, now) if invoice.status == Invoice.Status.DRAFT else invoice


def _next_number(year: int) -> str:
    seq, _ = InvoiceSequence.objects.select_for_update().get_or_create(year=year)
    seq.last += 1
    seq.save(update_fields=["last"])
    return f"TSR-{year}-{seq.last:06d}"


class FinalizeBlocked(Conflict):
    code = "unpriced_usage"


@retry_on_conflict
def finalize(invoice: Invoice, *, now: datetime | None = None, force: bool = False, principal=None) -> Invoice:
    """Rate one last time, number and freeze the invoice, mark the usage it charged as billed.
    principal: who finalizes (audited); None for the monthly beat.

    Lock order (everywhere): the invoice row, then the tenant's rollup rows in (deployment, hour)
    order, the order in which ingest upserts them; then the year's invoice sequence."""
    now = now or timezone.now()
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice.pk)
        if invoice.status == Invoice.Status.FINALIZED:
            raise Conflict(f"invoice {invoice.number} is already finalized")
        _, end = bounds(invoice.period_start)
        if now < end and not force:
            raise ServiceError(f"the month is still open until {end:%Y-%m-%d}; finalize after it ends",
                               field="period_start")
        earlier = Invoice.objects.filter(tenant=invoice.tenant, period_start__lt=invoice.period_start,
                                         status=Invoice.Status.DRAFT).exists()
        if earlier:
            raise Conflict("finalize the tenant's earlier invoices first")
        # Lock the rollup rows this invoice may charge so concurrent ingest waits for us.
        list(UsageHourly.objects.select_for_update().filter(tenant=invoice.tenant, hour__lt=end)
             .order_by("deployment_id", "hour").values_list("pk"))
        rated = rate(invoice.tenant, invoice.period_start, min(now, end), invoice.currency, invoice.pk)
        if rated.unpriced:
            raise FinalizeBlocked(f"invoice for {invoice.period_start:%Y-%m} cannot be finalized: usage with no "
                                  f"price in {invoice.currency} ({'; '.join(rated.unpriced)}); add a plan in "
                                  f"{invoice.currency} from before that usage, then finalize")
        invoice.lines.all().delete()
        lines = InvoiceLine.objects.bulk_create([d.line(invoice) for d in rated.drafts])
        write_shares(lines, rated.drafts)
        rated.usage_rows.update(
            billed_input_tokens=F("input_tokens"), billed_output_tokens=F("output_tokens"),
            billed_requests=F("requests"))
        invoice.total = sum((line.amount for line in lines), Decimal(0))
        CreditNote.objects.filter(pk__in=[pk for d in rated.drafts if d.kind == L.CORRECTION for pk in d.rows]
                                  ).update(recharged_on=invoice)
        invoice.number = _next_number(invoice.period_start.year)
        invoice.status = Invoice.Status.FINALIZED
        invoice.finalized_at = now
        invoice.rated_at = now
        invoice.parties = parties(invoice.tenant)  # as printed on its PDF from now on (billing.documents)
        invoice.save()
        resolve_alerts(invoice.tenant, invoice.period_start, BillingAlert.Kind.UNPRICED,
                       f"finalized as {invoice.number} with every use priced")
        audit.record(principal if principal is not None else "system:beat", "invoice.finalize",
                     f"invoice:{invoice.number}", invoice.tenant, total=invoice.total, currency=invoice.currency,
                     forced=force)
        webhooks.emit(invoice.tenant, "invoice.finalized", f"invoice:{invoice.pk}", invoice_payload(invoice))
    log.info("invoice finalized", extra={"invoice": invoice.number, "total": str(invoice.total)})
    return invoice


#: The beat looks for periods needing an invoice among rollups and allocations changed this recently
#: (it runs every few minutes: anything older was seen by an earlier run); None = everything.
ENSURE_LOOKBACK = timedelta(days=35)


def periods_used(now: datetime | None = None, since: datetime | None = None,
                 tenant: Tenant | None = None) -> dict[int, set[date]]:
    """Per tenant id: the months up to now with usage (hourly rollups) or held capacity (an
    allocation while active), and, where usage of a finalized month is still unbilled, the current
    month (whose draft will carry it as adjustments). since: only rollups updated and allocations
    still active (or stopped) since then."""
    now = now or timezone.now()
    out: dict[int, set[date]] = defaultdict(set)
    hourly = UsageHourly.objects.filter(hour__lt=now)
    allocs = Allocation.objects.filter(activated_at__isnull=False, activated_at__lt=now)
    if tenant is not None:
        hourly, allocs = hourly.filter(tenant=tenant), allocs.filter(tenant=tenant)
    if since is not None:
        hourly = hourly.filter(updated_at__gte=since)
        allocs = allocs.filter(Q(released_at__isnull=True) | Q(released_at__gte=since) | Q(updated_at__gte=since))
    for tenant_id, m in hourly.annotate(m=TruncMonth("hour", tzinfo=UTC)).values_list("tenant_id", "m").distinct():
        out[tenant_id].add(month_of(m))
    for tenant_id, activated, released, state, updated in allocs.values_list(
            "tenant_id", "activated_at", "released_at", "state", "updated_at"):
        assert activated is not None  # activated_at__isnull=False above
        stopped = released or (updated if state == Allocation.State.FAILED else None)
        out[tenant_id].update(months(activated, min(stopped or now, now)))
    pending_late = (hourly.filter(Q(input_tokens__gt=F("billed_input_tokens"))
                                  | Q(output_tokens__gt=F("billed_output_tokens")))
                    .annotate(m=TruncMonth("hour", tzinfo=UTC)).values_list("tenant_id", "m").distinct())
    finalized = set(Invoice.objects.filter(status=Invoice.Status.FINALIZED).values_list("tenant_id", "period_start"))
    for tenant_id, m in pending_late:
        if (tenant_id, month_of(m)) in finalized:
            out[tenant_id].add(month_of(now))
    return out


def ensure_invoices(now: datetime | None = None, tenant: Tenant | None = None,
                    since: datetime | None = None) -> list[Invoice]:
    """Create the missing invoice (a draft, in the tenant's currency) of every period in which a
    tenant used something or held capacity, with one INSERT. Returns the invoices opened (a concurrent
    run's among them, if it opened one of the same at the same time). since: see periods_used."""
    now = now or timezone.now()
    used = periods_used(now, since, tenant)
    if tenant is not None:
        used = {tenant.pk: used.get(tenant.pk, set())}
    have = set(Invoice.objects.filter(tenant_id__in=list(used)).values_list("tenant_id", "period_start"))
    missing = sorted((t, m) for t, months in used.items() for m in months if (t, m) not in have)
    if not missing:
        return []
    currency = dict(Tenant.objects.filter(pk__in={t for t, _ in missing}).values_list("pk", "currency"))
    # one INSERT for all (another run may have opened some meanwhile: the unique constraint skips those)
    Invoice.objects.bulk_create([Invoice(tenant_id=t, period_start=m, period_end=next_month(m), currency=currency[t])
                                 for t, m in missing], ignore_conflicts=True, batch_size=1000)
    wanted = Q()
    for m in {m for _, m in missing}:
        wanted |= Q(period_start=m, tenant_id__in=[t for t, mm in missing if mm == m])
    created = list(Invoice.objects.filter(wanted, status=Invoice.Status.DRAFT).order_by("tenant_id", "period_start"))
    for inv in created:
        log.info("invoice opened", extra={"tenant": inv.tenant_id, "period": str(inv.period_start)})
    return created


def finalize_due(now: datetime | None = None, *, ensure: bool = True) -> list[str]:
    """Beat, month end: open the missing invoices, then finalize every draft whose month has ended,
    oldest first. Each invoice in its own transaction: one that fails (no price in its currency, a
    conflict) is alerted and holds back only that tenant's later invoices."""
    now = now or timezone.now()
    if ensure:
        ensure_invoices(now, since=now - ENSURE_LOOKBACK)
    return _finalize_drafts(Invoice.objects.filter(status=Invoice.Status.DRAFT, period_end__lte=now.date()), now)


def finalize_tenant_due(tenant_id: int, now: datetime | None = None) -> list[str]:
    """Month end for one tenant (its rating-run task): finalize its drafts whose month has ended, oldest
    first; one that fails is alerted and holds back its later ones. Idempotent: a finalized invoice is
    never picked again, so a retried or redelivered task bills nothing twice."""
    now = now or timezone.now()
    return _finalize_drafts(Invoice.objects.filter(tenant_id=tenant_id, status=Invoice.Status.DRAFT,
                                                   period_end__lte=now.date()), now)


def _finalize_drafts(drafts, now: datetime) -> list[str]:
    done, held_back = [], set()
    for inv in drafts.select_related("tenant").order_by("period_start", "tenant_id"):
        if inv.tenant_id in held_back:
            continue
        try:
            done.append(finalize(inv, now=now).number)
        except Exception as exc:  # recorded and alerted; the other tenants go on
            held_back.add(inv.tenant_id)
            alert(inv.tenant, inv.period_start, BillingAlert.Kind.FINALIZE_FAILED,
                  f"finalizing {inv.period_start:%Y-%m} failed: {exc}")
    return done


def invoice_payload(invoice: Invoice) -> dict:
    return {
        "number": invoice.number, "tenant": invoice.tenant.slug, "status": invoice.status,
        "period_start": invoice.period_start.isoformat(), "period_end": invoice.period_end.isoformat(),
        "currency": invoice.currency, "total": str(invoice.total), "pdf_url": link(invoice),
        "credit_notes": [{"number": cn.number, "total": str(cn.total)} for cn in invoice.credit_notes.order_by("pk")],
        "lines": [{"kind": li.kind, "tier": li.tier.key, "deployment": li.deployment_id,
                   "description": li.description, "quantity": str(li.quantity), "unit": li.unit,
                   "unit_price": str(li.unit_price), "amount": str(li.amount),
                   "usage_from": li.usage_from.isoformat(), "usage_to": li.usage_to.isoformat()}
                  for li in invoice.lines.select_related("tier").order_by("pk")],
    }
