"""Benchmark: the inference gateway against direct Triton, on one REAL tritonserver, measured in the same run.

    .venv/bin/python tests/bench/gateway.py [--duration 10] [--clients 1,32,128] [--max-tokens 16] [--only plain]

One tritonserver (the nvidia-pytriton binary, CPU, python backend) serves tiny-gen and the decoupled tiny-chat
(marketplace.hardware.triton's demo models written to a repository). It runs without the restricted-API flags
(the gateway's secret header is sent anyway, and ignored). A simulated slice with both models deployed is
provisioned in a scratch database and its server row pointed at that tritonserver, so ``manage.py gateway`` (a
real process: uvicorn, uvloop, httptools) routes to it exactly as to a slice's server. The gateway's limits and
usage stream are on a private redis-server (AOF, ``appendfsync everysec``: production durability), and
``manage.py usage_consumer`` writes the stream into the database while the load runs.

The same aiohttp load generator (keep-alive, N clients in a closed loop, fixed duration after a warm-up) drives,
at each number of clients, in turn:

- plain: Triton ``/v2/models/tiny-gen/generate`` direct, then through the gateway as ``/v1/completions`` and as
  ``/v2/models/tiny-gen/generate``;
- streaming: Triton ``/v2/models/tiny-chat/generate_stream`` direct, then through the gateway as
  ``/v1/chat/completions`` with ``stream: true`` and as ``/v2/models/tiny-chat/generate_stream``.

Prints requests/s and latency p50/p95 (streaming: to the last byte, and to the first byte), the ratio of the
gateway's throughput to direct Triton's (goal >= 0.8), the latency it adds (goal <= 2 ms p50, <= 8 ms p95), the
CPU each request costs in the gateway and in Triton, and the metering: answers/s, events stored/s, the stream's
length before and after each run, and at the end that every answer with 200 has exactly one usage event.
Database: DATABASE_URL if set (a scratch database next to it for PostgreSQL), else a scratch SQLite file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.scratch import setup_django  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog"
CLK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # local
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer: {log.read_text(errors='replace')[-2000:]}")


def session_cpu_s(sid: int) -> float:
    """User + system CPU seconds of every process in the session ``sid`` (a server and its python stubs)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # field 6 of /proc/<pid>/stat: the session id
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            continue
    return total / CLK


