"""Usage entries the consumer refused (marketplace.gateway.signing: unsigned, malformed, unknown_key, forged).

None is billed. Each batch's refusals are counted per reason (``UsageRefusal``: the Prometheus counter
``tessera_usage_refused_total{reason}``), logged as one structured error line, and raised to the operators as a
``BillingAlert`` (kind ``refused_usage``) on each existing tenant the refused entries claimed: one open alert per
tenant and month, refreshed while refusals go on (a burst), until an operator resolves it in the admin; the next
refusal after that opens a new one. The claimed tenant is only what the entry says (it is never trusted, and
never a metric label: an attacker would choose it); entries that claim no existing tenant are counted and logged.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from marketplace.models import BillingAlert
from telemetry.models import UsageRefusal
from tenants.models import Tenant

log = logging.getLogger("tessera.gateway.metering")

HINTS = {
    "unsigned": "written without a signature",
    "malformed": "not a usage event entry",
    "unknown_key": "signed with a key this consumer does not hold (a key rotated on the gateways first?)",
    "forged": "signature does not match",
}


@dataclass(frozen=True)
class Refused:
    entry: str  # the stream entry id, or "<spool file>:<byte offset>"
    reason: str
    tenant: int | None  # the tenant the entry claims (untrusted)


def _count(reason: str, n: int, now: datetime, detail: str) -> None:
    fields = {"count": F("count") + n, "last_at": now, "last_detail": detail}
    if UsageRefusal.objects.filter(reason=reason).update(**fields):
        return
    try:
        with transaction.atomic():
            UsageRefusal.objects.create(reason=reason, count=n, last_at=now, last_detail=detail)
    except IntegrityError:  # another consumer created it first
        UsageRefusal.objects.filter(reason=reason).update(**fields)


def _summary(reasons: Counter[str]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))


COUNTS = re.compile(r"\[((?:[a-z_]+=\d+ ?)+)\]")


def _burst_counts(message: str) -> Counter[str]:
    """The per-reason counts an open alert's message carries (``[forged=2 unsigned=1]``)."""
    m = COUNTS.search(message)
    return Counter({k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())}) if m else Counter()


def _alert(tenant_id: int, period, batch: Counter[str], now: datetime, source: str, dead_letter: str) -> None:
    """Open the tenant's refused-usage alert, or add this batch to the open one (the burst's counts)."""
    for attempt in range(2):
        open_ = (BillingAlert.objects.select_for_update()
                 .filter(tenant_id=tenant_id, period_start=period, kind=BillingAlert.Kind.REFUSED_USAGE,
                         resolved_at__isnull=True).first())
        counts = (_burst_counts(open_.message) if open_ is not None else Counter()) + batch
        hints = "; ".join(f"{reason}: {HINTS.get(reason, reason)}" for reason in sorted(counts))
        tally = " ".join(f"{reason}={n}" for reason, n in sorted(counts.items()))
        message = (f"{sum(counts.values())} usage event(s) claiming this tenant refused, none billed "
                   f"[{tally}], the latest at {now:%Y-%m-%d %H:%M:%S} UTC ({hints}). Read from {source}, copied to "
                   f"{dead_letter}. Something that is not a gateway wrote them, or a key is misconfigured: "
                   f"totals in tessera_usage_refused_total.")[:1000]
        if open_ is not None:
            open_.message, open_.at = message, now
            open_.save(update_fields=["message", "at"])
            return
        try:
            with transaction.atomic():
                BillingAlert.objects.create(tenant_id=tenant_id, period_start=period,
                                            kind=BillingAlert.Kind.REFUSED_USAGE, message=message, at=now)
            return
        except IntegrityError:  # another consumer opened it meanwhile: add to that one
            if attempt:
                raise


def record(refused: list[Refused], *, source: str, dead_letter: str, now: datetime | None = None) -> None:
    """Count, log and alert one batch's refusals (one transaction). ``source``: the stream's name or the spool
    folder; ``dead_letter``: where the refused entries were copied."""
    if not refused:
        return
    now = now or timezone.now()
    reasons = Counter(r.reason for r in refused)
    claimed: defaultdict[int, Counter[str]] = defaultdict(Counter)
    for r in refused:
        if r.tenant is not None:
            claimed[r.tenant][r.reason] += 1
    with transaction.atomic():
        for reason in sorted(reasons):
            last = next(r for r in reversed(refused) if r.reason == reason)
            _count(reason, reasons[reason], now, f"{source} {last.entry}"[:500])
        tenants = sorted(Tenant.objects.filter(pk__in=list(claimed)).values_list("pk", flat=True)) if claimed else []
        period = now.date().replace(day=1)
        for tenant_id in tenants:
            _alert(tenant_id, period, claimed[tenant_id], now, source, dead_letter)
    log.error("usage events refused, not billed", extra={
        "refused": len(refused), "reasons": _summary(reasons), "source": source, "dead_letter": dead_letter,
        "claimed_tenants": ",".join(str(t) for t in sorted(claimed)[:20]),
        "entries": ",".join(r.entry for r in refused[:5])})
