"""Billing alerts: what an operator must look at (usage with no price, a rating or a finalization that failed),
recorded once per tenant, period and kind while open, and logged as an error."""

from __future__ import annotations

import logging
from datetime import date

from django.utils import timezone

from marketplace.models import BillingAlert, Invoice
from tenants.models import Tenant

from .rating import Rated

log = logging.getLogger("tessera.billing")


def alert(tenant: Tenant, period_start: date | None, kind: str, message: str) -> BillingAlert:
    """Record (or refresh) an open billing alert for operators, and log it as an error."""
    log.error("billing alert", extra={"tenant": tenant.slug, "kind": kind, "period": str(period_start),
                                      "alert": message})
    a, _ = BillingAlert.objects.update_or_create(
        tenant=tenant, period_start=period_start, kind=kind, resolved_at=None,
        defaults={"message": message[:1000], "at": timezone.now()})
    return a


def resolve_alerts(tenant: Tenant, period_start: date | None, kind: str, why: str = "") -> int:
    """Resolve the open alert of a tenant, period and kind (if any): when (`resolved_at`) and why (`resolution`)."""
    n = BillingAlert.objects.filter(tenant=tenant, period_start=period_start, kind=kind,
                                    resolved_at__isnull=True).update(resolved_at=timezone.now(),
                                                                     resolution=why[:300])
    if n:
        log.info("billing alert resolved", extra={"tenant": tenant.slug, "kind": kind, "period": str(period_start),
                                                  "why": why})
    return n


def note_unpriced(invoice: Invoice, rated: Rated) -> None:
    """After a rating of `invoice`: open (or refresh) its "unpriced" alert listing what had no price, or resolve it
    when everything is priced now (a plan covers the usage, e.g. one back-dated over it by an operator)."""
    if rated.unpriced:
        alert(invoice.tenant, invoice.period_start, BillingAlert.Kind.UNPRICED,
              f"{invoice.period_start:%Y-%m} ({invoice.currency}): " + "; ".join(rated.unpriced))
    else:
        resolve_alerts(invoice.tenant, invoice.period_start, BillingAlert.Kind.UNPRICED,
                       f"re-rated at {timezone.now():%Y-%m-%d %H:%M} UTC: every use of {invoice.period_start:%Y-%m} "
                       f"has a {invoice.currency} price in force now")


def rating_failed(tenant: Tenant, period: date, exc: BaseException) -> None:
    log.error("rating failed", extra={"tenant": tenant.slug, "error": str(exc)})
    alert(tenant, period, BillingAlert.Kind.RATING_FAILED, f"rating {period:%Y-%m} failed: {exc}")
