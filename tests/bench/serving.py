"""Benchmark: orders on REAL tritonserver processes started by the serving runtime (``process``), sandboxed and
unsandboxed in the same run, against a bare tritonserver started and loaded directly (no Tessera).

    .venv/bin/python tests/bench/serving.py [--orders 20] [--requests 2000]

Orders alternate between a sandboxed slice (as root: its own namespaces, firewall rules, cgroup and Unix user)
and an unsandboxed one (the server as the worker's user, on 127.0.0.1). For each: order -> active (slice created,
server started, answered ready), then deploy -> ready model (tiny-gen, python backend); then the resident memory
of every idle server. Then ``manage.py gateway`` (a real process) serves one sandboxed and one unsandboxed
tiny-gen, and ``--requests`` sequential requests (keep-alive, alternating) through it to each give the latency the
sandbox adds per request (p50/p95: the veth pair and the firewall rules on the path from the gateway to the
server). Prints p50/p95 and the ratios sandboxed / unsandboxed (goals: < 1.10 for start, < 0.2 ms per request)
and to the bare server. Database: DATABASE_URL if set (a scratch database next to it for PostgreSQL), else a
scratch SQLite file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.scratch import setup_django  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def session_rss_mb(sid: int) -> float:
    """Resident memory of every process in the session ``sid`` (a server and its python stubs)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # field 6 of /proc/<pid>/stat: the session id
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1024


def pid_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def bare_baseline(runs: int) -> tuple[list[float], list[float]]:
    """Start a bare tritonserver on an empty repository and load tiny-gen straight through tritonclient."""
    from marketplace.hardware.triton import HttpTritonBackend, demo_text_model, write_repository
    from tests.triton_server import start_tritonserver, stop_tritonserver

    starts, loads = [], []
    for i in range(runs):
        repo = Path(SCRATCH) / f"bare-{i}"
        repo.mkdir()
        t0 = time.monotonic()
        server = start_tritonserver(repo)
        starts.append(time.monotonic() - t0)
        try:
            write_repository(repo, demo_text_model("tiny-gen"))
            with HttpTritonBackend(server.http_url, server.metrics_url) as client:
                t0 = time.monotonic()
                client.load_model("tiny-gen")
                assert client.is_model_ready("tiny-gen")
                loads.append(time.monotonic() - t0)
        finally:
            stop_tritonserver(server)
    return starts, loads


SCRATCH = ""


