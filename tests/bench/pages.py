"""Benchmark: the operator console's and the tenant portal's pages on a large fleet, against a baseline
measured in the same run, at two sizes so that a query count growing with the fleet or the tenants shows.

    .venv/bin/python tests/bench/pages.py [--sizes 13x20,125x200] [--requests 50] [--pages catalog,metering]
    DATABASE_URL=postgres://USER@HOST:5432/NAME .venv/bin/python tests/bench/pages.py

Each size is NODESxTENANTS; the full size is 125 nodes of 8 GPUs (half H100, half H200; 1,000 GPUs) and 200
tenants. The first size is built, measured, then grown to the next one (more nodes and tenants added to the
same database) and measured again. Built: a few thousand active allocations (GpuInstance, GpuSlot,
Allocation and their events, bulk-created consistently), invoices, drift events, deployments with 8 days of
hourly usage and served rollups, the measured deployment's usage events, invitations, audit events and one
telemetry sample per GPU; then the planner's hourly rollups, as the downsampling job keeps them. Then times
each page with Django's test client, N requests each: the console as an operator, the portal as the owner of
a mid-list tenant, the invitation page anonymously; it prints p50/p95 and the query count per page and size,
next to /healthz and a trivial authenticated page (the console's chart list). --pages keeps only the pages whose
label contains one of the comma-separated substrings (the two baseline rows are always measured). Target: p95
< 150 ms at the full size, and the same query count at every size.

Database: DATABASE_URL if set (PostgreSQL: a scratch database NAME_bench_pages is created next to it and
dropped at the end), else a scratch SQLite file.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.scratch import setup_django  # noqa: E402

SCRATCH: Path | None = None  # set by configure()
TARGET_P95_MS = 150.0


def scratch_db_name() -> str:
    """PostgreSQL: the scratch database is named after DATABASE_URL's (two sessions never share one)."""
    url = os.environ.get("DATABASE_URL", "")
    name = url.rpartition("/")[2].split("?")[0] if url.startswith("postgres") else ""
    return f"{name or 'tessera'}_bench_pages"


def configure() -> None:
    global SCRATCH
    SCRATCH = setup_django(scratch_db_name(), "tessera-bench-pages-")


def drop_scratch_db() -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    import psycopg

    name = connection.settings_dict["NAME"]
    connection.close()
    base = os.environ["DATABASE_URL"].rpartition("/")[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name}")


