"""Invoice and credit-note PDFs: WeasyPrint over templates/pdf/ (fonts from Debian: `make pdf-deps`).

A finalized invoice's PDF never changes. Everything it prints is frozen: its lines and their key shares (frozen with
the invoice, billing.invoices), its number and dates, and its **parties** (the issuer from the MSP's settings,
the customer from the tenant's billing details), copied into `Invoice.parties` when it is finalized (and into
`CreditNote.parties` when a credit note is issued), so a later change of either address leaves it as issued. The
bytes are not stored: they are a pure function of those frozen rows (the same rows give byte-identical PDFs,
tests/unit/test_invoice_pdf.py), rendering one takes tens of milliseconds, and so finalizing (a beat task in one
transaction) never depends on a font stack, nor does a read write. A draft prints the current parties and a
DRAFT watermark. An invoice's PDF lists no credit notes (it would change when one is issued): each credit note is
its own PDF, naming the invoice it corrects.

When the library cannot be loaded (no pango: WeasyPrint raises OSError at import), `unavailable()` says why and the
pages show that instead of a link; the API answers 503 with the reason.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.template.loader import render_to_string
from django.utils import timezone

from marketplace.models import CreditNote, Invoice, InvoiceLine
from tenants.models import Tenant

CSS = Path(settings.BASE_DIR) / "templates" / "pdf" / "document.css"


class PdfUnavailable(Exception):
    """The PDF library cannot be loaded here (the reason is the message)."""


@functools.cache
def _weasyprint():
    try:
        import weasyprint
    except (ImportError, OSError) as exc:  # OSError: a system library (pango, harfbuzz) missing
        return None, f"the PDF library (WeasyPrint) cannot be loaded: {exc}".strip()
    logging.getLogger("weasyprint.progress").setLevel(logging.WARNING)  # (seven INFO lines a document)
    return weasyprint, None


def unavailable() -> str | None:
    """Why PDFs cannot be made here; None when they can."""
    return _weasyprint()[1]


def issuer() -> dict:
    """The MSP as its invoices name it (TESSERA_MSP_NAME, _ADDRESS lines split at ';', _TAX_IDS split at ',')."""
    return {"name": settings.TESSERA_MSP_NAME,
            "address": [x.strip() for x in settings.TESSERA_MSP_ADDRESS.split(";") if x.strip()],
            "tax_ids": [x.strip() for x in settings.TESSERA_MSP_TAX_IDS.split(",") if x.strip()]}


def customer(tenant: Tenant) -> dict:
    """The tenant as its invoices name it: its billing details (the legal name, else its name)."""
    return {"name": tenant.billing_legal_name or tenant.name, "slug": tenant.slug,
            "address": [x.strip() for x in tenant.billing_address.splitlines() if x.strip()],
            "tax_id": tenant.billing_tax_id, "email": tenant.billing_email}


def parties(tenant: Tenant) -> dict:
    """Both parties now: what finalization and credit notes freeze (Invoice.parties, CreditNote.parties)."""
    return {"issuer": issuer(), "customer": customer(tenant)}


def _render(template: str, context: dict) -> bytes:
    weasyprint, why = _weasyprint()
    if weasyprint is None:
        raise PdfUnavailable(why)
    html = render_to_string(template, context)
    return weasyprint.HTML(string=html, base_url=str(CSS.parent)).write_pdf(
        stylesheets=[weasyprint.CSS(filename=str(CSS))])


def invoice_context(invoice: Invoice) -> dict:
    """What the invoice PDF prints: the frozen parties (a draft: the current ones), the lines in order (usage, then
    commitment top-ups), the amounts per tier and per API key."""
    from marketplace.selectors.billing import key_breakdown

    lines = list(InvoiceLine.objects.filter(invoice_id=invoice.pk).select_related("tier").order_by("pk"))
    lines.sort(key=lambda li: li.kind == InvoiceLine.Kind.COMMITMENT_TOPUP)
    tiers: dict[str, Decimal] = defaultdict(Decimal)
    names: dict[str, str] = {}
    for li in lines:
        tiers[li.tier.key] += li.amount
        names[li.tier.key] = li.tier.name
    return {"invoice": invoice, "parties": invoice.parties or parties(invoice.tenant), "lines": lines,
            "by_tier": [{"key": k, "name": names[k], "amount": a} for k, a in sorted(tiers.items())],
            "by_key": key_breakdown(invoice), "draft": invoice.status == Invoice.Status.DRAFT,
            "printed_at": None if invoice.status == Invoice.Status.FINALIZED else timezone.now()}


def invoice_pdf(invoice: Invoice) -> bytes:
    return _render("pdf/invoice.html", invoice_context(invoice))


def credit_note_pdf(cn: CreditNote) -> bytes:
    return _render("pdf/credit_note.html", {
        "cn": cn, "invoice": cn.invoice, "parties": cn.parties or parties(cn.tenant),
        "lines": list(cn.lines.order_by("pk"))})


def link(doc: Invoice | CreditNote) -> str:
    """The API's address of its PDF (`GET /api/v1/invoices/<id>/pdf/`, `.../credit-notes/<id>/pdf/`), absolute when
    TESSERA_SITE_URL is set (the webhooks' `pdf_url`), else the path."""
    from django.urls import reverse

    name = "api:creditnote-pdf" if isinstance(doc, CreditNote) else "api:invoice-pdf"
    return f"{settings.TESSERA_SITE_URL}{reverse(name, args=[doc.pk])}"


def filename(doc: Invoice | CreditNote) -> str:
    if isinstance(doc, CreditNote):
        return f"{doc.number}.pdf"
    return f"{doc.number or f'draft-{doc.tenant.slug}-{doc.period_start:%Y-%m}'}.pdf"
