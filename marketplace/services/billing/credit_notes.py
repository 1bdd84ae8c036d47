"""Credit notes: an operator corrects a finalized invoice (which never changes) with a numbered
(`CN-<year>-<nnnnnn>`, no gaps), immutable credit note; its corrected charges ride on the tenant's next invoice
as `correction` lines (rating.corrections).

Sign convention (one, everywhere: the model, the API, both exports, the webhook): a credit note's `total` and
each line's `amount` are what is credited, a positive amount; the credit note as a whole reduces what the
tenant owes by its total. Recharged amounts (`recharge`) are positive charges carried by the next invoice.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime
from decimal import Decimal

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from marketplace.models import CreditNote, CreditNoteLine, CreditNoteSequence, Invoice
from marketplace.services import webhooks
from marketplace.services.dbretry import retry_on_conflict
from tenants import audit
from tenants.errors import Conflict, Forbidden, ServiceError

from .documents import link, parties
from .units import money

log = logging.getLogger("tessera.billing")


def _next_credit_note_number(year: int) -> str:
    seq, _ = CreditNoteSequence.objects.select_for_update().get_or_create(year=year)
    seq.last += 1
    seq.save(update_fields=["last"])
    return f"CN-{year}-{seq.last:06d}"


@retry_on_conflict
def issue_credit_note(principal, invoice: Invoice, *, reason: str, lines: list[tuple[int, Decimal]] | None = None,
                      recharge: list[dict] | None = None, now: datetime | None = None):
    """Operators correct a finalized invoice (which never changes) with a numbered, immutable credit
    note: `lines` [(invoice line id, amount credited)] (default: every line in full, less what earlier
    credit notes credited), and optionally the corrected charges `recharge` [{description, amount}],
    which the tenant's next invoice carries as `correction` lines. Emits credit_note.issued."""
    if not principal.can("operate"):
        raise Forbidden("only operators issue credit notes")
    if not reason or not reason.strip():
        raise ServiceError("say why the invoice is corrected", field="reason")
    now = now or timezone.now()
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice.pk)
        if invoice.status != Invoice.Status.FINALIZED:
            raise Conflict("only a finalized invoice is corrected by a credit note; re-rate the draft instead",
                           field="invoice")
        own = {li.pk: li for li in invoice.lines.all()}
        credited: dict[int, Decimal] = defaultdict(Decimal)
        for line_id, amount in CreditNoteLine.objects.filter(invoice_line__invoice=invoice).values_list(
                "invoice_line_id", "amount"):
            credited[line_id] += amount
        # (left_to_credit below sums the same: each positive line's amount less what was credited on it)
        wanted = ([(pk, li.amount - credited[pk]) for pk, li in own.items() if li.amount > 0] if lines is None
                  else [(int(pk), Decimal(str(a))) for pk, a in lines])
        out = []
        for pk, amount in wanted:
            li = own.get(pk)
            if li is None:
                raise ServiceError(f"line {pk} is not a line of invoice {invoice.number}", field="lines")
            amount = money(amount)
            left = li.amount - credited[pk]
            if amount <= 0 or amount > left:
                if lines is None and amount <= 0:
                    continue
                raise ServiceError(f"line {pk}: credit between 0.01 and {left} (its amount less earlier credits)",
                                   field="lines")
            out.append((li, amount))
        items = []
        for item in recharge or []:
            try:
                amt = money(Decimal(str(item["amount"])))
                desc = str(item["description"]).strip()[:200]
            except (KeyError, ArithmeticError, ValueError) as exc:
                raise ServiceError(f"each corrected charge needs description and amount ({exc})", field="recharge"
                                   ) from None
            if amt <= 0 or not desc:
                raise ServiceError("a corrected charge has a description and a positive amount", field="recharge")
            items.append({"description": desc, "amount": str(amt)})
        if not out:
            raise ServiceError("nothing left to credit on this invoice", field="lines")
        cn = CreditNote.objects.create(
            tenant=invoice.tenant, invoice=invoice, number=_next_credit_note_number(now.year),
            currency=invoice.currency, total=sum((a for _, a in out), Decimal(0)), reason=reason.strip()[:500],
            recharge=items, issued_at=now, issued_by=audit.actor_of(principal)[0], parties=parties(invoice.tenant))
        CreditNoteLine.objects.bulk_create([CreditNoteLine(credit_note=cn, invoice_line=li, amount=a,
                                                           description=li.description) for li, a in out])
        audit.record(principal, "invoice.credit_note", f"credit_note:{cn.number}", invoice.tenant,
                     invoice=invoice.number, total=cn.total, currency=cn.currency, recharge=items)
        webhooks.emit(invoice.tenant, "credit_note.issued", f"credit_note:{cn.pk}", credit_note_payload(cn))
    log.info("credit note issued", extra={"credit_note": cn.number, "invoice": invoice.number, "total": str(cn.total)})
    return cn


def net_balance(total: Decimal, credit_note_totals) -> Decimal:
    """What the tenant owes on an invoice: its total less what its credit notes credit (the one sign: a credit
    note's total is positive and reduces what is owed). The pages, the API (InvoiceSerializer and its copy
    InvoiceRows) and the PDFs call this."""
    return money(total - sum(credit_note_totals, Decimal(0)))


def left_to_credit(invoice: Invoice) -> Decimal:
    """What a credit note can still credit on a finalized invoice (0 on a draft): issue_credit_note's default,
    each positive line's amount less what earlier credit notes credited on it, summed in the database (a credit is
    only ever on a positive line and never more than its amount, so the sum is the positive lines' less all
    credits). When 0 the console offers no credit form (the service refuses: "nothing left to credit")."""
    if invoice.status != Invoice.Status.FINALIZED:
        return Decimal(0)
    positive = invoice.lines.filter(amount__gt=0).aggregate(s=Sum("amount", default=Decimal(0)))["s"]
    credited = CreditNoteLine.objects.filter(invoice_line__invoice_id=invoice.pk).aggregate(
        s=Sum("amount", default=Decimal(0)))["s"]
    return money(positive - credited)


def credit_note_payload(cn) -> dict:
    return {
        "number": cn.number, "invoice": cn.invoice.number, "tenant": cn.tenant.slug, "currency": cn.currency,
        "total": str(cn.total), "reason": cn.reason, "issued_at": cn.issued_at.isoformat(),
        "lines": [{"id": li.pk, "invoice_line": li.invoice_line_id, "description": li.description,
                   "amount": str(li.amount)} for li in cn.lines.order_by("pk")],
        "recharge": cn.recharge,
        "recharged_on": cn.recharged_on.number if cn.recharged_on_id else None,
        "pdf_url": link(cn),
    }
