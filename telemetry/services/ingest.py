"""Usage ingest: a batch of usage events from a tenant's inference gateway, stored exactly once per
(tenant, event id) and rolled up into UsageHourly in the same transaction.

Three outcomes per item:

- the batch is malformed (not a list of 1..MAX_BATCH objects, an item with a missing field or a wrong
  type): ``BatchInvalid`` (a 400 naming the items by index) and nothing is stored;
- an item is well-formed but not acceptable (a deployment that is not the tenant's, an ambiguous or
  unknown model name, a time in the future, a time before its deployment was created or after it was
  removed, both with MAX_CLOCK_SKEW of slack for the gateway's clock): it is listed in
  ``rejected`` with the reason, the rest of the batch is stored;
- an acceptable item is new (stored and added to its hour) or a duplicate (its event id was seen
  before, or earlier in the same batch: the first occurrence wins, the others are not counted).

PostgreSQL: the accepted rows are COPYed into a session temp table, then one statement inserts them
with ``ON CONFLICT (tenant_id, event_id) DO NOTHING RETURNING`` and upserts the aggregate of exactly
the returned (new) rows into UsageHourly with ``ON CONFLICT .. DO UPDATE SET x = x + EXCLUDED.x``.
Concurrent overlapping batches: the unique index makes the second inserter of an event id wait for
the first and then skip it, so every event is added to its hour once; rows are inserted in event id
order and hours upserted in (deployment, adapter, hour) order, so two batches cannot deadlock on each other.
Other databases (SQLite for the demo): the existing ids are read inside the transaction (SQLite's
writers are serialized: transaction_mode IMMEDIATE) and the rest inserted without ignore_conflicts,
so a race on a database that does not serialize writers fails loudly instead of miscounting.

Late events (an hour already invoiced) are counted into their hour like any other; billing sees the
totals exceed ``billed_*`` and adjusts the next invoice.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import OperationalError, connection, transaction
from django.db.models import F
from django.utils import timezone

from marketplace.models import ModelDeployment
from marketplace.models.deployments import LIVE_DEPLOYMENT_STATES
from marketplace.services.dbretry import is_conflict
from telemetry.models import UsageEvent, UsageHourly
from tenants.errors import Forbidden, ServiceError
from tenants.scoping import Principal

log = logging.getLogger("tessera.ingest")

MAX_BATCH = 10_000
MAX_EVENT_ID = 100
MAX_FUTURE = timedelta(minutes=5)
MAX_CLOCK_SKEW = timedelta(minutes=5)  # an event may be dated this much before its deployment was created
MAX_INT = 2**63 - 1  # the columns are bigint
MAX_REQUESTS = 2**31 - 1  # UsageEvent.requests is an integer column
STAGE = "_tessera_usage_stage"
DEADLOCK_RETRIES = 3


@dataclass
class IngestResult:
    new: int = 0
    duplicates: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"new": self.new, "duplicates": self.duplicates, "rejected": self.rejected}


class BatchInvalid(ServiceError):
    """The batch is refused whole. ``items``: {index: [messages]} for the malformed items."""

    def __init__(self, items: dict[int, list[str]] | None = None, message: str | None = None):
        self.items = items or {}
        if message is None:
            message = f"{len(self.items)} malformed event(s); nothing was stored"
        super().__init__(message, field="events")

    def as_dict(self, operator: bool = False) -> dict:  # no diagnostic: operators read the same
        if self.items:
            return {"events": {str(i): msgs for i, msgs in sorted(self.items.items())}, "detail": self.message}
        return {"events": [self.message]}


# --- validation ------------------------------------------------------------------------------------

def _int(value: Any, name: str, minimum: int, maximum: int, errs: list[str]) -> int:
    if type(value) is not int:  # bool is an int subclass: refused here too
        errs.append(f"{name} must be an integer" if value is not None else f"{name} is required")
        return 0
    if value < minimum or value > maximum:
        errs.append(f"{name} must be between {minimum} and {maximum}")
    return value


def parse_batch(events: Any) -> list[tuple]:
    """Well-formedness only (no database): (index, event_id, deployment_id|None, model|None, ts, input,
    output, requests) per item, or BatchInvalid naming every malformed item."""
    if not isinstance(events, list):
        raise BatchInvalid(message="events must be a list of event objects")
    if not events:
        raise BatchInvalid(message="the batch is empty")
    if len(events) > MAX_BATCH:
        raise BatchInvalid(message=f"a batch holds at most {MAX_BATCH} events; this one has {len(events)}")
    bad: dict[int, list[str]] = {}
    out = []
    fromiso = datetime.fromisoformat
    for i, e in enumerate(events):
        if type(e) is not dict:
            bad[i] = ["an event must be an object"]
            continue
        errs: list[str] = []
        eid = e.get("event_id")
        if type(eid) is not str or not 0 < len(eid) <= MAX_EVENT_ID:
            errs.append("event_id is required" if eid is None else
                        f"event_id must be a string of 1 to {MAX_EVENT_ID} characters")
        dep = e.get("deployment")
        model = e.get("model")
        if dep is None and model is None:
            errs.append("give deployment (id) or model (name)")
        if dep is not None and (type(dep) is not int or dep <= 0):
            errs.append("deployment must be a positive integer id")
        if model is not None and (type(model) is not str or not 0 < len(model) <= 64):
            errs.append("model must be a model name (1 to 64 characters)")
        raw_ts = e.get("ts")
        ts = None
        if type(raw_ts) is not str:
            errs.append("ts is required" if raw_ts is None else "ts must be an ISO 8601 string")
        else:
            try:
                ts = fromiso(raw_ts)
            except ValueError:
                errs.append("ts is not a valid ISO 8601 time")
            else:
                if ts.tzinfo is None or ts.utcoffset() is None:
                    errs.append("ts must carry a timezone (e.g. 2025-01-31T12:00:00Z)")
                    ts = None
                else:
                    ts = ts.astimezone(UTC)
        n_in = _int(e.get("input_tokens"), "input_tokens", 0, MAX_INT, errs)
        n_out = _int(e.get("output_tokens"), "output_tokens", 0, MAX_INT, errs)
        req = e.get("requests", 1)
        req = _int(req, "requests", 1, MAX_REQUESTS, errs)
        if errs:
            bad[i] = errs
        else:
            out.append((i, eid, dep, model, ts, n_in, n_out, req))
    if bad:
        raise BatchInvalid(bad)
    return out


# --- resolution ------------------------------------------------------------------------------------

def _resolve(tenant_id: int, items: list[tuple], now: datetime) -> tuple[list[tuple], list[dict], int]:
    """Accepted rows (event_id, deployment_id, ts, input, output, requests) in batch order with the
    in-batch duplicates removed, the rejected items, and how many in-batch duplicates there were."""
    ids = {it[2] for it in items if it[2] is not None}
    names = {it[3] for it in items if it[2] is None}
    by_id: dict[int, tuple] = {}
    by_name: dict[str, list[int]] = defaultdict(list)
    if ids:
        for pk, name, state, updated, created in ModelDeployment.objects.filter(
                tenant_id=tenant_id, pk__in=ids).values_list("pk", "name", "state", "updated_at", "created_at"):
            by_id[pk] = (name, state, updated, created)
    if names:
        for pk, name, state, updated, created in ModelDeployment.objects.filter(
                tenant_id=tenant_id, name__in=names, state__in=LIVE_DEPLOYMENT_STATES).values_list(
                "pk", "name", "state", "updated_at", "created_at"):
            by_id.setdefault(pk, (name, state, updated, created))
            by_name[name].append(pk)
    latest = now + MAX_FUTURE
    removed = ModelDeployment.State.REMOVED
    rows: list[tuple] = []
    rejected: list[dict] = []
    seen: set[str] = set()
    dupes = 0
    for i, eid, dep, model, ts, n_in, n_out, req in items:
        reason = None
        if dep is None:
            found = by_name.get(model, ())
            if not found:
                reason = f"no live deployment named {model!r} in this tenant"
            elif len(found) > 1:
                reason = (f"model name {model!r} is ambiguous ({len(found)} live deployments); "
                          f"give the deployment id")
            else:
                dep = found[0]
        else:
            info = by_id.get(dep)
            if info is None:
                reason = f"no deployment {dep} in this tenant"
            elif model is not None and model != info[0]:
                reason = f"deployment {dep} is {info[0]!r}, not {model!r}"
            elif info[1] == removed and ts > info[2]:
                reason = f"deployment {dep} was removed at {info[2].isoformat()}, before this event"
        if reason is None and ts > latest:
            reason = "ts is more than 5 minutes in the future"
        if reason is None and ts < by_id[dep][3] - MAX_CLOCK_SKEW:
            reason = (f"deployment {dep} was created at {by_id[dep][3].isoformat()}, after this event "
                      f"(more than {int(MAX_CLOCK_SKEW.total_seconds() // 60)} minutes of clock skew)")
        if reason is not None:
            rejected.append({"index": i, "event_id": eid, "reason": reason})
            continue
        if eid in seen:
            dupes += 1
            continue
        seen.add(eid)
        rows.append((eid, dep, ts, n_in, n_out, req))
    return rows, rejected, dupes


# --- storage ---------------------------------------------------------------------------------------

def _hour(ts: datetime) -> datetime:
    return ts.replace(minute=0, second=0, microsecond=0)


def _sql() -> tuple[str, str]:
    ev, hr = UsageEvent._meta.db_table, UsageHourly._meta.db_table
    stage = (f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} (event_id text NOT NULL, deployment_id bigint NOT NULL, "
             f"ts timestamptz NOT NULL, input_tokens bigint NOT NULL, output_tokens bigint NOT NULL, "
             f"requests integer NOT NULL, latency_ms integer, adapter text NOT NULL, api_key text NOT NULL) "
             f"ON COMMIT DELETE ROWS")
    sums = ", ".join(f"{c} = {hr}.{c} + EXCLUDED.{c}" for c in ("input_tokens", "output_tokens", "requests", "events"))
    upsert = f"""
        WITH ins AS (
            INSERT INTO {ev} (tenant_id, deployment_id, event_id, ts, input_tokens, output_tokens, requests,
                              received_at, latency_ms, adapter, api_key)
            SELECT %(tenant)s, deployment_id, event_id, ts, input_tokens, output_tokens, requests, %(now)s, latency_ms,
                   adapter, api_key
            FROM {STAGE} ORDER BY event_id COLLATE "C"
            ON CONFLICT (tenant_id, event_id) DO NOTHING
            RETURNING deployment_id, adapter, api_key, ts, input_tokens, output_tokens, requests
        ), agg AS (
            SELECT deployment_id, adapter, api_key,
                   date_trunc('hour', ts AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS hour,
                   sum(input_tokens) AS i, sum(output_tokens) AS o, sum(requests) AS r, count(*) AS n
            FROM ins GROUP BY 1, 2, 3, 4
        ), up AS (
            INSERT INTO {hr} (tenant_id, deployment_id, adapter, api_key, hour, input_tokens, output_tokens, requests,
                              events,
                              billed_input_tokens, billed_output_tokens, billed_requests, updated_at)
            SELECT %(tenant)s, deployment_id, adapter, api_key, hour, i, o, r, n, 0, 0, 0, %(now)s FROM agg
            ORDER BY deployment_id, hour, adapter COLLATE "C", api_key COLLATE "C"  -- (days in order: UsageDaily)
            ON CONFLICT (tenant_id, deployment_id, adapter, api_key, hour) DO UPDATE SET {sums},
                updated_at = EXCLUDED.updated_at
            RETURNING 1
        )
        SELECT coalesce(sum(n), 0)::bigint, (SELECT count(*) FROM up) FROM agg
    """
    return stage, upsert


def _store_postgresql(tenant_id: int, rows: list[tuple], now: datetime) -> int:
    stage_ddl, upsert = _sql()
    # wrap_database_errors: Django wraps execute() but not the driver's copy(); a connection lost
    # mid-COPY must reach the API as Django's OperationalError (a JSON 503), not a raw psycopg error.
    with connection.wrap_database_errors, connection.cursor() as cur:
        cur.execute(stage_ddl)
        cur.execute(f"DELETE FROM {STAGE}")  # empty unless an outer transaction (tests) reused it
        with cur.copy(f"COPY {STAGE} (event_id, deployment_id, ts, input_tokens, output_tokens, requests, "
                      f"latency_ms, adapter, api_key) FROM STDIN") as copy:
            write = copy.write_row
            for row in rows:
                write(row)
        cur.execute(upsert, {"tenant": tenant_id, "now": now})
        new, _hours = cur.fetchone()
        cur.execute(f"DELETE FROM {STAGE}")
    return int(new)


def _store_portable(tenant_id: int, rows: list[tuple], now: datetime) -> int:
    ids = [r[0] for r in rows]
    existing: set[str] = set()
    for k in range(0, len(ids), 500):
        existing.update(UsageEvent.objects.filter(tenant_id=tenant_id, event_id__in=ids[k:k + 500])
                        .values_list("event_id", flat=True))
    new = [r for r in rows if r[0] not in existing]
    UsageEvent.objects.bulk_create(
        [UsageEvent(tenant_id=tenant_id, deployment_id=dep, event_id=eid, ts=ts, input_tokens=i, output_tokens=o,
                    requests=r, received_at=now, latency_ms=ms, adapter=lora, api_key=key)
         for eid, dep, ts, i, o, r, ms, lora, key in new], batch_size=500)
    agg: dict[tuple[int, datetime, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for _eid, dep, ts, i, o, r, _ms, lora, key in new:
        a = agg[(dep, _hour(ts), lora, key)]
        a[0] += i
        a[1] += o
        a[2] += r
        a[3] += 1
    for (dep, hour, lora, key), (i, o, r, n) in sorted(agg.items()):
        updated = UsageHourly.objects.filter(tenant_id=tenant_id, deployment_id=dep, adapter=lora, api_key=key,
                                             hour=hour).update(
            input_tokens=F("input_tokens") + i, output_tokens=F("output_tokens") + o, requests=F("requests") + r,
            events=F("events") + n, updated_at=now)
        if not updated:
            UsageHourly.objects.create(tenant_id=tenant_id, deployment_id=dep, adapter=lora, api_key=key, hour=hour,
                                       input_tokens=i, output_tokens=o, requests=r, events=n, updated_at=now)
    return len(new)


#: what a row of 6, 7 or 8 values leaves out: latency_ms, adapter, api key prefix
ROW_DEFAULTS = (None, "", "")


def store_rows(tenant_id: int, rows: list[tuple], now: datetime | None = None) -> int:
    """Store accepted rows (event_id, deployment_id, ts UTC, input, output, requests[, latency_ms[, adapter[,
    api key prefix]]]), unique event ids; returns how many were new. One transaction: events and their hours
    together. Only the gateway measures latency_ms and knows the LoRA adapter a request selected ("": the base
    model) and the API key it served it for ("": none)."""
    if not rows:
        return 0
    rows = [(*r, *ROW_DEFAULTS[len(r) - 6:]) for r in rows]
    now = now or timezone.now()
    store = _store_postgresql if connection.vendor == "postgresql" else _store_portable
    outermost = not connection.in_atomic_block
    for attempt in range(DEADLOCK_RETRIES):
        try:
            with transaction.atomic():
                return store(tenant_id, rows, now)
        except OperationalError as exc:
            if not outermost or attempt == DEADLOCK_RETRIES - 1 or not is_conflict(exc):
                raise
            log.warning("usage ingest deadlocked; retrying", extra={"tenant": tenant_id, "attempt": attempt + 1})
    raise AssertionError("unreachable")


# --- the service -----------------------------------------------------------------------------------

def ingest_batch(principal: Principal, tenant, events: Any) -> IngestResult:
    """Validate, resolve and store one batch for `tenant` (a Tenant or its id)."""
    tenant_id = getattr(tenant, "pk", tenant)
    if not principal.can("usage", tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow reporting usage for this tenant.")
    items = parse_batch(events)
    now = timezone.now()
    rows, rejected, dupes = _resolve(tenant_id, items, now)
    new = store_rows(tenant_id, rows, now)
    result = IngestResult(new=new, duplicates=dupes + len(rows) - new, rejected=rejected)
    log.info("usage batch", extra={"tenant": tenant_id, "events": len(items), "new": result.new,
                                   "duplicates": result.duplicates, "rejected": len(rejected)})
    return result
