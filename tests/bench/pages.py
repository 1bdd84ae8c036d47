"""Benchmark: the operator console's pages on a large fleet, against a baseline measured in the same run.

    .venv/bin/python tests/bench/pages.py [--nodes 125] [--tenants 200] [--requests 50]

Builds 125 nodes of 8 GPUs (half H100, half H200; 1,000 GPUs), 200 tenants and a few thousand active
allocations (GpuInstance, GpuSlot, Allocation and their events, bulk-created consistently), invoices,
drift events, deployments and one telemetry sample per GPU. Then times each console page with Django's
test client (an operator logged in), N requests each, and prints p50/p95 next to /healthz and a
trivial authenticated page (the console's chart list). Target: p95 < 150 ms.

Database: DATABASE_URL if set (a scratch database is created next to it for PostgreSQL), else a scratch
SQLite file.
"""

from __future__ import annotations

import argparse
import gc
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


def configure() -> None:
    global SCRATCH
    SCRATCH = setup_django("tessera_bench_pages", "tessera-bench-pages-")


def build(n_nodes: int, n_tenants: int) -> dict:
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
    from telemetry.models import GpuSample
    from tenants.models import Tenant
    from tests.factories import OperatorFactory
    from tests.fleet_fixtures import make_tier

    rng = random.Random(7)
    now = timezone.now()
    sync_catalog()
    platforms = [ServerPlatform.objects.get(key="hgx-h100-8"), ServerPlatform.objects.get(key="hgx-h200-8")]
    tiers = {}
    for p in platforms:
        m = p.gpu_model
        one = m.profiles.get(memory_slices=1, compute_slices=1, media_extensions=False)
        three = m.profiles.get(memory_slices=4, compute_slices=3, media_extensions=False)
        short = m.key.split("-")[0]
        tiers[m.pk] = {"1g": (make_tier(f"{short}-1g", m.key, one.name), one),
                       "3g": (make_tier(f"{short}-3g", m.key, three.name), three)}
    placements = {pl.profile_id: {x.start: x for x in pl.profile.placements.all()}
                  for pl in MigPlacement.objects.select_related("profile")}
    tenants = Tenant.objects.bulk_create([
        Tenant(name=f"Bench tenant {i:03d}", slug=f"bench-{i:03d}", billing_email=f"b{i}@bench.example",
               max_slices=1000, max_slices_per_tier=1000, max_memory_gb=100_000,
               monthly_spend_limit=Decimal(1000) if i % 4 == 0 else None) for i in range(n_tenants)])
    nodes = Node.objects.bulk_create([
        Node(hostname=f"bench-{i:03d}", platform=platforms[i % 2], queue=f"node.bench-{i:03d}", last_heartbeat=now)
        for i in range(n_nodes)])
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
    ModelDeployment.objects.bulk_create([
        ModelDeployment(allocation=a, tenant_id=a.tenant_id, name=f"model-{a.pk}", backend="python", spec={},
                        memory_mb=4000, state="ready") for a in allocs[::3]])
    GpuSample.objects.bulk_create([
        GpuSample(gpu=g, ts=now - timedelta(seconds=30), activity=rng.random(), memory_used_mb=1000,
                  memory_total_mb=80_000, power_w=300 + rng.random() * 300, energy_j=1e6, temperature_c=50,
                  sm_clock_mhz=1800, mig=True) for g in gpus])
    op = OperatorFactory(email="bench-op@msp.example")
    return {"op": op, "alloc": allocs[len(allocs) // 2], "tenant": tenants[len(tenants) // 2],
            "tier": next(iter(tiers.values()))["1g"][0], "invoice": invoices[1], "counts": {
                "nodes": len(nodes), "gpus": len(gpus), "tenants": len(tenants), "allocations": len(allocs),
                "events": len(events), "invoices": len(invoices)}}


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--tenants", type=int, default=200)
    ap.add_argument("--requests", type=int, default=50)
    args = ap.parse_args()
    t0 = time.perf_counter()
    configure()
    from django.conf import settings
    from django.db import connection
    from django.test import Client

    # No setup_test_environment(): its instrumented template rendering copies every context and would
    # dominate the figures. Freeze the build's objects so the GC does not rescan them on every request.
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    data = build(args.nodes, args.tenants)
    gc.collect()
    gc.freeze()
    built_s = time.perf_counter() - t0
    client = Client()
    client.force_login(data["op"])
    pages = [
        ("baseline /healthz", "/healthz"),
        ("baseline authed (console charts list)", "/console/charts/"),
        ("overview", "/console/"),
        ("nodes", "/console/nodes/"),
        ("nodes page 7", "/console/nodes/?page=7&sort=-hostname"),
        ("allocations", "/console/allocations/"),
        ("allocations filtered+sorted", "/console/allocations/?state=active&tier=h200-1g&sort=-tenant__slug"),
        ("allocation detail", f"/console/allocations/{data['alloc'].pk}/"),
        ("drift", "/console/allocations/drift/"),
        ("tenants", "/console/tenants/"),
        ("tenants sorted by spend", "/console/tenants/?sort=-spend"),
        ("tenant detail", f"/console/tenants/{data['tenant'].pk}/"),
        ("tiers", "/console/tiers/"),
        ("tier detail", f"/console/tiers/{data['tier'].pk}/"),
        ("invoices", "/console/invoices/"),
        ("invoices filtered", "/console/invoices/?status=finalized&sort=-total"),
        ("invoice detail", f"/console/invoices/{data['invoice'].pk}/"),
        ("deployments", "/console/deployments/"),
    ]
    print(f"database {connection.vendor}; built in {built_s:.1f} s: "
          + ", ".join(f"{v} {k}" for k, v in data["counts"].items()))
    print(f"{'page':42} {'status':>6} {'queries':>7} {'p50 ms':>8} {'p95 ms':>8}  vs baseline p50")
    base = None
    worst = 0.0
    for label, url in pages:
        xs, status, queries = timed(client, url, args.requests)
        p50, p95 = pct(xs, 50), pct(xs, 95)
        if label.startswith("baseline authed"):
            base = p50
        ratio = f"x{p50 / base:.1f}" if base and not label.startswith("baseline") else ""
        if not label.startswith("baseline"):
            worst = max(worst, p95)
        flag = "" if p95 < TARGET_P95_MS or label.startswith("baseline") else "  OVER TARGET"
        print(f"{label:42} {status:>6} {queries:>7} {p50:>8.1f} {p95:>8.1f}  {ratio}{flag}")
    verdict = "met" if worst < TARGET_P95_MS else "NOT met"
    print(f"worst console p95 {worst:.1f} ms; target p95 < {TARGET_P95_MS:.0f} ms {verdict}; "
          f"total {time.perf_counter() - t0:.0f} s")
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