class Child:
    """A process of its own session (so its children die with it), output in a log."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


# --- the load generator ------------------------------------------------------------------------------------

@dataclass
class Result:
    label: str
    clients: int
    duration: float
    latencies: list[float] = field(default_factory=list)  # ms, completed within the measured window
    first_byte: list[float] = field(default_factory=list)  # ms, streaming only
    ok_total: int = 0  # every 200, warm-up and tail included (each one must have its usage event)
    bad: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    cpu_gateway_s: float = 0.0  # the proxy in front: the gateway, or the bare proxy
    cpu_triton_s: float = 0.0
    metering: tuple[int, int, int, int] | None = None  # stream length before, after; events stored before, after

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.duration

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")

    @property
    def p95(self) -> float:
        return pct(self.latencies, 0.95)


async def _load(result: Result, url: str, body: dict, headers: dict[str, str], stream: bool, warmup: float) -> None:
    import aiohttp

    clock = time.perf_counter  # not loop.time(): uvloop's clock has millisecond resolution
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", **headers}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        start = clock() + warmup
        end = start + result.duration

        async def client() -> None:
            while clock() < end:
                t0 = clock()
                first = None
                try:
                    async with session.post(url, data=data, headers=headers) as resp:
                        if stream:
                            async for _chunk in resp.content.iter_any():
                                if first is None:
                                    first = clock()
                        else:
                            await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError, OSError):
                    result.errors += 1
                    continue
                t1 = clock()
                if status != 200:
                    result.bad[status] = result.bad.get(status, 0) + 1
                    continue
                result.ok_total += 1
                if start <= t1 <= end:
                    result.latencies.append((t1 - t0) * 1000)
                    if first is not None:
                        result.first_byte.append((first - t0) * 1000)

        await asyncio.gather(*(client() for _ in range(result.clients)))


def run_load(result: Result, url: str, body: dict, headers: dict[str, str], *, stream: bool, warmup: float,
             cpu_of: tuple[int, int]) -> Result:
    import uvloop

    gw_sid, triton_sid = cpu_of
    g0, t0 = session_cpu_s(gw_sid), session_cpu_s(triton_sid)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_load(result, url, body, headers, stream, warmup))
    result.cpu_gateway_s, result.cpu_triton_s = session_cpu_s(gw_sid) - g0, session_cpu_s(triton_sid) - t0
    return result


# --- the baseline: a bare aiohttp proxy (no auth, no limits, no metering) ----------------------------------

def serve_bare_proxy(port: int, upstream: str, secret: str) -> None:
    """Forward every request as it came (method, path, body, Content-Type) to ``upstream`` with the server's
    secret header, over one pooled aiohttp session set up as the gateway's; the answer streamed back as it comes.
    What any proxy in front of Triton costs: the gateway's overhead is measured against this."""
    import aiohttp
    import uvloop
    from aiohttp import web

    from marketplace.hardware.runtime import SECRET_HEADER

    async def make_app() -> web.Application:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=512, keepalive_timeout=60, ttl_dns_cache=None)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
                                        timeout=aiohttp.ClientTimeout(total=300, sock_connect=5))
        extra = {"Accept-Encoding": "identity", SECRET_HEADER: secret}

        async def forward(request: web.Request) -> web.StreamResponse:
            headers = {"Content-Type": request.headers.get("Content-Type", "application/json"), **extra}
            async with session.request(request.method, upstream + request.path_qs, data=await request.read(),
                                       headers=headers) as up:
                if request.path.endswith("_stream"):
                    resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
                return web.Response(status=up.status, body=await up.read(),
                                    headers={"Content-Type": up.headers.get("Content-Type", "application/json")})

        async def close(_app: web.Application) -> None:
            await session.close()

        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_route("*", "/{tail:.*}", forward)
        app.on_cleanup.append(close)
        return app

    web.run_app(make_app(), host="127.0.0.1", port=port, print=None, access_log=None,
                loop=uvloop.new_event_loop())


# --- set-up: a slice pointed at the real tritonserver ------------------------------------------------------

def make_fleet(triton_port: int) -> tuple[str, str]:
    """A tenant with tiny-gen and tiny-chat ready on one slice whose server is the real tritonserver; returns
    (the tenant's inference key, the server's secret header value)."""
    from marketplace.models import Allocation, ServerPlatform, TritonServer
    from marketplace.services import deployments, fleet, orders, provisioning
    from marketplace.services.catalog import sync_catalog
    from marketplace.services.nodes import sim_discovery
    from marketplace.services.serving import secret_for
    from tenants.models import ApiKey, Tenant
    from tenants.roles import Role
    from tenants.scoping import principal_for_user
    from tests.factories import MembershipFactory, make_key
    from tests.fleet_fixtures import make_tier

    sync_catalog()
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    fleet.register_node("bench-gateway", platform, sim_discovery("bench-gateway", platform))
    tier = make_tier("bench-1g", "h100-sxm-80gb", "1g.10gb")
    tenant = Tenant.objects.create(name="Bench", slug="bench", billing_email="b@bench.example", max_slices=10,
                                   max_slices_per_tier=10, max_memory_gb=1000, max_concurrent_requests=100_000)
    owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    a = orders.create_order(owner, tenant=tenant, tier=tier).allocations.get()
    assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
    a = Allocation.objects.get(pk=a.pk)
    for name in ("tiny-gen", "tiny-chat"):
        dep = deployments.deploy(owner, a, name, template=name)
        assert deployments.load(dep.pk) == "ready"
    TritonServer.objects.filter(allocation=a).update(address="127.0.0.1", http_port=triton_port)
    key, secret = make_key(tenant, ["inference"])
    ApiKey.objects.filter(pk=key.pk).update(requests_per_minute=2_000_000_000, tokens_per_minute=2_000_000_000)
    return secret, secret_for(TritonServer.objects.get(allocation=a))


