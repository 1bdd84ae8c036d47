"""Per-model traffic for the tenant's model pages: requests, tokens, errors and latency, aggregated in
the database from the hourly rollups (UsageHourly: what the gateway metered; TritonServedHourly: what
the server reported, with its failures) and the served usage events (latency at the gateway).
A fixed number of queries, whatever the number of deployments or hours."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Avg, Count, Q, Sum

from telemetry.models import TritonServedHourly, UsageEvent, UsageHourly

WINDOWS = [("1 h", timedelta(hours=1)), ("24 h", timedelta(hours=24)), ("7 d", timedelta(days=7))]


def _k(label: str, what: str) -> str:
    """A SQL-safe alias for a window's aggregate."""
    return "w" + label.replace(" ", "") + "_" + what


def _hour_floor(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _zero() -> dict:
    return {"requests": 0, "input_tokens": 0, "output_tokens": 0, "errors": 0, "latency_avg_ms": None}


def traffic_by_deployment(deployment_ids, since: datetime) -> dict[int, dict]:
    """{deployment id: requests, input/output tokens, errors (failures its server reported), average
    latency at the gateway (ms, None without served events)} since `since` — three grouped queries.
    The caller passes ids it may show (already scoped to its tenant)."""
    ids = list(deployment_ids)
    out = {pk: _zero() for pk in ids}
    if not ids:
        return out
    start = _hour_floor(since)
    for r in (UsageHourly.objects.filter(deployment_id__in=ids, hour__gte=start).values("deployment_id")
              .annotate(req=Sum("requests"), tin=Sum("input_tokens"), tout=Sum("output_tokens"))):
        out[r["deployment_id"]].update(requests=int(r["req"] or 0), input_tokens=int(r["tin"] or 0),
                                       output_tokens=int(r["tout"] or 0))
    for dep_id, failures in (TritonServedHourly.objects.filter(deployment_id__in=ids, hour__gte=start)
                             .values("deployment_id").annotate(f=Sum("failures")).values_list("deployment_id", "f")):
        out[dep_id]["errors"] = int(failures or 0)
    for dep_id, avg in (UsageEvent.objects.filter(deployment_id__in=ids, ts__gte=since, latency_ms__isnull=False)
                        .values("deployment_id").annotate(avg=Avg("latency_ms")).values_list("deployment_id", "avg")):
        out[dep_id]["latency_avg_ms"] = round(avg) if avg is not None else None
    return out


def deployment_windows(deployment, now: datetime) -> list[dict]:
    """One deployment over the last hour, day and week: one row per window with requests, tokens,
    errors, error rate and average latency — three queries (conditional aggregates, one per source)."""
    starts = {label: now - span for label, span in WINDOWS}
    usage = UsageHourly.objects.filter(deployment=deployment, hour__gte=_hour_floor(min(starts.values())))
    agg: dict[str, Sum] = {}
    for label, start in starts.items():
        q = Q(hour__gte=_hour_floor(start))
        agg |= {_k(label, what): Sum(what, filter=q) for what in ("requests", "input_tokens", "output_tokens")}
    u = usage.aggregate(**agg)
    served = TritonServedHourly.objects.filter(deployment=deployment, hour__gte=_hour_floor(min(starts.values())))
    f = served.aggregate(**{_k(label, "errors"): Sum("failures", filter=Q(hour__gte=_hour_floor(s)))
                            for label, s in starts.items()})
    events = UsageEvent.objects.filter(deployment=deployment, ts__gte=min(starts.values()), latency_ms__isnull=False)
    lat = events.aggregate(**{_k(label, "lat"): Avg("latency_ms", filter=Q(ts__gte=s)) for label, s in starts.items()},
                           **{_k(label, "n"): Count("pk", filter=Q(ts__gte=s)) for label, s in starts.items()})
    rows = []
    for label, _ in WINDOWS:
        req = int(u[_k(label, "requests")] or 0)
        err = int(f[_k(label, "errors")] or 0)
        avg = lat[_k(label, "lat")]
        rows.append({"window": label, "requests": req, "input_tokens": int(u[_k(label, "input_tokens")] or 0),
                     "output_tokens": int(u[_k(label, "output_tokens")] or 0), "errors": err,
                     "error_rate_pct": (100.0 * err / (req + err)) if (req + err) else None,
                     "latency_avg_ms": round(avg) if avg is not None else None})
    return rows
