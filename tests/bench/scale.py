"""Benchmark: every chart and billing read at MSP scale, each next to hand-written SQL for the same answer
measured in the same run.

    DATABASE_URL=postgres://... .venv/bin/python tests/bench/scale.py [--nodes 125] [--tenants 200]
        [--events 2600000] [--requests 5] [--reuse] [--db NAME] [--reads WORD,WORD]

PostgreSQL only (the seeding uses generate_series). Seeds, in a scratch database next to DATABASE_URL's:
the console bench's fleet (tests/bench/pages.py: 125 nodes, 1,000 H100/H200 GPUs, 200 tenants, ~2,200
active allocations, their deployments and invoices), then `--events` usage events spread over the last
30 days and their hourly rollups (grouped by the database, as ingest keeps them; the default 2.6M puts an event
in nearly every hour of every deployment: ~666k rollups, each deployment busy all month), 24 h of per-minute GPU
samples (1,000 GPUs: 1.44M rows) with their 5-minute rollups and 30 days of hourly ones, and each
slice's samples at the same resolutions (the energy apportioning joins them).

Then, as an operator through Django's test client: every chart over 24 h and 30 days
(/api/v1/charts/<name>/), the spend list, the invoice list (page_size=500), an invoice, the usage
summary, and the month-end beat (fan-out) plus one tenant's rating task. Prints per read p50/p95,
queries and response bytes, the ratio to the hand-written SQL's p50, and the ratio over the framework floor
(the p50 of the authenticated API root, taken off the read's p50). Goals: p95 < 300 ms at 24 h,
< 1 s at 30 days, within 2x of the SQL, no response over 2 MB, the query count independent of size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.pages import build, pct  # noqa: E402
from tests.bench.scratch import setup_django  # noqa: E402

GOAL_24H_MS, GOAL_30D_MS, MAX_BYTES = 300.0, 1000.0, 2_000_000


def seed_usage(n_events: int) -> None:
    """Usage events over the last 30 days on every deployment, and their hourly rollups (added to the
    rollups the pages fleet already has for its last 8 days)."""
    from django.db import connection

    with connection.cursor() as c:
        c.execute("""
            WITH d AS (SELECT id, tenant_id, row_number() OVER (ORDER BY id) - 1 AS k, count(*) OVER () AS n
                       FROM marketplace_modeldeployment)
            INSERT INTO telemetry_usageevent (tenant_id, deployment_id, event_id, ts, input_tokens, output_tokens,
                                              requests, received_at, latency_ms, adapter)
            SELECT d.tenant_id, d.id, 'scale-' || g, now() - (g %% 2592000) * interval '1 second',
                   200 + g %% 800, 50 + g %% 300, 1, now(), 20 + g %% 200, ''
            FROM generate_series(1, %s) g JOIN d ON d.k = g %% d.n""", [n_events])
        c.execute("""
            INSERT INTO telemetry_usagehourly (tenant_id, deployment_id, hour, adapter, input_tokens, output_tokens,
                                               requests, events, billed_input_tokens, billed_output_tokens,
                                               billed_requests, updated_at)
            SELECT tenant_id, deployment_id, date_trunc('hour', ts), '', sum(input_tokens), sum(output_tokens),
                   sum(requests), count(*), 0, 0, 0, now()
            FROM telemetry_usageevent WHERE event_id LIKE 'scale-%%' GROUP BY 1, 2, 3
            ON CONFLICT (tenant_id, deployment_id, adapter, hour) DO UPDATE SET
                input_tokens = telemetry_usagehourly.input_tokens + excluded.input_tokens,
                output_tokens = telemetry_usagehourly.output_tokens + excluded.output_tokens,
                requests = telemetry_usagehourly.requests + excluded.requests,
                events = telemetry_usagehourly.events + excluded.events""")


def seed_samples() -> None:
    """24 h of per-minute samples per GPU and per slice, 5-minute rollups of them, 30 days of hourly ones."""
    from django.db import connection

    gpu = """
        INSERT INTO telemetry_gpusample (gpu_id, resolution, ts, samples, utilization, utilization_samples,
                                         activity, memory_used_mb, memory_total_mb, power_w, energy_j,
                                         temperature_c, sm_clock_mhz, mig)
        SELECT g.id, %s, t, %s, NULL, 0, (0.2 + 0.6 * ((g.id * 7 + extract(epoch FROM t)::bigint / 60) %% 97) / 97.0),
               20000, 80000, 350 + (g.id %% 200), 1e9 + extract(epoch FROM t - (now() - interval '31 days')) * 500,
               55, 1800, true
        FROM marketplace_gpu g,
             generate_series(date_trunc('minute', now()) - %s::interval, date_trunc('minute', now()), %s::interval) t"""
    mig = """
        INSERT INTO telemetry_migsample (gpu_id, mig_uuid, gi_id, compute_slices, allocation_id, tenant_id,
                                         resolution, ts, samples, memory_used_mb, memory_total_mb, activity)
        SELECT a.gpu_id, a.mig_uuid, a.start, a.cs, a.id, a.tenant_id, %s, t, %s, 9000, 20000, 0.5
        FROM (SELECT al.id, al.tenant_id, i.gpu_id, i.mig_uuid, i.start, p.compute_slices AS cs
              FROM marketplace_allocation al JOIN marketplace_gpuinstance i ON i.id = al.instance_id
              JOIN marketplace_migplacement pl ON pl.id = i.placement_id
              JOIN marketplace_migprofile p ON p.id = pl.profile_id) a,
             generate_series(date_trunc('minute', now()) - %s::interval, date_trunc('minute', now()), %s::interval) t"""
    with connection.cursor() as c:
        for res, n, span, step in (("raw", 1, "24 hours", "1 minute"), ("5m", 5, "24 hours", "5 minutes"),
                                   ("1h", 60, "30 days", "1 hour")):
            c.execute(gpu, [res, n, span, step])
            c.execute(mig, [res, n, span, step])
        c.execute("ANALYZE")


#: The rating rule's linear part in one statement (the hand-written SQL the money charts are compared with): each
#: hourly rollup priced at the plan in force at its hour (a plan span is [effective_from, next effective_from) per
#: tier, plan kind and currency) in the currency its tenant is billed in for that month (the month's invoice's,
#: else the tenant's), an hour at the range's edges in proportion to its time inside; and every allocation's
#: active time (activated until released, a failed one until its last change, else now) clipped to the range,
#: split per month (currency) and plan span, times the span's price per slice-hour. Not expressed: reserved
#: commitment top-ups (owed = commit x held time / month, less the month's own charges at the plan rounded per
#: invoice line: a month-wide computation over the union of held spans that no range of a chart contains); the
#: bench fleet has no reserved orders, so they are 0 in both and the check below holds.
MONEY_CTES = """
    WITH plans AS MATERIALIZED (
        SELECT p.*, lead(p.effective_from) OVER (PARTITION BY p.tier_id, p.kind, p.currency
                                                ORDER BY p.effective_from) AS effective_to
        FROM marketplace_priceplan p),
    months AS MATERIALIZED (  -- (an integer series of constant length: the planner knows how many rows)
        SELECT m AT TIME ZONE 'UTC' AS ms, (m + interval '1 month') AT TIME ZONE 'UTC' AS me
        FROM generate_series(0, %(months)s) k,
             LATERAL (SELECT date_trunc('month', %(start)s AT TIME ZONE 'UTC') + k * interval '1 month' AS m) x),
    billed AS MATERIALIZED (
        SELECT t.id AS tenant_id, mo.ms, mo.me, coalesce(i.currency, t.currency) AS currency
        FROM tenants_tenant t CROSS JOIN months mo
        LEFT JOIN marketplace_invoice i ON i.tenant_id = t.id AND i.period_start = (mo.ms AT TIME ZONE 'UTC')::date),
    dep AS MATERIALIZED (
        SELECT d.id, a.tier_id, o.plan_kind FROM marketplace_modeldeployment d
        JOIN marketplace_allocation a ON a.id = d.allocation_id JOIN marketplace_order o ON o.id = a.order_id),
    tok AS (
        SELECT u.tenant_id, dep.tier_id, u.hour, u.input_tokens + u.output_tokens AS tokens, u.requests,
               b.currency, u.hour >= %(start)s AS inside,
               date_trunc(%(bucket)s, greatest(u.hour, %(start)s) AT TIME ZONE 'UTC') AS b,
               (u.input_tokens * p.price_per_1m_input_tokens + u.output_tokens * p.price_per_1m_output_tokens)
               / 1000000 * extract(epoch FROM least(u.hour + interval '1 hour', %(end)s)
                                              - greatest(u.hour, %(start)s)) / 3600 AS amount
        FROM telemetry_usagehourly u JOIN dep ON dep.id = u.deployment_id
        JOIN billed b ON b.tenant_id = u.tenant_id AND u.hour >= b.ms AND u.hour < b.me
        LEFT JOIN plans p ON p.tier_id = dep.tier_id AND p.kind = dep.plan_kind AND p.currency = b.currency
             AND u.hour >= p.effective_from AND (p.effective_to IS NULL OR u.hour < p.effective_to)
        WHERE u.hour > %(start)s - interval '1 hour' AND u.hour < %(end)s),
    held AS (
        SELECT a.tenant_id, a.tier_id, o.plan_kind, greatest(a.activated_at, %(start)s) AS lo,
               least(coalesce(a.released_at, CASE WHEN a.state = 'failed' THEN a.updated_at END, %(end)s),
                     %(end)s) AS hi
        FROM marketplace_allocation a JOIN marketplace_order o ON o.id = a.order_id
        WHERE a.activated_at IS NOT NULL AND a.activated_at < %(end)s),
    slices AS (
        SELECT h.tenant_id, h.tier_id, b.currency, p.price_per_slice_hour AS price,
               greatest(h.lo, b.ms, p.effective_from) AS lo,
               least(h.hi, b.me, coalesce(p.effective_to, 'infinity')) AS hi
        FROM held h JOIN billed b ON b.tenant_id = h.tenant_id AND h.lo < b.me AND h.hi > b.ms
        JOIN plans p ON p.tier_id = h.tier_id AND p.kind = h.plan_kind AND p.currency = b.currency
             AND p.effective_from < least(h.hi, b.me)
             AND (p.effective_to IS NULL OR p.effective_to > greatest(h.lo, b.ms))
        WHERE h.lo < h.hi)"""

PER_TIER = """,
    per_tier AS (
        SELECT tier_id, sum(requests) FILTER (WHERE inside) AS requests,
               sum(tokens) FILTER (WHERE inside) AS tokens, coalesce(sum(amount), 0) AS amount
        FROM tok WHERE currency = 'USD' GROUP BY 1
        UNION ALL
        SELECT tier_id, 0, 0, sum(extract(epoch FROM hi - lo) / 3600 * price) FROM slices
        WHERE currency = 'USD' GROUP BY 1)"""

HAND_MONEY = {
    # per tier, in USD: requests and tokens of the period's hours, token and slice-hour money
    "cost-per-tier": MONEY_CTES + PER_TIER + """
    SELECT tier_id, sum(requests), sum(tokens), sum(amount) FROM per_tier GROUP BY 1""",
    # per tenant and bucket: tokens of the bucket's hours, and money in the tenant's currency
    "tenant-usage": MONEY_CTES + """,
    buckets AS (
        SELECT b AT TIME ZONE 'UTC' AS bs, (b + %(bstep)s::interval) AT TIME ZONE 'UTC' AS be
        FROM generate_series(0, %(buckets)s) k,
             LATERAL (SELECT date_trunc(%(bucket)s, %(start)s AT TIME ZONE 'UTC') + k * %(bstep)s::interval AS b) x),
    parts AS (
        SELECT tenant_id, b, sum(tokens) FILTER (WHERE inside) AS tokens, coalesce(sum(amount), 0) AS amount
        FROM tok GROUP BY 1, 2
        UNION ALL
        SELECT s.tenant_id, bu.bs AT TIME ZONE 'UTC', 0,
               sum(extract(epoch FROM least(s.hi, bu.be) - greatest(s.lo, bu.bs)) / 3600 * s.price)
        FROM (SELECT tenant_id, lo, hi, sum(price) AS price FROM slices GROUP BY 1, 2, 3) s  -- same span: one row
        JOIN buckets bu ON s.lo < bu.be AND s.hi > bu.bs GROUP BY 1, 2)
    SELECT tenant_id, b, sum(tokens), sum(amount) FROM parts GROUP BY 1, 2""",
    # per GPU model: GPUs, tokens and USD money of its tiers, and its average activity (hourly rollups, and the
    # raw minutes after the last one, a rollup weighing as many samples as it averages)
    "h100-vs-h200": MONEY_CTES + PER_TIER + """,
    money AS (
        SELECT ti.gpu_model_id AS model_id, sum(pt.tokens) AS tokens, sum(pt.amount) AS amount
        FROM per_tier pt JOIN marketplace_tier ti ON ti.id = pt.tier_id GROUP BY 1),
    tail AS (
        SELECT coalesce(max(ts) + interval '1 hour', %(start)s) AS t FROM telemetry_gpusample
        WHERE resolution = '1h' AND ts >= %(start)s AND ts < %(end)s),
    util AS (
        SELECT g.gpu_model_id AS model_id, sum(s.activity * s.samples) / sum(s.samples) AS u
        FROM telemetry_gpusample s JOIN marketplace_gpu g ON g.id = s.gpu_id, tail
        WHERE s.ts >= %(start)s AND s.ts < %(end)s
          AND ((s.resolution = '1h' AND s.ts < tail.t) OR (s.resolution = 'raw' AND s.ts >= tail.t))
        GROUP BY 1),
    gpus AS (SELECT gpu_model_id AS model_id, count(*) AS n FROM marketplace_gpu GROUP BY 1)
    SELECT m.key, gpus.n, money.tokens, money.amount, util.u FROM marketplace_gpumodel m
    LEFT JOIN gpus ON gpus.model_id = m.id LEFT JOIN money ON money.model_id = m.id
    LEFT JOIN util ON util.model_id = m.id
    WHERE gpus.n IS NOT NULL OR money.tokens IS NOT NULL""",
}


HAND_SQL = {
    "fleet-utilization": """
        SELECT (floor(extract(epoch FROM s.ts) / %(step)s) * %(step)s)::bigint b, m.key,
               sum(s.activity * s.samples) / sum(s.samples)
        FROM telemetry_gpusample s JOIN marketplace_gpu g ON g.id = s.gpu_id
        JOIN marketplace_gpumodel m ON m.id = g.gpu_model_id
        WHERE s.resolution = %(res)s AND s.ts >= %(start)s AND s.ts < %(end)s GROUP BY 1, 2""",
    "gpu-heatmap": """
        SELECT (floor(extract(epoch FROM s.ts) / %(hstep)s) * %(hstep)s)::bigint b, g.node_id,
               sum(s.activity * s.samples) / sum(s.samples)
        FROM telemetry_gpusample s JOIN marketplace_gpu g ON g.id = s.gpu_id
        WHERE s.resolution = %(res)s AND s.ts >= %(start)s AND s.ts < %(end)s GROUP BY 1, 2""",
    # every GPU's row (label, model, MIG mode) and who holds each slot with which profile, as the chart shows
    "mig-slots": """
        SELECT n.hostname, g.index, m.key, g.mig_mode, s.slot, t.slug, p.name
        FROM marketplace_gpu g JOIN marketplace_node n ON n.id = g.node_id
        JOIN marketplace_gpumodel m ON m.id = g.gpu_model_id
        LEFT JOIN marketplace_gpuslot s ON s.gpu_id = g.id
        LEFT JOIN marketplace_gpuinstance i ON i.id = s.instance_id LEFT JOIN tenants_tenant t ON t.id = i.tenant_id
        LEFT JOIN marketplace_migplacement pl ON pl.id = i.placement_id
        LEFT JOIN marketplace_migprofile p ON p.id = pl.profile_id
        ORDER BY n.hostname, g.index, s.slot""",
    # the chart's answer: kWh and tokens per tier, kWh and unallocated kWh per GPU. The whole days and hours the
    # energy rollups hold are summed from them (as the chart does; the rollup job keeps them), only the partial hour
    # at the start and the hours since the last rolled-up one are apportioned from the 5-minute samples (counter
    # increases from the last row at or before each span's start, split by the slices' compute share)
    "power-cost": """
        WITH h AS (SELECT date_trunc('hour', %(start)s::timestamptz) + interval '1 hour' AS lo,
                          (SELECT max(hour) + interval '1 hour' FROM telemetry_energyhourly
                           WHERE gpu_id IS NULL AND allocation_id IS NULL AND tenant_id IS NULL
                             AND hour < %(end)s) AS hi),
        d AS (SELECT lo, hi, CASE WHEN date_trunc('day', lo) = lo THEN lo
                                  ELSE date_trunc('day', lo) + interval '1 day' END AS dl FROM h),
        r AS (SELECT lo, hi, dl, greatest(date_trunc('day', hi), dl) AS dh FROM d),
        rolled AS (  -- the bounds as scalar subqueries, so that the rollups' time indexes are used
            SELECT gpu_id, allocation_id, kwh, unallocated_kwh FROM telemetry_energyhourly
            WHERE hour >= (SELECT lo FROM r) AND hour < (SELECT least(dl, hi) FROM r)
            UNION ALL
            SELECT gpu_id, allocation_id, kwh, unallocated_kwh FROM telemetry_energyhourly
            WHERE hour >= (SELECT dh FROM r) AND hour < (SELECT hi FROM r)
            UNION ALL
            SELECT gpu_id, allocation_id, kwh, unallocated_kwh FROM telemetry_energydaily
            WHERE day >= (SELECT dl FROM r) AND day < (SELECT dh FROM r)),
        e AS (SELECT %(start)s::timestamptz - interval '10 minutes' AS a0, lo - interval '5 minutes' AS b0,
                     hi - interval '10 minutes' AS a1, %(end)s::timestamptz - interval '5 minutes' AS b1 FROM r),
        rows AS (  -- each span's rows from the last one at or before its start (5-minute rows stand at their end)
            SELECT 0 AS sp, gpu_id, ts, energy_j FROM telemetry_gpusample
            WHERE resolution = '5m' AND ts > (SELECT a0 FROM e) AND ts <= (SELECT b0 FROM e)
            UNION ALL
            SELECT 1, gpu_id, ts, energy_j FROM telemetry_gpusample
            WHERE resolution = '5m' AND ts > (SELECT a1 FROM e) AND ts <= (SELECT b1 FROM e)),
        inc AS (
            SELECT gpu_id, ts, CASE WHEN energy_j >= prev THEN energy_j - prev ELSE energy_j END AS j FROM (
                SELECT gpu_id, ts, energy_j, lag(energy_j) OVER (PARTITION BY sp, gpu_id ORDER BY ts) AS prev
                FROM rows) x
            WHERE prev IS NOT NULL),
        slices AS (
            SELECT gpu_id, ts, allocation_id, compute_slices FROM telemetry_migsample
            WHERE resolution = '5m' AND (allocation_id IS NOT NULL OR tenant_id IS NOT NULL)
              AND ((ts > (SELECT a0 FROM e) AND ts <= (SELECT b0 FROM e))
                   OR (ts > (SELECT a1 FROM e) AND ts <= (SELECT b1 FROM e)))),
        held AS (
            SELECT inc.gpu_id, inc.ts, inc.j, m.allocation_id, m.compute_slices / 7.0 AS share
            FROM inc JOIN slices m ON m.gpu_id = inc.gpu_id AND m.ts = inc.ts),
        alloc AS (
            SELECT allocation_id, sum(j * share) / 3.6e6 AS kwh FROM held WHERE allocation_id IS NOT NULL GROUP BY 1
            UNION ALL
            SELECT allocation_id, sum(kwh) FROM rolled WHERE allocation_id IS NOT NULL GROUP BY 1),
        tiers AS (SELECT a.tier_id, sum(alloc.kwh) AS kwh FROM alloc
                  JOIN marketplace_allocation a ON a.id = alloc.allocation_id GROUP BY 1),
        tokens AS (SELECT a.tier_id, sum(u.input_tokens + u.output_tokens) AS t FROM telemetry_usagehourly u
                   JOIN marketplace_modeldeployment d ON d.id = u.deployment_id
                   JOIN marketplace_allocation a ON a.id = d.allocation_id
                   WHERE u.hour >= %(start)s AND u.hour < %(end)s GROUP BY 1),
        gpus AS (
            SELECT inc.gpu_id, sum(inc.j) / 3.6e6 AS kwh, sum(inc.j * greatest(0, 1 - coalesce(h.s, 0))) / 3.6e6 AS u
            FROM inc LEFT JOIN (SELECT gpu_id, ts, sum(share) AS s FROM held GROUP BY 1, 2) h
              ON h.gpu_id = inc.gpu_id AND h.ts = inc.ts GROUP BY 1
            UNION ALL
            SELECT gpu_id, sum(kwh), sum(unallocated_kwh) FROM rolled WHERE gpu_id IS NOT NULL GROUP BY 1)
        SELECT 'tier', tier_id, tiers.kwh, tokens.t FROM tiers FULL JOIN tokens USING (tier_id)
        UNION ALL SELECT 'gpu', gpu_id, sum(kwh), sum(u) FROM gpus GROUP BY 2""",
    # the list answers' rows and their count (a page says how many there are)
    "spend": """
        SELECT t.slug, coalesce(i.total, 0) AS spend, t.monthly_spend_limit, coalesce(i.currency, t.currency),
               i.status, i.rated_at,
               coalesce(i.total, 0) >= t.monthly_spend_limit * t.spend_warn_ratio AS warn,
               coalesce(i.total, 0) >= t.monthly_spend_limit * t.spend_block_ratio AS blocked,
               count(*) OVER () FROM tenants_tenant t
        LEFT JOIN marketplace_invoice i ON i.tenant_id = t.id AND i.period_start = %(month)s
        ORDER BY t.slug LIMIT 50""",
    "invoices": """
        SELECT i.*, t.slug, count(*) OVER () FROM marketplace_invoice i JOIN tenants_tenant t ON t.id = i.tenant_id
        ORDER BY i.period_start DESC, t.slug LIMIT 500""",
    "invoice": """
        SELECT i.*, t.slug, l.* FROM marketplace_invoice i JOIN tenants_tenant t ON t.id = i.tenant_id
        LEFT JOIN marketplace_invoiceline l ON l.invoice_id = i.id WHERE i.id = %(invoice)s ORDER BY l.id""",
    # the answer's rows: each deployment's sums (used and billed) with its tenant's slug, its name and tier, in order
    "usage-summary": """
        WITH u AS (
            SELECT tenant_id, deployment_id, sum(input_tokens) AS i, sum(output_tokens) AS o, sum(requests) AS r,
                   sum(events) AS e, sum(billed_input_tokens) AS bi, sum(billed_output_tokens) AS bo,
                   sum(billed_requests) AS br
            FROM telemetry_usagehourly WHERE hour >= %(month_start)s AND hour < %(end)s GROUP BY 1, 2)
        SELECT t.slug, d.name, d.allocation_id, ti.key, u.* FROM u JOIN tenants_tenant t ON t.id = u.tenant_id
        JOIN marketplace_modeldeployment d ON d.id = u.deployment_id
        LEFT JOIN marketplace_allocation a ON a.id = d.allocation_id LEFT JOIN marketplace_tier ti ON ti.id = a.tier_id
        ORDER BY u.tenant_id, u.deployment_id""",
    **HAND_MONEY,
}


def time_sql(sql: str, params: dict, n: int) -> float:
    from django.db import connection

    out = []
    with connection.cursor() as c:
        for _ in range(n + 1):
            t0 = time.perf_counter()
            c.execute(sql, params)
            c.fetchall()
            out.append((time.perf_counter() - t0) * 1000)
    return pct(out[1:], 50)


def same_answer(client, name: str, params: dict) -> list[str]:
    """The money chart `name` over exactly the hand SQL's range (start, end) against the hand SQL's own rows:
    what differs (to the cent; unit prices and utilization to their last printed digit). Empty: the comparison
    is of the same answer."""
    from decimal import ROUND_HALF_UP, Decimal
    from urllib.parse import urlencode

    from django.db import connection

    from marketplace.models import Tier
    from tenants.models import Tenant

    resp = client.get(f"/api/v1/charts/{name}/?" + urlencode({"start": params["start"].isoformat(),
                                                                "end": params["end"].isoformat()}))
    data = resp.json()["data"]
    with connection.cursor() as c:
        c.execute(HAND_SQL[name], params)
        rows = c.fetchall()

    def dec(x, places: str = "0.01") -> Decimal:
        return Decimal(str(x or 0)).quantize(Decimal(places), rounding=ROUND_HALF_UP)

    bad: list[str] = []
    if name == "cost-per-tier":
        key = dict(Tier.objects.values_list("pk", "key"))
        want = {key[t]: (int(rq or 0), int(tk or 0), dec(amount)) for t, rq, tk, amount in rows}
        got = {k: (int(v["requests"]), int(v["tokens"]), dec(v["amount"])) for k, v in data["tiers"].items()}
        bad += [f"{k}: endpoint {got.get(k)} hand SQL {want.get(k)} (requests, tokens, amount)"
                for k in sorted(set(got) | set(want)) if got.get(k, (0, 0, dec(0))) != want.get(k, (0, 0, dec(0)))]
    elif name == "tenant-usage":
        slug = dict(Tenant.objects.values_list("pk", "slug"))
        want_b: dict = {}
        for tid, b, tokens, amount in rows:
            want_b.setdefault(slug[tid], {})[b.replace(tzinfo=UTC).isoformat()] = (int(tokens or 0), Decimal(amount))
        for s in sorted(set(data["tenants"]) | set(want_b)):
            g = data["tenants"].get(s, {"ts": [], "tokens": [], "spend": [], "total": "0"})
            w = want_b.get(s, {})
            total = dec(sum(a for _t, a in w.values()))
            if dec(g["total"]) != total:
                bad.append(f"{s}: total endpoint {g['total']} hand SQL {total}")
            got_b = {t: (n, dec(x)) for t, n, x in zip(g["ts"], g["tokens"], g["spend"], strict=True) if n or dec(x)}
            want_b2 = {t: (n, dec(a)) for t, (n, a) in w.items() if n or dec(a)}
            if got_b != want_b2:
                diff = sorted(t for t in set(got_b) | set(want_b2) if got_b.get(t) != want_b2.get(t))
                bad.append(f"{s}: {len(diff)} buckets differ, first {diff[0]}: endpoint {got_b.get(diff[0])} "
                           f"hand SQL {want_b2.get(diff[0])}")
    elif name == "h100-vs-h200":
        for model, gpus, tokens, amount, util in rows:
            g = data["models"].get(model, {})
            per_1m = dec(Decimal(amount) * 1_000_000 / tokens, "0.0001") if tokens else None
            pct = dec(100 * Decimal(util), "0.0001") if util is not None else None
            ok = (g.get("gpus") == (gpus or 0) and int(g.get("tokens") or 0) == int(tokens or 0)
                  and (per_1m is None) == (g.get("cost_per_1m_tokens") is None)
                  and (per_1m is None or abs(dec(g["cost_per_1m_tokens"], "0.0001") - per_1m) <= Decimal("0.0001"))
                  and (pct is None or abs(dec(g["utilization"], "0.0001") - pct) <= Decimal("0.0001")))
            if not ok:
                bad.append(f"{model}: endpoint {g} hand SQL gpus {gpus} tokens {tokens} per 1M {per_1m} util {pct}")
        if len(data["models"]) != len(rows):
            bad.append(f"models: endpoint {sorted(data['models'])} hand SQL {sorted(r[0] for r in rows)}")
    return bad


def time_get(client, url: str, n: int) -> tuple[list[float], int, int, int]:
    from django.db import connection

    resp = client.get(url)  # warm-up
    seen = []

    def count(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        resp = client.get(url)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.get(url)
        out.append((time.perf_counter() - t0) * 1000)
    return out, resp.status_code, len(seen), len(resp.content)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--tenants", type=int, default=200)
    ap.add_argument("--events", type=int, default=2_600_000)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--reuse", action="store_true",
                    help="measure the scratch database a previous run seeded (skips the ~8 min of seeding)")
    ap.add_argument("--db", default="tessera_bench_scale",
                    help="scratch database name (e.g. a copy: CREATE DATABASE x TEMPLATE tessera_bench_scale)")
    ap.add_argument("--reads", default="",
                    help="comma-separated words: time only the reads whose label holds one (e.g. tenant-usage,spend); "
                         "the month-end beat only if one of them is 'beat'; with --reuse, the energy rollups are "
                         "rebuilt only if one is 'energy' (else only the hours since the last run are rolled)")
    args = ap.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        sys.exit("scale.py needs PostgreSQL: set DATABASE_URL=postgres://...")
    t0 = time.perf_counter()
    if args.reuse:
        import tempfile

        base = os.environ["DATABASE_URL"].rpartition("/")[0]
        os.environ["DATABASE_URL"] = f"{base}/{args.db}"
        scratch = Path(tempfile.mkdtemp(prefix="tessera-bench-scale-"))
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
        os.environ.setdefault("LOG_LEVEL", "WARNING")  # as setup_django: the table, not a log line per request
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)  # the scratch set may predate a migration
    else:
        scratch = setup_django(args.db, "tessera-bench-scale-")
    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.utils import timezone

    from marketplace.models import Allocation, Invoice, PricePlan
    from marketplace.services import billing
    from telemetry.models import GpuSample, MigSample, UsageEvent, UsageHourly
    from tenants.models import Tenant
    from tests.billing_reference import rate_all

    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    now = timezone.now()
    if args.reuse:
        from django.contrib.auth import get_user_model

        from marketplace.models import Gpu

        data = {"op": get_user_model().objects.get(email="bench-op@msp.example"), "counts": {
            "gpus": Gpu.objects.count(), "tenants": Tenant.objects.count(), "allocations": Allocation.objects.count()}}
    else:
        data = build(args.nodes, args.tenants)
        # the allocations were active for the whole month (pages.py activates them now)
        Allocation.objects.update(activated_at=now - timedelta(days=31))
        PricePlan.objects.update(effective_from=now - timedelta(days=400))
        seed_usage(args.events)
        seed_samples()
    Invoice.objects.filter(status="draft").delete()  # the beat opens and rates this month's drafts
    from telemetry.models import EnergyDaily, EnergyHourly
    from telemetry.services import energy

    t1 = time.perf_counter()
    keep = args.reuse and args.reads and "energy" not in args.reads and EnergyHourly.objects.exists()
    if not keep:  # (--reuse --reads without 'energy': the reused set's rollups as they are, up to its last run)
        EnergyHourly.objects.all().delete()
        EnergyDaily.objects.all().delete()
    hours = energy.rollup_hours(max_hours=24 * 31)  # what the downsampling job keeps up to date each hour
    days = energy.rollup_days()  # and each complete day
    energy_s = time.perf_counter() - t1
    built_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    rate_all()  # in-process: every tenant rated, as the beat's tasks would
    rate_all_s = time.perf_counter() - t1
    gc.collect()
    gc.freeze()
    counts = {"GPUs": data["counts"]["gpus"], "tenants": data["counts"]["tenants"],
              "allocations": data["counts"]["allocations"], "usage events": UsageEvent.objects.count(),
              "hourly rollups": UsageHourly.objects.count(), "GPU samples": GpuSample.objects.count(),
              "slice samples": MigSample.objects.count()}
    print(f"database {connection.vendor}; seeded in {built_s:.0f} s: " + ", ".join(f"{v:,} {k}"
                                                                                 for k, v in counts.items()))
    print(f"energy rollup: {hours} hours apportioned and {days} days summed in {energy_s:.0f} s "
          f"({energy_s / max(hours, 1) * 1000:.0f} ms per hour, the downsampling job's work each hour)")
    client = Client()
    client.force_login(data["op"])
    month = billing.month_of(now)
    invoice = Invoice.objects.filter(period_start=month).order_by("-total").first()
    reads = []
    for hours, label in ((24, "24 h"), (720, "30 d")):
        start, end = now - timedelta(hours=hours), now
        res = "5m" if hours <= 72 else "1h"
        step = 300 if hours <= 24 else 7200
        hstep = 900 if hours <= 24 else 21600
        for name in ("fleet-utilization", "gpu-heatmap", "mig-slots", "power-cost", "cost-per-tier",
                     "h100-vs-h200", "tenant-usage"):
            reads.append((f"chart {name} {label}", f"/api/v1/charts/{name}/?hours={hours}", name,
                          {"start": start, "end": end, "res": res, "step": step, "hstep": hstep,
                           "bucket": "hour" if hours <= 48 else "day",
                           "bstep": "1 hour" if hours <= 48 else "1 day",
                           "buckets": hours if hours <= 48 else hours // 24,
                           "months": (end.year - start.year) * 12 + end.month - start.month}, hours <= 24))
    month_start = datetime(month.year, month.month, 1, tzinfo=UTC)
    common = {"month": month, "invoice": invoice.pk, "month_start": month_start, "end": now}
    reads += [("spend list", "/api/v1/billing/spend/", "spend", common, True),
              ("invoices page_size=500", "/api/v1/invoices/?page_size=500", "invoices", common, True),
              ("invoice detail", f"/api/v1/invoices/{invoice.pk}/", "invoice", common, True),
              ("usage summary (month, by deployment)", "/api/v1/billing/usage/", "usage-summary", common, True)]
    if args.reads:
        words = [w.strip() for w in args.reads.split(",") if w.strip()]
        reads = [r for r in reads if any(w in r[0] for w in words)]
    # the fixed cost of any authenticated API answer (session, user, memberships, DRF): a read whose SQL takes
    # well under a millisecond cannot come within 2x of it, so the floor and the ratio over it are printed too
    floor_xs, _status, floor_queries, _size = time_get(client, "/api/v1/", max(args.requests, 20))
    floor = pct(floor_xs, 50)
    print(f"framework floor (authenticated API root /api/v1/): p50 {floor:.1f} ms, {floor_queries} queries")
    print(f"{'read':42} {'status':>6} {'queries':>7} {'bytes':>10} {'p50 ms':>8} {'p95 ms':>8} {'SQL p50':>8} "
          f"{'ratio':>6} {'ratio over floor':>16}")
    misses, over_2x = [], []
    for label, url, sql_name, params, short in reads:
        xs, status, queries, size = time_get(client, url, args.requests)
        sql_ms = time_sql(HAND_SQL[sql_name], params, args.requests)
        p50, p95 = pct(xs, 50), pct(xs, 95)
        goal = GOAL_24H_MS if short else GOAL_30D_MS
        if p95 >= goal or size > MAX_BYTES or status != 200:
            misses.append(label)
        if p50 > 2 * sql_ms:
            over_2x.append(label)
        print(f"{label:42} {status:>6} {queries:>7} {size:>10,} {p50:>8.1f} {p95:>8.1f} {sql_ms:>8.1f} "
              f"{p50 / max(sql_ms, 0.01):>5.1f}x {max(p50 - floor, 0.0) / max(sql_ms, 0.01):>15.1f}x")
        if sql_name in HAND_MONEY:  # the hand SQL must give the endpoint's own numbers, or the ratio means nothing
            bad = same_answer(client, sql_name, params)
            if bad:
                misses.append(f"{label}: hand SQL differs")
                print(f"!!! MISMATCH: {label}: the hand SQL does not give the endpoint's numbers "
                      f"({len(bad)} differences):\n!!!   " + "\n!!!   ".join(bad[:10]))
            else:
                print(f"{'':42} same answer as the hand SQL (to the cent)")
    if args.reads and "beat" not in args.reads:  # only the reads asked for
        print(json.dumps({"goals_missed": misses, "over_2x_the_hand_sql": over_2x}))
        shutil.rmtree(scratch, ignore_errors=True)
        return
    # the month-end beat: fan-out (the beat's own work) and one tenant's task
    from unittest import mock

    sent = []
    with mock.patch("marketplace.enqueue.app.send_task", lambda name, args, queue: sent.append(args)):
        t1 = time.perf_counter()
        run = billing.start_rating_run()
        beat_ms = (time.perf_counter() - t1) * 1000
    per_tenant = []
    for run_id, tenant_id in sent[: min(len(sent), 20)]:
        t1 = time.perf_counter()
        billing.rate_run_tenant(run_id, tenant_id, final_attempt=True)
        per_tenant.append((time.perf_counter() - t1) * 1000)
    print(f"month-end beat: fan-out of {len(sent)} tenant tasks in {beat_ms:.0f} ms (run {run.pk}); one tenant's "
          f"task p50 {pct(per_tenant, 50):.0f} ms, max {max(per_tenant):.0f} ms (time limit 300 s); all tenants "
          f"in one process (rate_all) {rate_all_s:.1f} s")
    print(json.dumps({"goals_missed": misses, "over_2x_the_hand_sql": over_2x}))
    print(f"total {time.perf_counter() - t0:.0f} s")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