def build(n_nodes: int, n_tenants: int, first: dict | None = None) -> dict:
    """Adds nodes and tenants (numbered after those ``first`` built) and everything they hold; the tiers, the
    operator and the objects the detail pages show are made once, by the first call."""
    from django.utils import timezone

    from marketplace.models import (
        Allocation,
        AllocationEvent,
        DriftEvent,
        Gpu,
        GpuInstance,
        GpuSlot,
        Invoice,
        MigPlacement,
        ModelDeployment,
        Node,
        Order,
        ServerPlatform,
    )
    from marketplace.services.billing import month_of, next_month
    from marketplace.services.catalog import sync_catalog
    from telemetry.models import GpuSample, TritonServedHourly, UsageEvent, UsageHourly
    from tenants.keys import hash_key
    from tenants.models import AuditEvent, Invitation, Membership, Tenant
    from tenants.roles import Role
    from tests.factories import OperatorFactory, UserFactory
    from tests.fleet_fixtures import make_tier

    n0, t0 = (first["n_nodes"], first["n_tenants"]) if first else (0, 0)
    rng = random.Random(7 + n0)
    now = timezone.now()
    if not first:
        sync_catalog()
    platforms = [ServerPlatform.objects.get(key="hgx-h100-8"), ServerPlatform.objects.get(key="hgx-h200-8")]
    if first:
        tiers = first["tiers"]
    else:
        tiers = {}
        since = now - timedelta(days=60)  # prices in force over all the usage built
        for p in platforms:
            m = p.gpu_model
            one = m.profiles.get(memory_slices=1, compute_slices=1, media_extensions=False)
            three = m.profiles.get(memory_slices=4, compute_slices=3, media_extensions=False)
            short = m.key.split("-")[0]
            tiers[m.pk] = {"1g": (make_tier(f"{short}-1g", m.key, one.name, since=since), one),
                           "3g": (make_tier(f"{short}-3g", m.key, three.name, since=since), three)}
            for currency in ("EUR", "GBP"):  # the price table: one column block per currency
                for tier, _prof in tiers[m.pk].values():
                    plan = tier.plans.get(currency="USD")
                    plan.pk, plan.currency = None, currency
                    plan.save()
    placements = {pl.profile_id: {x.start: x for x in pl.profile.placements.all()}
                  for pl in MigPlacement.objects.select_related("profile")}
    tenants = Tenant.objects.bulk_create([
        Tenant(name=f"Bench tenant {i:03d}", slug=f"bench-{i:03d}", billing_email=f"b{i}@bench.example",
               max_slices=1000, max_slices_per_tier=1000, max_memory_gb=100_000,
               monthly_spend_limit=Decimal(1000) if i % 4 == 0 else None) for i in range(t0, n_tenants)])
    nodes = Node.objects.bulk_create([
        Node(hostname=f"bench-{i:03d}", platform=platforms[i % 2], queue=f"node.bench-{i:03d}", last_heartbeat=now)
        for i in range(n0, n_nodes)])
    gpus = Gpu.objects.bulk_create([
        Gpu(node=n, index=g, uuid=f"GPU-bench-{n.pk:04d}-{g}", gpu_model=n.platform.gpu_model)
        for n in nodes for g in range(8)])
    node_of = {n.pk: n for n in nodes}
    # Each used GPU: one 3g (slices 0-3) and up to three 1g (slices 4, 5, 6); a quarter of GPUs stay empty.
    plan = []  # (gpu, tier, profile, start, size, tenant)
    for gpu in gpus:
        if rng.random() < 0.25:
            continue
        t = tiers[gpu.gpu_model_id]
        plan.append((gpu, *t["3g"], 0, 4, rng.choice(tenants)))
        for start in range(4, 4 + rng.randint(1, 3)):
            plan.append((gpu, *t["1g"], start, 1, rng.choice(tenants)))
    instances = GpuInstance.objects.bulk_create([
        GpuInstance(gpu=gpu, placement=placements[prof.pk][start], tenant=ten, start=start, size=size,
                    state="created", mig_uuid=f"MIG-bench-{gpu.pk}-{start}")
        for gpu, _, prof, start, size, ten in plan])
    GpuSlot.objects.bulk_create([GpuSlot(gpu_id=i.gpu_id, slot=s, instance=i) for i in instances
                                 for s in range(i.start, i.start + i.size)])
    ords = Order.objects.bulk_create([Order(tenant=ten, tier=tier) for _, tier, _, _, _, ten in plan])
    allocs = Allocation.objects.bulk_create([
        Allocation(order=o, tenant=ten, tier=tier, state="active", instance=inst, node=node_of[gpu.node_id],
                   gpu_uuid=gpu.uuid, mig_uuid=inst.mig_uuid, start=start, size=size, activated_at=now)
        for o, inst, (gpu, tier, _, start, size, ten) in zip(ords, instances, plan, strict=True)])
    events = []
    for a in allocs:
        for frm, to in (("", "requested"), ("requested", "placed"), ("placed", "provisioning"),
                        ("provisioning", "ready"), ("ready", "active")):
            events.append(AllocationEvent(allocation=a, from_state=frm, to_state=to, actor="bench"))
    AllocationEvent.objects.bulk_create(events, batch_size=2000)
    month = month_of(now)
    invoices = []
    for ten in tenants:
        p = month
        for k in range(4):
            invoices.append(Invoice(tenant=ten, period_start=p, period_end=next_month(p), currency="USD",
                                    status="draft" if k == 0 else "finalized",
                                    number=None if k == 0 else f"TSR-B-{ten.pk:04d}-{k}",
                                    total=Decimal(rng.randint(0, 1500)), rated_at=now))
            p = month_of(p - timedelta(days=1))
    Invoice.objects.bulk_create(invoices)
    DriftEvent.objects.bulk_create([DriftEvent(node=rng.choice(nodes), gpu_index=rng.randint(0, 7), kind="error",
                                               detail="bench drift", resolved=i % 5 != 0) for i in range(200)])
    # every tenant holds a deployment (its first allocation), plus every third allocation
    seen: set[int] = set()
    with_model = [a for i, a in enumerate(allocs) if i % 3 == 0 or not (a.tenant_id in seen or seen.add(a.tenant_id))]
    deps = ModelDeployment.objects.bulk_create([
        ModelDeployment(allocation=a, tenant_id=a.tenant_id, name=f"model-{a.pk}", backend="python", spec={},
                        memory_mb=4000, state="ready") for a in with_model])
    hour = now.replace(minute=0, second=0, microsecond=0)
    hours = [hour - timedelta(hours=h) for h in range(8 * 24)]
    UsageHourly.objects.bulk_create([
        UsageHourly(tenant_id=d.tenant_id, deployment=d, hour=h, input_tokens=40_000, output_tokens=9_000,
                    requests=30, events=30, billed_input_tokens=40_000, billed_output_tokens=9_000,
                    billed_requests=30) for d in deps for h in hours], batch_size=5000)
    TritonServedHourly.objects.bulk_create([
        TritonServedHourly(tenant_id=d.tenant_id, deployment=d, hour=h, requests=30, failures=int(h.hour % 7 == 0))
        for d in deps for h in hours], batch_size=5000)
    GpuSample.objects.bulk_create([
        GpuSample(gpu=g, ts=now - timedelta(seconds=30), activity=rng.random(), memory_used_mb=1000,
                  memory_total_mb=80_000, power_w=300 + rng.random() * 300, energy_j=1e6, temperature_c=50,
                  sm_clock_mhz=1800, mig=True) for g in gpus])
    invitations = Invitation.objects.bulk_create([
        Invitation(tenant=ten, email=f"inv{k}-{ten.pk}@bench.example", role=Role.MEMBER,
                   token_hash=hash_key(f"bench-invite-{ten.pk}-{k}"), expires_at=now + timedelta(days=7 - 9 * (k == 2)),
                   revoked_at=now if k == 1 else None) for ten in tenants for k in range(3)])
    audit = AuditEvent.objects.bulk_create([
        AuditEvent(at=now - timedelta(minutes=i), actor=f"user:owner@{ten.slug}.example", tenant=ten,
                   action=("slice.order", "key.create", "member.invite", "deployment.create")[i % 4],
                   target=f"bench {i}", detail={"i": i}) for ten in tenants for i in range(20)], batch_size=5000)
    counts = {"nodes": len(nodes), "gpus": len(gpus), "tenants": len(tenants), "allocations": len(allocs),
              "events": len(events), "invoices": len(invoices), "deployments": len(deps),
              "usage hours": 2 * len(deps) * len(hours), "invitations": len(invitations), "audit events": len(audit)}
    if first:
        first["n_nodes"], first["n_tenants"] = n_nodes, n_tenants
        for k, v in counts.items():
            first["counts"][k] += v
        return first
    tenant = tenants[len(tenants) // 2]
    owner = UserFactory(email="bench-owner@bench.example")
    Membership.objects.create(user=owner, tenant=tenant, role=Role.OWNER)
    dep = next(d for d in deps if d.tenant_id == tenant.pk)
    UsageEvent.objects.bulk_create([
        UsageEvent(tenant_id=tenant.pk, deployment=dep, event_id=f"bench-{i}", ts=now - timedelta(minutes=3 * i),
                   input_tokens=1300, output_tokens=300, latency_ms=80 + i % 50) for i in range(480)])
    op = OperatorFactory(email="bench-op@msp.example")
    return {"op": op, "owner": owner, "alloc": allocs[len(allocs) // 2], "tenant": tenant, "deployment": dep,
            "invite_token": f"bench-invite-{tenant.pk}-0",  # pending
            "tiers": tiers, "tier": next(iter(tiers.values()))["1g"][0], "invoice": invoices[1],
            "n_nodes": n_nodes, "n_tenants": n_tenants, "counts": counts}


def roll_planner() -> int:
    """What the downsampling job keeps up to date: the planner's hourly rollups. The first size's hours are
    rolled; a larger size adds usage to those hours, which (as late usage) rolls them again."""
    from marketplace.services import planner_rollup

    return planner_rollup.roll(max_hours=24 * 31)["hours"]


def timed(client, url: str, n: int) -> tuple[list[float], int, int]:
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    resp = client.get(url)  # warm-up, and the status code
    with CaptureQueriesContext(connection) as ctx:
        client.get(url)
    queries = len(ctx.captured_queries)
    reset_queries()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.get(url)
        out.append((time.perf_counter() - t0) * 1000)
    return out, resp.status_code, queries


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def pages(data: dict) -> list[tuple[str, str, str]]:
    """(label, who, url): who is "op" (the operator), "owner" (the portal tenant's owner) or "anon"."""
    from urllib.parse import urlencode

    plan = urlencode({
        "plan": "1", "w-TOTAL_FORMS": "2", "w-INITIAL_FORMS": "0", "w-MIN_NUM_FORMS": "0", "w-MAX_NUM_FORMS": "40",
        "w-0-name": "chat", "w-0-tokens_per_s": "20000", "w-0-min_memory_gib": "70", "w-0-gpu_model": "",
        "w-1-name": "rag", "w-1-tokens_per_s": "3000", "w-1-min_memory_gib": "20", "w-1-gpu_model": "",
        "target_utilization": "70", "growth": "1", "window_days": "7", "price_per_kwh": "0.12", "currency": "USD",
        "gpu_models": ["h100-sxm-80gb", "h200-sxm-141gb"], "cost_h100-sxm-80gb": "1.89",
        "cost_h200-sxm-141gb": "2.50"}, doseq=True)
    return [
        ("baseline /healthz", "anon", "/healthz"),
        ("baseline authed (console charts list)", "op", "/console/charts/"),
        ("overview", "op", "/console/"),
        ("overview alerts (htmx)", "op", "/console/alerts/"),
        ("nodes", "op", "/console/nodes/"),
        ("nodes page 7", "op", "/console/nodes/?page=7&sort=-hostname"),
        ("node create form", "op", "/console/nodes/new/"),
        ("allocations", "op", "/console/allocations/"),
        ("allocations filtered+sorted", "op", "/console/allocations/?state=active&tier=h200-1g&sort=-tenant__slug"),
        ("allocation detail", "op", f"/console/allocations/{data['alloc'].pk}/"),
        ("drift", "op", "/console/allocations/drift/"),
        ("metering", "op", "/console/allocations/metering/"),
        ("tenants", "op", "/console/tenants/"),
        ("tenants sorted by spend", "op", "/console/tenants/?sort=-spend"),
        ("tenant detail", "op", f"/console/tenants/{data['tenant'].pk}/"),
        ("tenant create form", "op", "/console/tenants/new/"),
        ("tiers (price table)", "op", "/console/tiers/"),
        ("tiers (price table, EUR)", "op", "/console/tiers/?currency=EUR"),
        ("tier detail", "op", f"/console/tiers/{data['tier'].pk}/"),
        ("tier create form", "op", "/console/tiers/new/"),
        ("invoices", "op", "/console/invoices/"),
        ("invoices filtered", "op", "/console/invoices/?status=finalized&sort=-total"),
        ("invoice detail", "op", f"/console/invoices/{data['invoice'].pk}/"),
        ("deployments", "op", "/console/deployments/"),
        ("audit log", "op", "/console/audit/"),
        ("audit log filtered", "op", f"/console/audit/?action=key.create&tenant={data['tenant'].slug}"),
        ("planner", "op", "/console/planner/"),
        ("planner with a plan", "op", f"/console/planner/?{plan}"),
        ("portal home", "owner", "/portal/"),
        ("portal catalog (tiers, prices)", "owner", "/portal/catalog/"),
        ("portal slices", "owner", "/portal/slices/"),
        ("portal models", "owner", "/portal/models/"),
        ("portal model traffic (detail)", "owner", f"/portal/models/{data['deployment'].pk}/"),
        ("portal usage 7 d", "owner", "/portal/usage/"),
        ("portal usage by hour (1 d)", "owner", "/portal/usage/?days=1"),
        ("portal invoices", "owner", "/portal/invoices/"),
        ("portal keys", "owner", "/portal/keys/"),
        ("portal members + invitations", "owner", "/portal/members/"),
        ("invitation page", "anon", f"/invitations/{data['invite_token']}/"),
    ]


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        nodes, _, tenants = part.partition("x")
        out.append((int(nodes), int(tenants)))
    if any(b[0] < a[0] or b[1] < a[1] for a, b in zip(out, out[1:], strict=False)):
        raise SystemExit("--sizes must grow (each size is built by adding to the one before)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="13x20,125x200", help="NODESxTENANTS,... (growing)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--pages", default="", help="SUBSTRING,...: only the pages whose label contains one "
                                               "(the baseline rows are always measured)")
    args = ap.parse_args()
    wanted = [w.strip().lower() for w in args.pages.split(",") if w.strip()]
    sizes = parse_sizes(args.sizes)
    t0 = time.perf_counter()
    configure()
    from django.conf import settings
    from django.db import connection
    from django.test import Client

    # No setup_test_environment(): its instrumented template rendering copies every context and would
    # dominate the figures. Freeze the build's objects so the GC does not rescan them on every request.
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    data: dict | None = None
    results: dict[str, list[tuple[int, int, float, float]]] = {}
    worst = 0.0
    for n_nodes, n_tenants in sizes:
        t1 = time.perf_counter()
        data = build(n_nodes, n_tenants, data)
        planner_hours = roll_planner()
        gc.collect()
        gc.freeze()
        clients = {"anon": Client(), "op": Client(), "owner": Client()}
        clients["op"].force_login(data["op"])
        clients["owner"].force_login(data["owner"])
        print(f"database {connection.vendor}; size {n_nodes}x{n_tenants} built in {time.perf_counter() - t1:.1f} s: "
              + ", ".join(f"{v:,} {k}" for k, v in data["counts"].items())
              + f" (planner rollup: {planner_hours} hours rolled)", flush=True)
        last = (n_nodes, n_tenants) == sizes[-1]
        for label, who, url in pages(data):
            if wanted and not label.startswith("baseline") and not any(w in label.lower() for w in wanted):
                continue
            if label.startswith("planner"):  # its first view after an input change runs the solver: timed apart
                from django.core.cache import cache

                cache.clear()
                t0 = time.perf_counter()
                clients[who].get(url)
                cold = (time.perf_counter() - t0) * 1000
                results.setdefault(f"{label} (cold: solves)", []).append((200, 0, cold, cold))
            xs, status, queries = timed(clients[who], url, args.requests)
            results.setdefault(label, []).append((status, queries, pct(xs, 50), pct(xs, 95)))
            if last and not label.startswith("baseline"):
                worst = max(worst, pct(xs, 95))
    head = "".join(f" | {n}x{t}: status, queries, p50, p95 ms" for n, t in sizes)
    print(f"{'page':38}{head}")
    varying = []
    for label, runs in results.items():
        cells = "".join(f" | {s:>3} {q:>4} {p50:>7.1f} {p95:>7.1f}" for s, q, p50, p95 in runs)
        flag = ""
        if len({q for _s, q, _a, _b in runs}) > 1:
            flag, _ = "  QUERIES VARY WITH SIZE", varying.append(label)
        if runs[-1][3] >= TARGET_P95_MS and not label.startswith("baseline"):
            flag += "  OVER TARGET"
        if any(s != 200 for s, _q, _a, _b in runs):
            flag += "  NOT 200"
        print(f"{label:38}{cells}{flag}")
    verdict = "met" if worst < TARGET_P95_MS else "NOT met"
    print(f"worst p95 at {sizes[-1][0]}x{sizes[-1][1]}: {worst:.1f} ms; target p95 < {TARGET_P95_MS:.0f} ms {verdict}; "
          f"query counts independent of size: {'yes' if not varying else 'NO (' + ', '.join(varying) + ')'}; "
          f"total {time.perf_counter() - t0:.0f} s")
    drop_scratch_db()
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
