"""Billing code that only tests need (moved out of marketplace.services.billing: product code never calls it).

- ``rated_lines_many``: the invoices' own lines (``rate_month`` per deployment line, through ``rate_months_many``)
  of every month a range touches, cut into pieces at the range's hours: the reference the charts' second copy
  (``billing.spread.spread_amounts``) is held equal to, spread with ``amount_between`` / ``amount_by_bucket``.
- ``rate_all``: the rating beat's per-tenant tasks (``billing.runs.rate_tenant``) run in this process, then the
  month-end finalization: what a test (or a bench) does instead of a Celery worker.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime

from django.utils import timezone

from marketplace.services.billing import invoices, runs
from marketplace.services.billing.alerts import rating_failed
from marketplace.services.billing.rating import Draft, L, rate_months_many
from marketplace.services.billing.spread import _whole_hours
from marketplace.services.billing.units import bounds, month_of, months
from tenants.models import Tenant

log = logging.getLogger("tessera.billing")

#: lines about another month's usage or another invoice: the charts count each month's own lines only
NOT_THIS_MONTH = (L.ADJUSTMENT_INPUT, L.ADJUSTMENT_OUTPUT, L.COMMITMENT_CREDIT, L.CORRECTION)


def rated_lines(tenant: Tenant, start: datetime, end: datetime, now: datetime | None = None,
                step: int = 10**9) -> list[tuple[Draft, str]]:
    """One tenant's `rated_lines_many`."""
    return rated_lines_many([tenant], start, end, now, step).get(tenant.pk, [])


def rated_lines_many(tenants: list[Tenant], start: datetime, end: datetime, now: datetime | None = None,
                     step: int = 10**9) -> dict[int, list[tuple[Draft, str]]]:
    """Each month [start, end) touches rated for each tenant exactly as its invoice is (the invoice's currency,
    reserved commitments included), as tenant id -> [(line, currency)]. Adjustment lines, commitment credits and
    corrections are left out: late usage is counted in the month it happened (that month's own rating includes
    it). Spread a line over [start, end) or over UTC buckets of `step` seconds inside it with `amount_between`
    (exact: token pieces are cut there)."""
    now = now or timezone.now()
    lo, hi = _whole_hours(start, end)
    out: dict[int, list[tuple[Draft, str]]] = defaultdict(list)
    if not tenants:
        return out
    for m in months(start, min(end, now)):
        _, m_end = bounds(m)
        for tid, (drafts, currency) in rate_months_many(tenants, m, min(now, m_end), (step, lo, hi)).items():
            out[tid].extend((d, currency) for d in drafts if d.kind not in NOT_THIS_MONTH)
    return out


def rate_all(now: datetime | None = None) -> dict:
    """Re-rate every tenant's current draft and check its spend, in this process: each tenant in its own
    transaction; a tenant that fails is recorded (BillingAlert) and the others go on. Then the month-end
    finalization."""
    now = now or timezone.now()
    invoices.ensure_invoices(now, since=now - invoices.ENSURE_LOOKBACK)
    notices, failed = {}, []
    period = month_of(now)
    for t in Tenant.objects.filter(invoices__period_start=period).order_by("pk"):
        try:
            fired = runs.rate_tenant(t, now)
            if fired:
                notices[t.slug] = fired
        except Exception as exc:  # recorded and alerted; the other tenants go on
            log.exception("rating failed", extra={"tenant": t.slug})
            rating_failed(t, period, exc)
            failed.append(t.slug)
    return {"finalized": invoices.finalize_due(now, ensure=False), "notices": notices, "failed": failed}
