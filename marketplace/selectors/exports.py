"""Exports: invoices and credit notes as CSV, one writer for the API, the portal and the console.

Credit notes keep the one sign convention of billing.credit_notes: the amounts credited are positive here as in
the JSON export, the API and the webhook."""

from __future__ import annotations

import csv
import io

from marketplace.models import CreditNote, Invoice, InvoiceLine

from .billing import key_breakdown


def invoice_csv(invoice: Invoice) -> str:
    """An invoice as CSV: its header, its lines (usage first, then commitment top-ups), the total and its
    credit notes, each with the amount it credits (positive), then (an invoice with token lines) its charges per API
    key (`key_breakdown`) (the API's export/csv/, the portal's and the console's download)."""
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["invoice", invoice.number or "draft", "tenant", invoice.tenant.slug, "period",
                f"{invoice.period_start:%Y-%m}", "currency", invoice.currency, "status", invoice.status])
    w.writerow(["kind", "tier", "deployment", "description", "quantity", "unit", "unit_price", "amount",
                "usage_from", "usage_to"])
    lines = sorted(invoice.lines.select_related("tier"), key=lambda li: li.kind == InvoiceLine.Kind.COMMITMENT_TOPUP)
    for li in lines:  # usage first, then commitment top-ups (quantity 1, unit "top-up", unit_price = amount)
        w.writerow([li.kind, li.tier.key, li.deployment_id or "", li.description, li.quantity, li.unit,
                    li.unit_price, li.amount, li.usage_from.isoformat(), li.usage_to.isoformat()])
    w.writerow(["total", "", "", "", "", "", "", invoice.total, "", ""])
    for cn in invoice.credit_notes.order_by("pk"):  # corrections: the invoice itself never changes
        w.writerow(["credit_note", cn.number, "", cn.reason, "", "", "", cn.total, cn.issued_at.isoformat(), ""])
    split = key_breakdown(invoice)
    if split["keys"]:  # an invoice with token lines
        w.writerow(["by_key", "key", "key_name", "input_tokens", "output_tokens", "amount"])
        for k in split["keys"]:
            w.writerow(["key", k["key"] or "", k["key_name"] or "", k["input_tokens"], k["output_tokens"],
                        k["amount"]])
        w.writerow(["not_per_key", "", "", "", "", split["not_per_key"]])
    return out.getvalue()


def credit_note_csv(cn: CreditNote) -> str:
    """A credit note as CSV: its lines and total (the amounts credited, positive) and what was recharged (the API's
    export/csv/)."""
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["credit_note", cn.number, "invoice", cn.invoice.number, "tenant", cn.tenant.slug, "currency",
                cn.currency])
    w.writerow(["invoice_line", "description", "amount"])
    for li in cn.lines.order_by("pk"):
        w.writerow([li.invoice_line_id, li.description, li.amount])
    w.writerow(["total", "", cn.total])
    for item in cn.recharge:
        w.writerow(["recharge", item["description"], item["amount"]])
    return out.getvalue()