def start_redis(scratch: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    data = scratch / "redis"
    data.mkdir()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data)],
                            stdout=(scratch / "redis.log").open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    import redis

    r = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            r.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


# --- the snapshot refresh at fleet scale ---------------------------------------------------------------------

def seed_world(n_keys: int, n_deployments: int, n_tenants: int, n_slices: int) -> None:
    """``n_tenants`` tenants (half with this month's invoice) holding ``n_keys`` keys; ``n_slices`` of them with a
    real provisioned slice each, together serving ``n_deployments`` ready deployments (bulk copies of a deployed
    tiny-gen, distinct names), each slice with LoRA-style adapters on a tenth of its deployments."""
    from datetime import timedelta

    from django.utils import timezone

    from marketplace.models import (
        Allocation,
        Invoice,
        LibraryModel,
        LoraAdapter,
        ModelDeployment,
        ModelRepository,
        ServerPlatform,
    )
    from marketplace.services import deployments, fleet, orders, provisioning
    from marketplace.services.catalog import sync_catalog
    from marketplace.services.nodes import sim_discovery
    from tenants import keys as key_service
    from tenants.models import ApiKey, Tenant
    from tenants.roles import Role
    from tenants.scoping import principal_for_user
    from tests.factories import MembershipFactory
    from tests.fleet_fixtures import make_tier

    sync_catalog()
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    fleet.register_node("bench-snap", platform, sim_discovery("bench-snap", platform))
    tier = make_tier("bench-1g", "h100-sxm-80gb", "1g.10gb")
    tenants = Tenant.objects.bulk_create([Tenant(name=f"T{i}", slug=f"t{i}", billing_email=f"t{i}@x.example",
                                                 max_slices=4, max_slices_per_tier=4, max_memory_gb=1000)
                                          for i in range(n_tenants)])
    today = timezone.now().date()
    start = today.replace(day=1)
    Invoice.objects.bulk_create([Invoice(tenant=t, period_start=start, period_end=start + timedelta(days=32),
                                         currency="USD", total=i % 97, rated_at=timezone.now())
                                 for i, t in enumerate(tenants) if i % 2 == 0])
    rows = []
    for i in range(n_keys):
        _secret, prefix, hashed = key_service.generate()
        rows.append(ApiKey(tenant=tenants[i % n_tenants], name=f"k{i}", prefix=prefix, hashed_key=hashed,
                           scopes=["inference"]))
    ApiKey.objects.bulk_create(rows, batch_size=2000)
    per_slice = -(-n_deployments // n_slices)
    made = 0
    library = LibraryModel.objects.first()
    for s in range(n_slices):
        tenant = tenants[s]
        owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
        a = orders.create_order(owner, tenant=tenant, tier=tier).allocations.get()
        assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
        a = Allocation.objects.get(pk=a.pk)
        first = deployments.deploy(owner, a, "m0", template="tiny-gen")
        assert deployments.load(first.pk) == "ready"
        first = ModelDeployment.objects.get(pk=first.pk)
        copies = [ModelDeployment(allocation=a, tenant=tenant, name=f"m{j}", backend=first.backend, spec=first.spec,
                                  memory_mb=1, state=ModelDeployment.State.READY)
                  for j in range(1, min(per_slice, n_deployments - made))]
        ModelDeployment.objects.bulk_create(copies)
        made += 1 + len(copies)
        if library is not None:  # adapters on a tenth of the slice's deployments
            adapters = LoraAdapter.objects.bulk_create([
                LoraAdapter(tenant=tenant, base=library, name=f"lora{j}", source=ModelRepository.Source.choices[0][0],
                            path=f"bench/lora{j}") for j in range(max(1, per_slice // 10))])
            through = ModelDeployment.adapters.through
            through.objects.bulk_create([through(modeldeployment_id=d.pk, loraadapter_id=ad.pk)
                                         for d, ad in zip(copies, adapters, strict=False)])


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _pid_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def snapshot_bench(args) -> None:
    """The refresh at ``--keys`` keys and ``--deployments`` deployments: a full build, an unchanged world, one key
    revoked, one deployment leaving and re-entering; wall time, this process's CPU (what the gateway pays) and, on
    PostgreSQL, the database backend's CPU; the snapshot's memory."""
    import gc
    import random
    import tracemalloc

    scratch = setup_django("tessera_bench_gateway_snap", "tessera-bench-gateway-snap-")
    try:
        from django.conf import settings
        from django.db import connection
        from django.utils import timezone

        from marketplace.gateway.state import Loader
        from marketplace.models import ModelDeployment
        from tenants.models import ApiKey

        t0 = time.perf_counter()
        seed_world(args.keys, args.deployments, args.tenants, args.slices)
        print(f"seeded in {time.perf_counter() - t0:.0f} s", flush=True)
        pg = connection.vendor == "postgresql"
        connection.ensure_connection()
        backend = None
        if pg:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                backend = cur.fetchone()[0]
        rss0 = _rss_mib()

        def measure(label: str, before, n: int) -> tuple[str, list[float], list[float], float]:
            """Wall and CPU per load (ms); the database backend's CPU per load, averaged (10 ms clock ticks)."""
            walls, cpus, db = [], [], 0.0
            for _ in range(n):
                if before is not None:
                    before()
                db0 = _pid_cpu_s(backend) if backend else 0.0
                c0, w0 = time.process_time(), time.perf_counter()
                loader.load()
                walls.append((time.perf_counter() - w0) * 1000)
                cpus.append((time.process_time() - c0) * 1000)
                db += (_pid_cpu_s(backend) - db0) * 1000 if backend else float("nan")
            return label, walls, cpus, db / n

        rows = []
        fulls = []
        for _ in range(3):
            loader = Loader()
            fulls.append(measure("full build (a fresh process's first refresh)", None, 1))
        rows.append((fulls[0][0], [w for f in fulls for w in f[1]], [c for f in fulls for c in f[2]],
                     statistics.mean(f[3] for f in fulls)))
        gc.collect()
        tracemalloc.start()
        loader = Loader()
        loader.load()
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss1 = _rss_mib()
        rows.append(measure("no change", None, 50))
        keys = list(ApiKey.objects.values_list("pk", flat=True))
        rng = random.Random(1)

        def revoke() -> None:
            ApiKey.objects.filter(pk=rng.choice(keys)).update(revoked_at=timezone.now())

        rows.append(measure("one key revoked", revoke, 10))
        rereads = loader.keys.reread
        dep = ModelDeployment.objects.filter(state="ready").order_by("pk").last()
        flip = iter([ModelDeployment.State.UNLOADING, ModelDeployment.State.READY] * 10)

        def toggle() -> None:
            ModelDeployment.objects.filter(pk=dep.pk).update(state=next(flip))

        rows.append(measure("one deployment unloaded / ready again", toggle, 10))
        snap = loader.last
        assert snap is not None
        n_routes = sum(len(u) for u in snap.routes.values())
        every = settings.TESSERA_GATEWAY_REFRESH_S
        db = "PostgreSQL" if pg else "SQLite"
        print(f"\nSnapshot refresh: {len(snap.keys):,} keys, {len(snap.tenants):,} tenants, "
              f"{len(loader.deployments.values()):,} ready deployments, "
              f"{n_routes:,} routes (deployments and adapters), {db}; one key revoked re-read {rereads} keys "
              f"({loader.keys.buckets} buckets); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}.\n")
        print(f"| refresh | wall p50 / max ms | gateway CPU p50 ms | share of one core at one refresh per "
              f"{every:g} s | database CPU mean ms |")
        print("|---|---|---|---|---|")
        for label, walls, cpus, dbs in rows:
            print(f"| {label} | {statistics.median(walls):.1f} / {max(walls):.1f} | {statistics.median(cpus):.1f} | "
                  f"{statistics.median(cpus) / 1000 / every:.2%} | {dbs:.1f} |")
        print(f"\nmemory: the loader and its snapshot hold {held / 2**20:.1f} MiB (tracemalloc; peak while "
              f"building {peak / 2**20:.1f} MiB); process RSS {rss0:.0f} -> {rss1:.0f} MiB after four loaders")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds per run before measuring")
    ap.add_argument("--clients", default="1,32,128", help="concurrent clients, comma-separated (1: the latency the "
                    "gateway adds without queueing)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--only", choices=["plain", "stream", "snapshot"], default=None,
                    help="snapshot: only the snapshot refresh at --keys / --deployments (no tritonserver)")
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--deployments", type=int, default=2_000)
    ap.add_argument("--tenants", type=int, default=1_000)
    ap.add_argument("--slices", type=int, default=20, help="slices the deployments are spread over")
    ap.add_argument("--rounds", type=int, default=1, help="times each run list is repeated, interleaved")
    ap.add_argument("--serve-bare-proxy", nargs=3, metavar=("PORT", "UPSTREAM", "SECRET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_bare_proxy:
        port, upstream, secret = args.serve_bare_proxy
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
        serve_bare_proxy(int(port), upstream, secret)
        return
    if args.only == "snapshot":
        snapshot_bench(args)
        return
    clients = [int(c) for c in args.clients.split(",")]

    from tests.triton_server import running_tritonserver, tritonserver_available

    ok, reason = tritonserver_available()
    if not ok:
        sys.exit(f"tritonserver is not available: {reason}")
    scratch = setup_django("tessera_bench_gateway", "tessera-bench-gateway-")
    from django.conf import settings

    from marketplace.hardware.runtime import SECRET_HEADER
    from marketplace.hardware.triton import HttpTritonBackend, demo_chat_model, demo_text_model, write_repository
    from telemetry.models import UsageEvent

    repo = scratch / "repo"
    write_repository(repo, demo_text_model("tiny-gen"))
    write_repository(repo, demo_chat_model("tiny-chat"))
    redis_proc, redis_url = start_redis(scratch)
    stream = f"tessera:bench-usage:{uuid.uuid4().hex[:8]}"
    settings.REDIS_URL, settings.TESSERA_USAGE_STREAM = redis_url, stream
    import redis

    r = redis.Redis.from_url(redis_url)
    children: list[Child] = []
    results: list[Result] = []
    try:
        with running_tritonserver(repo) as (triton_url, metrics_url, triton_proc):
            with HttpTritonBackend(triton_url, metrics_url) as triton:
                for name in ("tiny-gen", "tiny-chat"):
                    triton.load_model(name)
                    assert triton.is_model_ready(name), name
            key, secret = make_fleet(int(triton_url.rsplit(":", 1)[1]))
            env = {**os.environ, "REDIS_URL": redis_url, "TESSERA_USAGE_STREAM": stream,
                   "TESSERA_GATEWAY_REFRESH_S": "2", "LOG_FORMAT": "text", "LOG_LEVEL": "WARNING"}
            port = free_port()
            gw = Child([sys.executable, "manage.py", "gateway", "--port", str(port)], scratch / "gateway.log", env)
            children.append(gw)
            gw_url = f"http://127.0.0.1:{port}"
            wait_http(f"{gw_url}/v2/health/ready", gw.proc, gw.log)
            consumer = Child([sys.executable, "manage.py", "usage_consumer"], scratch / "consumer.log", env)
            children.append(consumer)
            bare_port = free_port()
            bare = Child([sys.executable, __file__, "--serve-bare-proxy", str(bare_port), triton_url, secret],
                         scratch / "bare.log", env)
            children.append(bare)
            bare_url = f"http://127.0.0.1:{bare_port}"
            wait_http(f"{bare_url}/v2/health/ready", bare.proc, bare.log)
            gw_sid, bare_sid = gw.proc.pid, bare.proc.pid
            direct_h = {SECRET_HEADER: secret}
            gw_h = {"Authorization": f"Bearer {key}"}
            n = args.max_tokens
            chat_prompt = f"user: {PROMPT}\nassistant:"  # what /v1/chat/completions sends the model
            plain = [
                ("direct Triton /v2 generate", f"{triton_url}/v2/models/tiny-gen/generate", direct_h,
                 {"prompt": PROMPT, "max_tokens": n}, False, gw_sid),
                ("bare aiohttp proxy /v2 generate", f"{bare_url}/v2/models/tiny-gen/generate", {},
                 {"prompt": PROMPT, "max_tokens": n}, False, bare_sid),
                ("gateway /v1/completions", f"{gw_url}/v1/completions", gw_h,
                 {"model": "tiny-gen", "prompt": PROMPT, "max_tokens": n}, True, gw_sid),
                ("gateway /v2 generate", f"{gw_url}/v2/models/tiny-gen/generate", gw_h,
                 {"prompt": PROMPT, "max_tokens": n}, True, gw_sid),
            ]
            streaming = [
                ("direct Triton /v2 generate_stream", f"{triton_url}/v2/models/tiny-chat/generate_stream", direct_h,
                 {"prompt": chat_prompt, "max_tokens": n}, False, gw_sid),
                ("bare aiohttp proxy /v2 generate_stream", f"{bare_url}/v2/models/tiny-chat/generate_stream", {},
                 {"prompt": chat_prompt, "max_tokens": n}, False, bare_sid),
                ("gateway /v1/chat/completions stream", f"{gw_url}/v1/chat/completions", gw_h,
                 {"model": "tiny-chat", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n,
                  "stream": True}, True, gw_sid),
                ("gateway /v2 generate_stream", f"{gw_url}/v2/models/tiny-chat/generate_stream", gw_h,
                 {"prompt": chat_prompt, "max_tokens": n}, True, gw_sid),
            ]
            groups = [g for g in (("plain", plain, False), ("stream", streaming, True))
                      if args.only in (None, g[0])]
            for kind, runs, is_stream in groups:
                for c in clients:
                    for label, url, headers, body, through_gateway, proxy_sid in runs * args.rounds:
                        res = Result(label, c, args.duration)
                        before = (r.xlen(stream), UsageEvent.objects.count())
                        run_load(res, url, body, headers, stream=is_stream, warmup=args.warmup,
                                 cpu_of=(proxy_sid, triton_proc.pid))
                        if through_gateway:
                            res.metering = (before[0], r.xlen(stream), before[1], UsageEvent.objects.count())
                        results.append(res)
                        print(f"  {kind:6} {label:38} c={c:<4} {res.rps:8.0f} req/s  p50 {res.p50:7.2f} ms  "
                              f"p95 {res.p95:7.2f} ms  errors {res.errors} {res.bad or ''}", flush=True)
            # every answer with 200 has exactly one usage event, once the consumer has caught up
            answered = sum(x.ok_total for x in results if x.metering is not None)
            deadline = time.monotonic() + 120
            while (r.xlen(stream) or UsageEvent.objects.count() < answered) and time.monotonic() < deadline:
                time.sleep(0.2)
            stored = UsageEvent.objects.count()
    finally:
        for child in reversed(children):
            child.stop()
        redis_proc.terminate()
        try:
            redis_proc.wait(10)
        except subprocess.TimeoutExpired:
            redis_proc.kill()
            redis_proc.wait(5)
        shutil.rmtree(scratch, ignore_errors=True)

    report(results, clients, answered, stored, args)


def report(results: list[Result], clients: list[int], answered: int, stored: int, args) -> None:
    direct: dict[tuple[str, int], Result] = {}  # the latest direct run before each row (same round)
    cpus = os.cpu_count()
    print(f"\nGateway vs direct Triton: one CPU tritonserver (python backend, tiny-gen / decoupled tiny-chat, "
          f"max_tokens {args.max_tokens}), one `manage.py gateway` process (uvloop, httptools), Redis AOF "
          f"everysec, usage_consumer running; aiohttp load generator, keep-alive, {args.duration:g} s per run "
          f"after {args.warmup:g} s warm-up; {cpus} CPUs shared by all of them.\n")
    print("| run | clients | req/s | p50 ms | p95 ms | first byte p50 ms | throughput ratio (goal >= 0.8) | "
          "added p50 ms (goal <= 2) | added p95 ms (goal <= 8) | CPU/request gateway, Triton | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in results:
        is_direct = x.label.startswith("direct")
        if is_direct:
            direct[("stream" if "stream" in x.label else "generate", x.clients)] = x
        base = direct[("stream" if "stream" in x.label else "generate", x.clients)]
        fb = f"{statistics.median(x.first_byte):.2f}" if x.first_byte else "—"
        n = max(1, len(x.latencies))
        cpu = (f"{x.cpu_gateway_s / n * 1e6:.0f} µs, " if not is_direct else "—, ") + \
            f"{x.cpu_triton_s / n * 1e6:.0f} µs"
        errs = x.errors + sum(x.bad.values())
        if is_direct:
            print(f"| {x.label} | {x.clients} | {x.rps:.0f} | {x.p50:.2f} | {x.p95:.2f} | {fb} | — | — | — | {cpu} "
                  f"| {errs} |")
            continue
        ratio = x.rps / base.rps if base.rps else float("nan")
        d50, d95 = x.p50 - base.p50, x.p95 - base.p95
        print(f"| {x.label} | {x.clients} | {x.rps:.0f} | {x.p50:.2f} | {x.p95:.2f} | {fb} | "
              f"{ratio:.2f} {'ok' if ratio >= 0.8 else 'MISS'} | {d50:+.2f} {'ok' if d50 <= 2 else 'MISS'} | "
              f"{d95:+.2f} {'ok' if d95 <= 8 else 'MISS'} | {cpu} | {errs} |")
    print(f"\nCPU per request of the proxy in front of Triton, over {args.rounds} interleaved round(s): the gateway "
          f"(auth, limits, metering) against a bare aiohttp proxy (no auth, limits or metering; same upstream, same "
          f"requests, same run); load average {os.getloadavg()[0]:.2f}.\n")
    print("| run | clients | CPU/request | ratio to the bare proxy (goal <= 1.2) |")
    print("|---|---|---|---|")
    totals: dict[tuple[str, int], list[float]] = {}
    for x in results:
        if not x.label.startswith("direct"):
            t = totals.setdefault((x.label, x.clients), [0.0, 0])
            t[0] += x.cpu_gateway_s
            t[1] += x.ok_total + sum(x.bad.values())
    for (label, c), (cpu_s, n) in totals.items():
        if label.startswith("bare"):
            continue
        kind = "generate_stream" if "stream" in label else "generate"
        b_cpu, b_n = totals.get((f"bare aiohttp proxy /v2 {kind}", c), (float("nan"), 1))
        per, base = cpu_s / max(1, n), b_cpu / max(1, b_n)
        ratio = per / base if base else float("nan")
        print(f"| {label} (bare proxy: {base * 1e6:.0f} µs) | {c} | {per * 1e6:.0f} µs | {ratio:.2f} "
              f"{'ok' if ratio <= 1.2 else 'MISS'} |")
    print("\nMetering (the usage consumer writing the stream into the database during the load)\n")
    print("| run | clients | answers/s | events stored/s | stream length before -> after |")
    print("|---|---|---|---|---|")
    for x in results:
        if x.metering is None:
            continue
        len0, len1, ev0, ev1 = x.metering
        span = x.duration + args.warmup
        print(f"| {x.label} | {x.clients} | {x.ok_total / span:.0f} | {(ev1 - ev0) / span:.0f} | {len0} -> {len1} |")
    verdict = "exact" if stored == answered else "NOT EXACT"
    print(f"\nmetering {verdict}: {stored} usage events stored for {answered} answers with 200 through the gateway")


if __name__ == "__main__":
    main()
