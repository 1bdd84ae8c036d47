"""Spend limits: month-to-date spend against each tenant's limit."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from marketplace.models import Invoice, SpendNotice
from marketplace.services import webhooks
from tenants.errors import ServiceError
from tenants.models import Tenant

from .rating import rate
from .units import month_of


class SpendLimitReached(ServiceError):
    status_code = 409


def spend_status(tenant: Tenant, now: datetime | None = None) -> dict:
    """Month-to-date spend against the limit. A read: the month is rated in memory (the invoice's
    currency), nothing is written. A month finalized early counts its final total."""
    now = now or timezone.now()
    period = month_of(now)
    invoice = Invoice.objects.filter(tenant=tenant, period_start=period).first()
    if invoice is not None and invoice.status == Invoice.Status.FINALIZED:
        spend, currency = invoice.total, invoice.currency
    else:
        currency = invoice.currency if invoice is not None else tenant.currency
        spend = rate(tenant, period, now, currency).total
    limit = tenant.monthly_spend_limit
    ratio = (spend / limit) if limit else None
    return {
        "spend": spend, "limit": limit, "currency": currency, "ratio": ratio,
        "warn": ratio is not None and ratio >= tenant.spend_warn_ratio,
        "blocked": ratio is not None and ratio >= tenant.spend_block_ratio,
        "period_start": period,
    }


def check_can_order(tenant: Tenant) -> None:
    s = spend_status(tenant)
    if s["blocked"]:
        raise SpendLimitReached(
            f"monthly spend limit reached: {s['spend']} of {s['limit']} {s['currency']}; new orders are blocked "
            f"until next month or a higher limit", field="tenant", code="spend_limit")


def evaluate_spend(tenant: Tenant, now: datetime | None = None) -> list[str]:
    """Record warn/block notices once per month and send the webhooks."""
    s = spend_status(tenant, now)
    fired: list[str] = []
    for level, hit, event in ((SpendNotice.Level.WARN, s["warn"], "spend_limit.warning"),
                              (SpendNotice.Level.BLOCK, s["blocked"], "spend_limit.reached")):
        if not hit:
            continue
        with transaction.atomic():
            notice, created = SpendNotice.objects.get_or_create(
                tenant=tenant, period_start=s["period_start"], level=level,
                defaults={"spend": s["spend"], "limit": s["limit"]})
            if created:
                webhooks.emit(tenant, event, f"spend:{tenant.pk}:{s['period_start']}:{level}", {
                    "tenant": tenant.slug, "level": level, "spend": str(s["spend"]), "limit": str(s["limit"]),
                    "currency": s["currency"], "period_start": s["period_start"].isoformat()})
                fired.append(level)
    return fired
