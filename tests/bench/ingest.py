"""Benchmark (PostgreSQL): usage ingest through the real endpoint against raw staged COPY + INSERT ..
ON CONFLICT into the same table, same run; and a tenant-month usage summary from the rollups against a
raw GROUP BY over the usage events.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tessera .venv/bin/python tests/bench/ingest.py \
        [--batches-1k 150] [--batches-10k 15] [--tenants 1000] [--events 10000000] [--runs 200]

A scratch database `tessera_bench_ingest` is created next to DATABASE_URL's (and dropped at the end
unless --keep).

(a) Ingest. Endpoint: POST /api/v1/usage/events/ through Django's test client (the whole WSGI stack:
middleware, API-key authentication, DRF JSON parsing, validation, deployment resolution, COPY into a
stage, INSERT .. ON CONFLICT .. RETURNING, hourly rollup upsert, JSON response); request bodies are
serialized before the clock starts. Raw: the same events as ready-made tuples, COPY into a temp stage +
INSERT INTO telemetry_usageevent SELECT .. ON CONFLICT DO NOTHING, one transaction per batch, no
validation and no rollup. Endpoint and raw batches alternate so both see the same table size.

(b) Summary. UsageHourly is generated directly: `tenants` tenants x 3 deployments x 720 hours (June
2025); the hour rows' `events` add up to `events` (10M by default). Two of the tenants get real raw
events instead (the average share, events/tenants, and a heavy tenant with 30x that), and their hour
rows are the GROUP BY of those events, so the summary can be checked against the raw baseline. Timed:
usage_summary(tenant key, June, group_by="deployment") (3 queries: the aggregate, tenant and
deployment names) against SELECT deployment_id, sum(..) FROM telemetry_usageevent WHERE tenant_id=..
AND ts in June GROUP BY deployment_id (the (tenant, ts) index; it scans exactly that tenant-month's
events, nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DB_NAME = "tessera_bench_ingest"


def configure() -> str:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        sys.exit("this benchmark needs PostgreSQL: set DATABASE_URL=postgres://...")
    import psycopg

    base, _, _name = url.rpartition("/")
    with psycopg.connect(f"{base}/postgres", autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")
        c.execute(f"CREATE DATABASE {DB_NAME}")
    os.environ["DATABASE_URL"] = f"{base}/{DB_NAME}"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ.setdefault("TESSERA_USAGE_INGEST_RATE", "")  # measure ingest, not the rate limit
    os.environ.setdefault("TESSERA_API_RATE", "")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return base


def drop(base: str) -> None:
    import psycopg
    from django.db import connections

    connections.close_all()
    with psycopg.connect(f"{base}/postgres", autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    k = max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))
    return values[k]


def make_world(n_tenants: int):
    """n tenants, each with one order, 3 active allocations, 3 ready deployments (no hardware)."""
    from marketplace.models import Allocation, ModelDeployment, Order
    from marketplace.services.catalog import sync_catalog
    from tenants.models import Tenant
    from tests.fleet_fixtures import make_tier

    sync_catalog()
    tier = make_tier("bench-1g", "h100-sxm-80gb", "1g.10gb")
    tenants = Tenant.objects.bulk_create([Tenant(name=f"T{i}", slug=f"t{i:04d}", billing_email=f"b@t{i}.example")
                                          for i in range(n_tenants)], batch_size=1000)
    order_objs = Order.objects.bulk_create([Order(tenant=t, tier=tier) for t in tenants], batch_size=1000)
    allocs = Allocation.objects.bulk_create(
        [Allocation(order=o, tenant_id=o.tenant_id, tier=tier, state="active") for o in order_objs for _ in range(3)],
        batch_size=1000)
    deps = ModelDeployment.objects.bulk_create(
        [ModelDeployment(allocation=a, tenant_id=a.tenant_id, name=f"m{k % 3}", backend="python", spec={},
                         memory_mb=1, state="ready", created_at=datetime(2024, 12, 1, tzinfo=UTC))
         for k, a in enumerate(allocs)], batch_size=1000)
    by_tenant: dict[int, list[int]] = {}
    for d in deps:
        by_tenant.setdefault(d.tenant_id, []).append(d.pk)
    return tenants, by_tenant


def bench_ingest(tenant, dep_ids: list[int], batches: dict[int, int]) -> list[tuple]:
    from django.db import connection, transaction
    from django.test import Client

    from telemetry.models import UsageEvent
    from telemetry.services import ingest
    from tests.factories import OperatorFactory, make_key

    # reporting usage is for operator keys only (a tenant's key may not write its own bill)
    _, secret = make_key(None, ["usage:write"], created_by=OperatorFactory())
    client = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
    now = datetime.now(UTC).replace(microsecond=0)
    counter = iter(range(10**9))

    def batch(size: int) -> list[dict]:
        out = []
        for _ in range(size):
            n = next(counter)
            out.append({"event_id": f"req-{n:09d}-{n * 7919 % 1000003:07d}", "deployment": dep_ids[n % 3],
                        "ts": (now - timedelta(seconds=n % 86_400)).isoformat(),
                        "input_tokens": 50 + n % 977, "output_tokens": 20 + n % 333, "requests": 1})
        return out

    def as_rows(events: list[dict]) -> list[tuple]:
        return [(e["event_id"], e["deployment"], datetime.fromisoformat(e["ts"]), e["input_tokens"],
                 e["output_tokens"], e["requests"]) for e in events]

    ev, stage = UsageEvent._meta.db_table, "_bench_raw_stage"
    raw_sql = (f"INSERT INTO {ev} (tenant_id, deployment_id, event_id, ts, input_tokens, output_tokens, requests, "
               f"received_at, adapter) SELECT %s, deployment_id, event_id, ts, input_tokens, output_tokens, requests, "
               f"now(), '' FROM {stage} ON CONFLICT (tenant_id, event_id) DO NOTHING")

    def raw(rows: list[tuple]) -> int:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS {stage} (event_id text, deployment_id bigint, "
                        f"ts timestamptz, input_tokens bigint, output_tokens bigint, requests integer) "
                        f"ON COMMIT DELETE ROWS")
            with cur.copy(f"COPY {stage} (event_id, deployment_id, ts, input_tokens, output_tokens, requests) "
                          f"FROM STDIN") as copy:
                for r in rows:
                    copy.write_row(r)
            cur.execute(raw_sql, [tenant.pk])
            return cur.rowcount

    def endpoint(body: bytes) -> dict:
        r = client.post("/api/v1/usage/events/", data=body, content_type="application/json")
        assert r.status_code == 200, r.content[:500]
        return r.json()

    # warm up both paths (connection, temp tables, plans)
    endpoint(json.dumps({"tenant": tenant.slug, "events": batch(100)}).encode())
    raw(as_rows(batch(100)))
    results = []
    for size, n in batches.items():
        t_api = t_raw = 0.0
        new_api = new_raw = 0
        for _ in range(n):
            body = json.dumps({"tenant": tenant.slug, "events": batch(size)}).encode()
            rows = as_rows(batch(size))
            t0 = time.perf_counter()
            out = endpoint(body)
            t_api += time.perf_counter() - t0
            new_api += out["new"]
            t0 = time.perf_counter()
            new_raw += raw(rows)
            t_raw += time.perf_counter() - t0
        assert new_api == new_raw == size * n, (new_api, new_raw)
        results.append((size, n, size * n / t_api, size * n / t_raw, t_api / n * 1000, t_raw / n * 1000))
    # a replay: the same 1,000-event batch again (all duplicates)
    events = batch(1000)
    body = json.dumps({"tenant": tenant.slug, "events": events}).encode()
    endpoint(body)
    t0 = time.perf_counter()
    for _ in range(10):
        assert endpoint(body)["duplicates"] == 1000
    replay = 10_000 / (time.perf_counter() - t0)
    # the service alone (no HTTP, no JSON) on 10,000-event batches, for where the time goes
    p = ingest.Principal(is_operator=True)
    t_svc = 0.0
    for _ in range(5):
        events = batch(10_000)
        t0 = time.perf_counter()
        ingest.ingest_batch(p, tenant, events)
        t_svc += time.perf_counter() - t0
    return results, replay, 50_000 / t_svc


def bench_summary(tenants, by_tenant, total_events: int, runs: int):
    from django.db import connection

    from telemetry import selectors
    from telemetry.models import UsageEvent, UsageHourly
    from tenants.scoping import principal_for_key
    from tests.factories import make_key

    start = datetime(2025, 6, 1, tzinfo=UTC)
    end = start + timedelta(hours=720)
    n_t = len(tenants)
    avg, heavy = tenants[1], tenants[2]  # tenants[0] took the ingest benchmark (its events are of today)
    raw_sizes = {avg.pk: total_events // n_t, heavy.pk: 30 * (total_events // n_t)}
    ev, hr = UsageEvent._meta.db_table, UsageHourly._meta.db_table
    t0 = time.perf_counter()
    with connection.cursor() as cur:
        # raw events for the two measured tenants, spread over the month and their 3 deployments
        for t_id, n in raw_sizes.items():
            d = by_tenant[t_id]
            cur.execute(f"""
                INSERT INTO {ev} (tenant_id, deployment_id, event_id, ts, input_tokens, output_tokens, requests,
                                  received_at, adapter)
                SELECT %s, (ARRAY[%s, %s, %s])[1 + g %% 3], 'raw-' || g,
                       %s::timestamptz + ((g * 2592000::bigint) / %s) * interval '1 second',
                       100 + g %% 900, 10 + g %% 290, 1 + g %% 2, now(), ''
                FROM generate_series(0, %s - 1) g""", [t_id, *d, start, n, n])
            cur.execute(f"""
                INSERT INTO {hr} (tenant_id, deployment_id, hour, input_tokens, output_tokens, requests, events,
                                  billed_input_tokens, billed_output_tokens, billed_requests, updated_at, adapter)
                SELECT tenant_id, deployment_id, date_trunc('hour', ts AT TIME ZONE 'UTC') AT TIME ZONE 'UTC',
                       sum(input_tokens), sum(output_tokens), sum(requests), count(*), 0, 0, 0, now(), ''
                FROM {ev} WHERE tenant_id = %s GROUP BY 1, 2, 3""", [t_id])
        raw_hours = sum(raw_sizes.values())
        # synthetic hour rows for every other tenant: 3 deployments x 720 hours, events 4 or 5 per row
        others = [t.pk for t in tenants if t.pk not in raw_sizes]
        n_rows = len(others) * 3 * 720
        remaining = max(0, total_events - raw_hours)
        per, extra = divmod(remaining, n_rows) if n_rows else (0, 0)
        cur.execute(f"""
            INSERT INTO {hr} (tenant_id, deployment_id, hour, input_tokens, output_tokens, requests, events,
                              billed_input_tokens, billed_output_tokens, billed_requests, updated_at, adapter)
            SELECT d.tenant_id, d.id, %s::timestamptz + h * interval '1 hour',
                   e * 400, e * 120, e, e, 0, 0, 0, now(), ''
            FROM (SELECT id, tenant_id, row_number() OVER (ORDER BY id) - 1 AS k
                  FROM marketplace_modeldeployment WHERE tenant_id = ANY(%s)) d
            CROSS JOIN generate_series(0, 719) h
            CROSS JOIN LATERAL (SELECT %s + CASE WHEN d.k * 720 + h < %s THEN 1 ELSE 0 END AS e) x""",
                    [start, others, per, extra])
        cur.execute(f"ANALYZE {ev}")
        cur.execute(f"ANALYZE {hr}")
        cur.execute(f"SELECT count(*), sum(events) FROM {hr} WHERE hour >= %s AND hour < %s", [start, end])
        hour_rows, hour_events = cur.fetchone()
        cur.execute(f"SELECT count(*) FROM {ev}")
        raw_total = cur.fetchone()[0]
    gen_s = time.perf_counter() - t0

    raw_group = (f"SELECT deployment_id, sum(input_tokens), sum(output_tokens), sum(requests), count(*) "
                 f"FROM {ev} WHERE tenant_id = %s AND ts >= %s AND ts < %s GROUP BY deployment_id "
                 f"ORDER BY deployment_id")
    out = []
    for label, tenant in (("average", avg), ("heavy", heavy)):
        p = principal_for_key(make_key(tenant, ["billing:read"])[0])
        summary = selectors.usage_summary(p, start, end, "deployment")
        with connection.cursor() as cur:
            cur.execute(raw_group, [tenant.pk, start, end])
            raw_rows = cur.fetchall()
        assert [(r["deployment"], r["input_tokens"], r["output_tokens"], r["requests"], r["events"])
                for r in summary] == [tuple(int(v) for v in row) for row in raw_rows], "summary != raw GROUP BY"
        t_sum, t_raw = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            selectors.usage_summary(p, start, end, "deployment")
            t_sum.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            with connection.cursor() as cur:
                cur.execute(raw_group, [tenant.pk, start, end])
                cur.fetchall()
            t_raw.append((time.perf_counter() - t0) * 1000)
        day = []
        for _ in range(max(20, runs // 4)):
            t0 = time.perf_counter()
            selectors.usage_summary(p, start, end, "day")
            day.append((time.perf_counter() - t0) * 1000)
        out.append((label, raw_sizes[tenant.pk], t_sum, t_raw, day))
    return out, hour_rows, hour_events, raw_total, gen_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches-1k", type=int, default=150)
    ap.add_argument("--batches-10k", type=int, default=15)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = ap.parse_args()
    base = configure()
    t_start = time.perf_counter()
    from django.db import connection

    tenants, by_tenant = make_world(args.tenants)
    ingest_rows, replay, svc = bench_ingest(tenants[0], by_tenant[tenants[0].pk],
                                            {1000: args.batches_1k, 10_000: args.batches_10k})
    summary, hour_rows, hour_events, raw_total, gen_s = bench_summary(tenants, by_tenant, args.events, args.runs)
    with connection.cursor() as cur:
        cur.execute("SHOW server_version")
        version = cur.fetchone()[0]
    print(f"\nPostgreSQL {version}, {os.cpu_count()} CPU(s); scratch database {DB_NAME}")
    print("\n(a) ingest, events/s (endpoint = Django test client through the whole stack; raw = COPY to a temp")
    print("    stage + INSERT .. SELECT .. ON CONFLICT DO NOTHING into telemetry_usageevent; alternating batches)")
    print(f"{'batch':>7} {'batches':>8} {'endpoint ev/s':>14} {'raw ev/s':>10} {'ratio':>6} "
          f"{'endpoint ms/batch':>18} {'raw ms/batch':>13}")
    for size, n, api, raw, ms_api, ms_raw in ingest_rows:
        print(f"{size:>7} {n:>8} {api:>14,.0f} {raw:>10,.0f} {api / raw:>6.2f} {ms_api:>18.1f} {ms_raw:>13.1f}")
    print(f"replay of a 1,000-event batch (all duplicates), endpoint: {replay:,.0f} events/s")
    print(f"ingest_batch() alone (no HTTP/JSON), 10,000-event batches: {svc:,.0f} events/s")
    print(f"\n(b) tenant-month summary; generated in {gen_s:.1f} s: {hour_rows:,} UsageHourly rows for June 2025 "
          f"({args.tenants} tenants x 3 deployments x 720 h) representing {hour_events:,} events; "
          f"telemetry_usageevent holds {raw_total:,} raw rows in all")
    print(f"{'tenant':>8} {'raw events':>11} {'summary p50':>12} {'p95 ms':>7} {'raw GROUP BY p50':>17} {'p95 ms':>7} "
          f"{'by day p95':>11}")
    for label, n_raw, t_sum, t_raw, day in summary:
        print(f"{label:>8} {n_raw:>11,} {statistics.median(t_sum):>12.2f} {pct(t_sum, 95):>7.2f} "
              f"{statistics.median(t_raw):>17.2f} {pct(t_raw, 95):>7.2f} {pct(day, 95):>11.2f}")
    ratio_ok = all(api / raw >= 0.5 for _, _, api, raw, _, _ in ingest_rows)
    p95_ok = all(pct(t_sum, 95) < 50 for _, _, t_sum, _, _ in summary)
    print(f"\ntargets: ingest >= 0.5 x raw: {'met' if ratio_ok else 'NOT met'}; summary p95 < 50 ms: "
          f"{'met' if p95_ok else 'NOT met'}   (total {time.perf_counter() - t_start:.0f} s)")
    if not args.keep:
        drop(base)


if __name__ == "__main__":
    main()
