"""Benchmark: N orders on REAL tritonserver processes started by the serving runtime (``process``), against a
bare tritonserver started and loaded directly (no Tessera) in the same run.

    .venv/bin/python tests/bench/serving.py [--orders 20]

For each order: order -> active (slice created, its server started as its own Unix user when root, answered
ready), then deploy -> ready model (tiny-gen, python backend). Then the resident memory of every idle server
(the tritonserver process plus its python backend stubs, which share its session). Prints p50/p95 and the
ratio of Tessera's order -> ready server to the bare server's start, and of deploy -> ready to a bare load.
Database: DATABASE_URL if set (a scratch database next to it for PostgreSQL), else a scratch SQLite file.
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


def main() -> None:
    global SCRATCH
    ap = argparse.ArgumentParser()
    ap.add_argument("--orders", type=int, default=20)
    ap.add_argument("--baseline-runs", type=int, default=5)
    args = ap.parse_args()
    scratch = setup_django("tessera_bench_serving", "tessera-bench-serving-")
    scratch.chmod(0o711)  # the per-slice users traverse it to their repositories
    SCRATCH = str(scratch)
    isolated = os.geteuid() == 0 and subprocess.run(["/usr/bin/python3", "-c", "import numpy"],
                                                    capture_output=True, check=False).returncode == 0
    from django.conf import settings

    settings.TESSERA_TRITON_BACKEND = "http"
    settings.TESSERA_SERVING_RUNTIME = "process"
    settings.TESSERA_SERVING_ISOLATE = isolated
    settings.TESSERA_TRITON_PYTHON = "/usr/bin/python3" if isolated else ""
    settings.TESSERA_SERVING_RUNTIME_DIR = str(scratch / "runtime")

    from marketplace.models import Allocation, ServerPlatform, TritonServer
    from marketplace.services import deployments, fleet, orders, provisioning, serving
    from marketplace.services.catalog import sync_catalog
    from marketplace.services.nodes import sim_discovery
    from tenants.models import Tenant
    from tenants.roles import Role
    from tenants.scoping import principal_for_user
    from tests.factories import MembershipFactory
    from tests.fleet_fixtures import make_tier

    sync_catalog()
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    node = fleet.register_node("bench-serving", platform, sim_discovery("bench-serving", platform))
    tier = make_tier("bench-1g", "h100-sxm-80gb", "1g.10gb")
    tenant = Tenant.objects.create(name="Bench", slug="bench", billing_email="b@bench.example",
                                   max_slices=1000, max_slices_per_tier=1000, max_memory_gb=100_000)
    owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)

    t0 = time.monotonic()
    serving.runtime()._install(serving.spec_for(  # stage tritonserver once, outside the timings
        TritonServer(node=node, allocation_id=0, address="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3),
        Allocation(pk=0, node=node, tier=tier, mig_uuid="MIG-x")))
    print(f"staged tritonserver for per-slice users in {time.monotonic() - t0:.1f} s "
          f"(isolation: {'own Unix user' if isolated else 'none'})")

    base_starts, base_loads = bare_baseline(args.baseline_runs)
    ready_s, model_s, allocations = [], [], []
    try:
        for _ in range(args.orders):
            t0 = time.monotonic()
            a = orders.create_order(owner, tenant=tenant, tier=tier).allocations.get()
            outcome = provisioning.provision(a.pk)
            ready_s.append(time.monotonic() - t0)
            assert outcome == "activated", Allocation.objects.get(pk=a.pk).failure_reason
            a = Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model").get(pk=a.pk)
            allocations.append(a)
            t0 = time.monotonic()
            dep = deployments.deploy(owner, a, "tiny-gen", template="tiny-gen")
            assert deployments.load(dep.pk) == "ready"
            model_s.append(time.monotonic() - t0)
        time.sleep(2)  # idle
        rss = [session_rss_mb(s.pid) for s in TritonServer.objects.filter(state=TritonServer.State.RUNNING)]
    finally:
        for a in allocations:
            serving.stop_server(a, "benchmark done")
        shutil.rmtree(scratch, ignore_errors=True)

    def row(label, values, base=None):
        p50, p95 = statistics.median(values), pct(values, 0.95)
        ratio = f"{p50 / statistics.median(base):.2f}" if base else "—"
        print(f"| {label} | {p50:.2f} s | {p95:.2f} s | {ratio} |")

    print(f"\n{args.orders} orders on node {node.hostname}, one tritonserver each (CPU, python backend)\n")
    print("| step | p50 | p95 | ratio to bare (p50) |\n|---|---|---|---|")
    row("order -> ready server (active)", ready_s, base_starts)
    row("deploy -> ready model", model_s, base_loads)
    row("bare tritonserver start -> ready (baseline)", base_starts)
    row("bare load -> ready (baseline)", base_loads)
    print(f"\nresident memory per idle server (tritonserver + its python stub, one model): "
          f"p50 {statistics.median(rss):.0f} MiB, max {max(rss):.0f} MiB, {len(rss)} servers, "
          f"{sum(rss):.0f} MiB in all")


if __name__ == "__main__":
    main()
