"""Benchmark: N orders -> active through real Celery node workers and the simulated NVML, against a
Celery no-op round trip measured in the same run on the same broker and workers.

    .venv/bin/python tests/bench/provisioning.py [--orders 100] [--pings 200]

Broker: REDIS_URL / CELERY_BROKER_URL if set, else the embedded filesystem broker. Database: DATABASE_URL
if set (a scratch database is created next to it for PostgreSQL), else a scratch SQLite file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.scratch import setup_django  # noqa: E402

SCRATCH: Path | None = None  # set by configure()


def configure() -> None:
    global SCRATCH
    SCRATCH = setup_django("tessera_bench", "tessera-bench-")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--orders", type=int, default=100)
    ap.add_argument("--pings", type=int, default=200)
    args = ap.parse_args()
    configure()
    from django.conf import settings

    from marketplace.celery import ping
    from marketplace.models import Allocation, ServerPlatform, Tier
    from marketplace.services import fleet, orders
    from marketplace.services.catalog import sync_catalog
    from marketplace.services.nodes import sim_discovery
    from tenants.models import Tenant
    from tenants.scoping import principal_for_user
    from tests.factories import OperatorFactory
    from tests.fleet_fixtures import make_tier
    from tests.worker_process import Worker, wait_for

    sync_catalog()
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    n_nodes = -(-args.orders // (7 * 8))
    nodes = [fleet.register_node(f"bench-{i}", platform, sim_discovery(f"bench-{i}", platform))
             for i in range(n_nodes)]
    tier = make_tier("bench-1g", "h100-sxm-80gb", "1g.10gb")
    tenant = Tenant.objects.create(name="Bench", slug="bench", billing_email="b@bench.example",
                                   max_slices=10_000, max_slices_per_tier=10_000, max_memory_gb=1_000_000)
    op = principal_for_user(OperatorFactory(email="bench@msp.example"))
    workers = [Worker(n.queue, SCRATCH / "sim", SCRATCH / f"worker-{i}.log").start() for i, n in enumerate(nodes)]
    try:
        for n in nodes:  # warm up: each worker answers once
            ping.apply_async(queue=n.queue).get(timeout=60)
        t0 = time.perf_counter()
        results = [ping.apply_async(queue=nodes[i % n_nodes].queue) for i in range(args.pings)]
        for r in results:
            r.get(timeout=120)
        noop_s = time.perf_counter() - t0
        noop_rate = args.pings / noop_s

        t0 = time.perf_counter()
        ids = []
        for _ in range(args.orders):
            ids += list(orders.create_order(op, tenant=tenant, tier=Tier.objects.get(pk=tier.pk))
                        .allocations.values_list("pk", flat=True))
        placed_s = time.perf_counter() - t0

        def all_active():
            from django.db import connection

            connection.close()
            return Allocation.objects.filter(pk__in=ids, state="active").count() == len(ids)

        wait_for(all_active, 600, "all allocations active", workers[0], interval=0.05)
        total_s = time.perf_counter() - t0
    finally:
        for w in workers:
            w.stop()
    rate = args.orders / total_s
    broker = settings.CELERY_BROKER_URL.split(":")[0]
    db = os.environ["DATABASE_URL"].split(":")[0]
    print(f"broker {broker}, database {db}, {n_nodes} node worker(s) (solo pool), simulated NVML")
    print(f"no-op task round trip:      {args.pings} tasks in {noop_s:.2f} s = {noop_rate:.1f} tasks/s")
    print(f"orders placed (web side):   {args.orders} in {placed_s:.2f} s = {args.orders / placed_s:.1f} orders/s")
    print(f"orders -> active:           {args.orders} in {total_s:.2f} s = {rate:.1f} allocations/s")
    print(f"ratio allocations/s : no-op tasks/s = {rate / noop_rate:.3f}")
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