def gateway_latency(scratch: Path, key: str, models: dict[str, str], requests: int) -> dict[str, list[float]]:
    """``requests`` sequential generate calls through a real gateway process to each model, alternating; ms."""
    import http.client
    import json
    import signal
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = scratch / "gateway.log"
    env = {**os.environ, "TESSERA_GATEWAY_REFRESH_S": "1", "LOG_FORMAT": "text", "LOG_LEVEL": "WARNING"}
    env.pop("REDIS_URL", None)  # the spool: the same on both paths
    gw = subprocess.Popen([sys.executable, "manage.py", "gateway", "--port", str(port)], cwd=ROOT, env=env,
                          stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    out: dict[str, list[float]] = {label: [] for label in models}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 4})
        deadline = time.monotonic() + 60
        while True:  # up, and its snapshot has both routes
            try:
                ok = True
                for name in models.values():
                    conn.request("POST", f"/v2/models/{name}/generate", body, headers)
                    resp = conn.getresponse()
                    resp.read()
                    ok = ok and resp.status == 200
                if ok:
                    break
            except OSError:
                conn.close()
            if time.monotonic() > deadline or gw.poll() is not None:
                raise RuntimeError(f"the gateway did not serve both models: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        for _ in range(requests):
            for label, name in models.items():
                t0 = time.perf_counter()
                conn.request("POST", f"/v2/models/{name}/generate", body, headers)
                resp = conn.getresponse()
                resp.read()
                out[label].append((time.perf_counter() - t0) * 1000)
                assert resp.status == 200, resp.status
        conn.close()
    finally:
        os.killpg(gw.pid, signal.SIGTERM)
        gw.wait(15)
    return out


def main() -> None:
    global SCRATCH
    ap = argparse.ArgumentParser()
    ap.add_argument("--orders", type=int, default=20)
    ap.add_argument("--baseline-runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2000, help="through the gateway, to each of the two models")
    args = ap.parse_args()
    scratch = setup_django("tessera_bench_serving", "tessera-bench-serving-")
    scratch.chmod(0o711)
    SCRATCH = str(scratch)
    can_sandbox = os.geteuid() == 0 and subprocess.run(["/usr/bin/python3", "-c", "import numpy"],
                                                       capture_output=True, check=False).returncode == 0
    if not can_sandbox:
        sys.exit("the sandboxed servers need root and /usr/bin/python3 with numpy (make serving-deps)")
    from django.conf import settings

    settings.TESSERA_TRITON_BACKEND = "http"
    settings.TESSERA_SERVING_RUNTIME = "process"
    settings.TESSERA_TRITON_PYTHON = "/usr/bin/python3"
    settings.TESSERA_SERVING_RUNTIME_DIR = str(scratch / "runtime")

    from marketplace.models import Allocation, ServerPlatform, TritonServer
    from marketplace.services import deployments, fleet, orders, provisioning, serving
    from marketplace.services.catalog import sync_catalog
    from marketplace.services.nodes import sim_discovery
    from tenants.models import ApiKey, Tenant
    from tenants.roles import Role
    from tenants.scoping import principal_for_user
    from tests.factories import MembershipFactory, make_key
    from tests.fleet_fixtures import make_tier

    sync_catalog()
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    nodes = [fleet.register_node(f"bench-serving-{i}", platform, sim_discovery(f"bench-serving-{i}", platform))
             for i in range(max(1, -(-2 * args.orders // 56)))]  # 56 one-slice slots per 8-GPU node
    tier = make_tier("bench-1g", "h100-sxm-80gb", "1g.10gb")
    tenant = Tenant.objects.create(name="Bench", slug="bench", billing_email="b@bench.example",
                                   max_slices=1000, max_slices_per_tier=1000, max_memory_gb=100_000,
                                   max_concurrent_requests=100_000)
    owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)

    t0 = time.monotonic()
    serving.runtime()._install(serving.spec_for(  # stage tritonserver once, outside the timings
        TritonServer(node=nodes[0], allocation_id=0, address="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3),
        Allocation(pk=0, node=nodes[0], tier=tier, mig_uuid="MIG-x")))
    print(f"staged tritonserver in {time.monotonic() - t0:.1f} s")

    base_starts, base_loads = bare_baseline(args.baseline_runs)
    modes = {"sandboxed": True, "unsandboxed": False}
    ready_s: dict[str, list[float]] = {m: [] for m in modes}
    model_s: dict[str, list[float]] = {m: [] for m in modes}
    rss: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, Allocation] = {}
    allocations = []
    try:
        for i in range(args.orders):
            for mode, isolate in modes.items():
                settings.TESSERA_SERVING_ISOLATE = isolate
                t0 = time.monotonic()
                a = orders.create_order(owner, tenant=tenant, tier=tier).allocations.get()
                outcome = provisioning.provision(a.pk)
                ready_s[mode].append(time.monotonic() - t0)
                assert outcome == "activated", Allocation.objects.get(pk=a.pk).failure_reason
                a = Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model").get(pk=a.pk)
                allocations.append((a, isolate))
                assert TritonServer.objects.get(allocation=a).isolation == ("sandbox" if isolate else "none")
                t0 = time.monotonic()
                dep = deployments.deploy(owner, a, f"{mode}-{i}", template="tiny-gen")
                assert deployments.load(dep.pk) == "ready", deployments.ModelDeployment.objects.get(
                    pk=dep.pk).failure_reason
                model_s[mode].append(time.monotonic() - t0)
                first.setdefault(mode, a)
        time.sleep(2)  # idle
        for a, isolate in allocations:
            server = TritonServer.objects.get(allocation=a)
            settings.TESSERA_SERVING_ISOLATE = isolate
            if isolate:  # every process in its cgroup (bubblewrap gives the server a session of its own)
                pids = serving.runtime().sandbox.cgroups(server.name).pids()
                rss["sandboxed"].append(sum(pid_rss_mb(pid) for pid in pids))
            else:
                rss["unsandboxed"].append(session_rss_mb(server.pid))
        key, secret = make_key(tenant, ["inference"])
        ApiKey.objects.filter(pk=key.pk).update(requests_per_minute=2_000_000_000, tokens_per_minute=2_000_000_000)
        latency = gateway_latency(scratch, secret, {m: f"{m}-0" for m in modes}, args.requests)
    finally:
        for a, isolate in allocations:
            settings.TESSERA_SERVING_ISOLATE = isolate
            serving.stop_server(a, "benchmark done")
        shutil.rmtree(scratch, ignore_errors=True)

    def row(label, values, base=None, unit="s", scale=1.0):
        p50, p95 = statistics.median(values) * scale, pct(values, 0.95) * scale
        ratio = f"{p50 / (statistics.median(base) * scale):.2f}" if base else "—"
        print(f"| {label} | {p50:.2f} {unit} | {p95:.2f} {unit} | {ratio} |")

    print(f"\n{args.orders} orders of each kind on {len(nodes)} node(s), one tritonserver each (CPU, python backend)\n")
    print("| step | p50 | p95 | ratio (p50) |\n|---|---|---|---|")
    row("order -> ready server, sandboxed (ratio: to unsandboxed)", ready_s["sandboxed"], ready_s["unsandboxed"])
    row("order -> ready server, unsandboxed (ratio: to bare)", ready_s["unsandboxed"], base_starts)
    row("deploy -> ready model, sandboxed (ratio: to unsandboxed)", model_s["sandboxed"], model_s["unsandboxed"])
    row("deploy -> ready model, unsandboxed (ratio: to bare)", model_s["unsandboxed"], base_loads)
    row("bare tritonserver start -> ready (baseline)", base_starts)
    row("bare load -> ready (baseline)", base_loads)
    print(f"\nthrough the gateway, {args.requests} sequential generate requests to each (keep-alive, alternating):\n")
    print("| path | p50 | p95 | ratio (p50) |\n|---|---|---|---|")
    row("gateway -> sandboxed server", latency["sandboxed"], latency["unsandboxed"], "ms")
    row("gateway -> unsandboxed server", latency["unsandboxed"], None, "ms")
    d50 = statistics.median(latency["sandboxed"]) - statistics.median(latency["unsandboxed"])
    d95 = pct(latency["sandboxed"], 0.95) - pct(latency["unsandboxed"], 0.95)
    print(f"\nadded by the sandbox per request: p50 {d50:+.3f} ms, p95 {d95:+.3f} ms (goal < 0.2 ms)")
    for mode in modes:
        print(f"resident memory per idle {mode} server (the server, its python stub and, sandboxed, "
              f"bubblewrap's two processes): p50 {statistics.median(rss[mode]):.0f} MiB, max {max(rss[mode]):.0f} MiB")


if __name__ == "__main__":
    main()
