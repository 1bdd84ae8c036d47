"""The rating beat: every `TESSERA_RATING_INTERVAL_S` it opens the missing invoices and fans out one task per
tenant (queue "control") that finalizes the tenant's ended months, re-rates its current draft and checks its
spend (billing.spend) in one transaction; the last task to finish records the run's summary."""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from marketplace import enqueue
from marketplace.models import BillingAlert, Invoice, RatingRun, RatingRunTenant
from tenants import audit
from tenants.models import Tenant

from . import spend
from .alerts import rating_failed, resolve_alerts
from .invoices import ENSURE_LOOKBACK, ensure_invoices, finalize_due, finalize_tenant_due, refresh
from .units import month_of

log = logging.getLogger("tessera.billing")


def rate_tenant(tenant: Tenant, now: datetime | None = None) -> list[str]:
    """Re-rate one tenant's current draft and check its spend, in one transaction; clears its rating
    alert. Returns the spend notices that fired. Raises on failure (the caller alerts)."""
    now = now or timezone.now()
    period = month_of(now)
    with transaction.atomic():
        inv = Invoice.objects.filter(tenant=tenant, period_start=period).first()
        if inv is not None and inv.status == Invoice.Status.DRAFT:
            refresh(inv, now)
        fired = spend.evaluate_spend(tenant, now)
    resolve_alerts(tenant, period, BillingAlert.Kind.RATING_FAILED, "the next rating succeeded")
    return fired


def start_rating_run(now: datetime | None = None) -> RatingRun:
    """The rating beat, fanned out: open missing invoices, then one task per tenant with an invoice this
    month or a draft whose month has ended (queue "control", retried on its own): each finalizes its
    tenant's ended months and re-rates its current draft, so month end is spread over the tenants' tasks
    too; the last to finish runs `finish_rating_run`. Its own work is a few queries whatever the number
    of tenants."""
    now = now or timezone.now()
    ensure_invoices(now, since=now - ENSURE_LOOKBACK)
    period = month_of(now)
    with transaction.atomic():
        run = RatingRun.objects.create(period_start=period, started_at=now)
        ids = sorted(set(Invoice.objects.filter(
            Q(period_start=period) | Q(status=Invoice.Status.DRAFT, period_end__lte=now.date()))
            .values_list("tenant_id", flat=True)))
        RatingRunTenant.objects.bulk_create([RatingRunTenant(run=run, tenant_id=t) for t in ids])
        if ids:
            def send_all() -> None:
                for t in ids:
                    enqueue.send(enqueue.RATE_TENANT, [run.pk, t], "control")

            transaction.on_commit(send_all)
    if not ids:
        finish_rating_run(run.pk)
    log.info("rating run started", extra={"run": run.pk, "tenants": len(ids)})
    return run


def rate_run_tenant(run_id: int, tenant_id: int, *, final_attempt: bool) -> str:
    """One tenant of a rating run (its task): rate it; a failure is re-raised for the task to retry
    until `final_attempt`, which records it. Counts once however often it is retried or redelivered."""
    item = RatingRunTenant.objects.select_related("run", "tenant").get(run_id=run_id, tenant_id=tenant_id)
    if item.status != RatingRunTenant.Status.PENDING:
        return item.status
    RatingRunTenant.objects.filter(pk=item.pk).update(attempts=F("attempts") + 1)
    try:
        now = timezone.now()
        finalize_tenant_due(tenant_id, now)  # month end: this tenant's ended months (alerted, not raised)
        fired = rate_tenant(item.tenant, now)
    except Exception as exc:
        if not final_attempt:
            raise
        rating_failed(item.tenant, item.run.period_start, exc)
        status, fired, error = RatingRunTenant.Status.FAILED, [], str(exc)[:500]
    else:
        status, error = RatingRunTenant.Status.DONE, ""
    marked = RatingRunTenant.objects.filter(pk=item.pk, status=RatingRunTenant.Status.PENDING).update(
        status=status, error=error, notices=fired)
    if marked and not RatingRunTenant.objects.filter(run_id=run_id, status=RatingRunTenant.Status.PENDING).exists():
        finish_rating_run(run_id)
    return status


def finish_rating_run(run_id: int) -> dict | None:
    """Once every tenant of the run is done: finalize the months that ended and record the summary (an
    audit event). Runs once per run (the first caller to set finished_at)."""
    now = timezone.now()
    if not RatingRun.objects.filter(pk=run_id, finished_at__isnull=True).update(finished_at=now):
        return None
    run = RatingRun.objects.get(pk=run_id)
    counts = dict(run.tenants.values_list("status").annotate(n=Count("pk")).values_list("status", "n"))
    failed = list(run.tenants.filter(status=RatingRunTenant.Status.FAILED).values_list("tenant__slug", flat=True))
    summary = {"period": f"{run.period_start:%Y-%m}", "rated": counts.get(RatingRunTenant.Status.DONE, 0),
               "failed": failed, "finalized": _run_finalized(run, finalize_due(now, ensure=False)),
               "seconds": round((now - run.started_at).total_seconds(), 3)}
    RatingRun.objects.filter(pk=run_id).update(summary=summary)
    audit.record("system:beat", "billing.rating_run", f"rating-run:{run_id}", None, **summary)
    log.info("rating run finished", extra={"run": run_id, **{k: v for k, v in summary.items() if k != "failed"},
                                           "failed": len(failed)})
    return summary


def _run_finalized(run: RatingRun, stragglers: list[str]) -> list[str]:
    """The invoice numbers the run finalized: by its tenants' tasks (month end fanned out), plus any
    draft `finalize_due` caught at the end (normally none)."""
    by_tasks = Invoice.objects.filter(tenant_id__in=run.tenants.values("tenant_id"), status=Invoice.Status.FINALIZED,
                                      finalized_at__gte=run.started_at, finalized_at__lte=run.finished_at)
    numbers = {n for n in by_tasks.values_list("number", flat=True) if n is not None}  # finalized: all numbered
    return sorted(numbers | set(stragglers))
