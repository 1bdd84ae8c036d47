"""Reads for billing."""

from __future__ import annotations

from django.db.models import Prefetch

from marketplace.models import CreditNote, CreditNoteLine, Invoice, InvoiceLine, WebhookEndpoint
from tenants.scoping import Principal


def invoices(principal: Principal):
    return Invoice.objects.visible_to(principal, "billing").select_related("tenant").prefetch_related(
        Prefetch("lines", queryset=InvoiceLine.objects.select_related("tier").order_by("pk")),
        Prefetch("credit_notes", queryset=CreditNote.objects.order_by("pk")))


def credit_notes(principal: Principal):
    return CreditNote.objects.visible_to(principal, "billing").select_related(
        "tenant", "invoice", "recharged_on").prefetch_related(
        Prefetch("lines", queryset=CreditNoteLine.objects.order_by("pk")))


def webhook_endpoints(principal: Principal):
    return WebhookEndpoint.objects.visible_to(principal, "manage_tenant").select_related("tenant")
