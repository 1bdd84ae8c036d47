"""Benchmark: orders -> active through real Celery node workers and the simulated NVML.

Two runs:

    .venv/bin/python tests/bench/provisioning.py [--orders 100] [--pings 200]
        N orders one after the other (in-process), against a Celery no-op round trip measured in the same run
        on the same broker and workers.

    .venv/bin/python tests/bench/provisioning.py --concurrent [--tenants 5] [--per-tenant 10] [--web-workers 3]
        tenants x per-tenant orders of one 1g.10gb slice each, all sent at once over the HTTP API (POST
        /api/v1/orders/ with each tenant's API key, one client thread per order) to a real web server
        (gunicorn, as docker/compose.yaml runs it) with a real node worker process (solo pool, as in
        production: one per node). Every tenant has the quota for its orders and the fleet has room for all
        of them. Reported: time from the request to the allocation's `activated_at` (p50, p95, max) and the
        HTTP answer's latency, against one order alone through the same path in the same run; then it checks
        that no slot was placed twice and that every tenant holds exactly what it ordered.

Broker: REDIS_URL / CELERY_BROKER_URL if set, else the embedded filesystem broker. Database: DATABASE_URL if set
(a scratch database `<its name>_bench_provisioning` is created next to it for PostgreSQL), else a scratch SQLite
file.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.scratch import setup_django  # noqa: E402

SCRATCH: Path | None = None  # set by configure()


def configure() -> None:
    global SCRATCH
    base = os.environ.get("DATABASE_URL", "").rpartition("/")[2] or "tessera"
    SCRATCH = setup_django(f"{base}_bench_provisioning", "tessera-bench-")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--orders", type=int, default=100)
    ap.add_argument("--pings", type=int, default=200)
    ap.add_argument("--concurrent", action="store_true", help="orders at once over the HTTP API")
    ap.add_argument("--tenants", type=int, default=5)
    ap.add_argument("--per-tenant", type=int, default=10)
    ap.add_argument("--web-workers", type=int, default=3, help="gunicorn --workers (compose runs 3)")
    ap.add_argument("--web-threads", type=int, default=1, help="gunicorn --threads per worker (>1: gthread)")
    ap.add_argument("--singles", type=int, default=3, help="orders alone before the burst (the baseline)")
    args = ap.parse_args()
    configure()
    try:
        if args.concurrent:
            concurrent(args)
        else:
            sequential(args)
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)


def sequential(args) -> None:
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

    assert SCRATCH is not None
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


# --- concurrent orders over the HTTP API ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebServer:
    """gunicorn serving the scratch database, as docker/compose.yaml's `web` service runs it."""

    def __init__(self, workers: int, threads: int, log_path: Path):
        self.port = _free_port()
        self.workers, self.threads, self.log_path = workers, threads, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> WebServer:
        from tests.worker_process import test_database_url

        assert SCRATCH is not None
        env = {**os.environ, "DATABASE_URL": test_database_url(), "LOG_FORMAT": "text", "LOG_LEVEL": "WARNING",
               "TESSERA_SIM_DIR": str(SCRATCH / "sim")}
        log = open(self.log_path, "ab")  # the process owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "marketplace.wsgi:application", "--bind", f"127.0.0.1:{self.port}",
             "--workers", str(self.workers), "--threads", str(self.threads), "--timeout", "60"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if request(self.port, "GET", "/healthz")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn did not answer /healthz; see {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def request(port: int, method: str, path: str, body: dict | None = None, key: str = "") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"raw": raw[:200].decode(errors="replace")}
        return resp.status, data
    finally:
        conn.close()


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of values."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))]


def concurrent(args) -> None:
    from django.conf import settings
    from django.db import connection
    from django.db.models import Sum

    from marketplace.celery import ping
    from marketplace.models import Allocation, GpuInstance, GpuSlot, ServerPlatform
    from marketplace.services import fleet
    from marketplace.services.catalog import sync_catalog
    from marketplace.services.nodes import sim_discovery
    from tenants.models import Tenant
    from tests.factories import make_key
    from tests.fleet_fixtures import make_tier
    from tests.worker_process import Worker

    assert SCRATCH is not None
    n_orders = args.tenants * args.per_tenant
    sync_catalog()
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    n_nodes = -(-(n_orders + args.singles) // (7 * 8))
    nodes = [fleet.register_node(f"bench-{i}", platform, sim_discovery(f"bench-{i}", platform))
             for i in range(n_nodes)]
    tier = make_tier("bench-1g", "h100-sxm-80gb", "1g.10gb")
    keys = []
    quota = args.per_tenant + args.singles  # each tenant may hold what it orders
    for i in range(args.tenants):
        t = Tenant.objects.create(name=f"Bench {i}", slug=f"bench-{i}", billing_email=f"b{i}@bench.example",
                                  max_slices=quota, max_slices_per_tier=quota, max_memory_gb=100_000)
        keys.append((t, make_key(t, ["deployments:write", "read"])[1]))
    connection.close()
    workers = [Worker(n.queue, SCRATCH / "sim", SCRATCH / f"worker-{i}.log").start() for i, n in enumerate(nodes)]
    web = WebServer(args.web_workers, args.web_threads, SCRATCH / "web.log")
    try:
        web.start()
        for n in nodes:
            ping.apply_async(queue=n.queue).get(timeout=60)
        for _ in range(args.web_workers * 2):  # every gunicorn worker has imported and connected
            for _t, key in keys:
                request(web.port, "GET", "/api/v1/orders/", key=key)

        def order(key: str, out: list, i: int, barrier: threading.Barrier | None = None) -> None:
            if barrier is not None:
                barrier.wait(60)
            sent = time.time()
            status, body = request(web.port, "POST", "/api/v1/orders/", {"tier": tier.key, "quantity": 1}, key=key)
            alloc = body["allocations"][0]["id"] if status == 201 else None
            out[i] = (sent, time.time(), status, alloc, "" if status == 201 else json.dumps(body)[:300])

        def wait_settled(ids: list[int], timeout: float = 600) -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                connection.close()
                if not Allocation.objects.filter(pk__in=ids).exclude(state__in=["active", "failed"]).exists():
                    return
                time.sleep(0.1)
            raise RuntimeError(f"allocations not active after {timeout} s; see {SCRATCH}")

        def to_active(results) -> list[float]:
            connection.close()
            at = {a.pk: a.activated_at for a in Allocation.objects.filter(pk__in=[r[3] for r in results if r[3]])}
            return [at[r[3]].timestamp() - r[0] for r in results if r[3] and at.get(r[3])]

        singles: list = [None] * args.singles  # one order alone, the same path: the baseline
        for i in range(args.singles):
            order(keys[i % len(keys)][1], singles, i)
            wait_settled([singles[i][3]])
        single_active = to_active(singles)

        results: list = [None] * n_orders
        barrier = threading.Barrier(n_orders)
        threads = [threading.Thread(target=order, args=(keys[i % len(keys)][1], results, i, barrier))
                   for i in range(n_orders)]
        t0 = time.time()
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        http_s = [r[1] - r[0] for r in results]
        ok = [r for r in results if r[2] == 201]
        wait_settled([r[3] for r in ok])
        wall = time.time() - t0
        active = to_active(ok)
    finally:
        web.stop()
        for w in workers:
            w.stop()

    connection.close()
    refused = [r for r in results if r[2] != 201]
    slots = GpuSlot.objects.count()
    sizes = GpuInstance.objects.aggregate(n=Sum("size"))["n"]
    instances = GpuInstance.objects.count()
    live = {t.slug: Allocation.objects.filter(tenant=t, state="active").count() for t, _ in keys}
    expected = {t.slug: args.per_tenant + sum(1 for i in range(args.singles) if i % len(keys) == j)
                for j, (t, _) in enumerate(keys)}
    broker = settings.CELERY_BROKER_URL.split(":")[0]
    db = os.environ["DATABASE_URL"].split(":")[0]
    print(f"broker {broker}, database {db}, gunicorn --workers {args.web_workers} --threads {args.web_threads}, "
          f"{n_nodes} node worker(s) "
          f"(solo pool), simulated NVML, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"one order alone -> active ({args.singles} runs): p50 {statistics.median(single_active):.2f} s")
    print(f"{n_orders} concurrent orders from {args.tenants} tenants over the API:")
    print(f"  HTTP answer:     p50 {statistics.median(http_s):.2f} s, p95 {pct(http_s, 95):.2f} s, "
          f"max {max(http_s):.2f} s")
    if active:
        print(f"  order -> active: p50 {statistics.median(active):.2f} s, p95 {pct(active, 95):.2f} s, "
              f"max {max(active):.2f} s ({len(active)} active, all within {wall:.2f} s)")
    print(f"  refused: {len(refused)}" + "".join(f"\n    {r[2]} {r[4]}" for r in refused[:5]))
    print(f"  slots {slots} = sizes of {instances} instances: {slots == sizes}; "
          f"each tenant holds what it ordered: {live == expected}")


if __name__ == "__main__":
    main()
