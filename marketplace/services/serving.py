"""The node worker's side of serving: start, stop, health-check and clean up the Triton server of each slice.

A slice's server is recorded in ``TritonServer`` (ports from the node's pool, the Unix user, pid, health,
restarts, log tail). The repository-API secret is never stored: it is derived from ``SECRET_KEY`` and a
nonce that changes at every start, so only Tessera's workers can load or unload a model on the server.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import shutil
import threading
import time
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.crypto import salted_hmac

from marketplace.hardware import runtime as rt
from marketplace.hardware import sandbox as sb
from marketplace.hardware import triton
from marketplace.hardware.topology import platform_topology
from marketplace.models import Allocation, DriftEvent, Gpu, GpuInstance, ModelDeployment, Node, TritonServer
from marketplace.selectors.catalog import modelled_tokens_per_s

log = logging.getLogger("tessera.serving")
LOG_TAIL_CHARS = 4000
READY_POLL_S = 0.02  # a server answers ready ~0.1 s after its start here: a coarser poll adds most of a tick
_runtimes: dict[tuple, rt.ServingRuntime] = {}
_runtimes_lock = threading.Lock()


class ServingError(Exception):
    """The slice's server could not be started; ``reason`` is tenant-safe, ``detail`` for operators."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail or reason


class ServerNotUp(Exception):
    """The slice has no running Triton server (yet, or any more)."""


# --- where things live -------------------------------------------------------------------------

def repo_root() -> Path:
    return Path(settings.TESSERA_TRITON_REPO_ROOT)


def repo_dir(allocation_id: int) -> Path:
    return repo_root() / f"allocation-{allocation_id}"


def work_root() -> Path:
    return repo_root() / ".servers"


def work_dir(allocation_id: int) -> Path:
    return work_root() / f"allocation-{allocation_id}"


def runtime_kind() -> str:
    return "sim" if settings.TESSERA_TRITON_BACKEND == "sim" else settings.TESSERA_SERVING_RUNTIME


def runtime() -> rt.ServingRuntime:
    """The node's serving runtime (one per process and configuration: it remembers its children)."""
    kind = runtime_kind()
    runtime_dir = Path(settings.TESSERA_SERVING_RUNTIME_DIR or repo_root() / ".runtime")
    key = (kind, settings.TESSERA_TRITONSERVER, settings.TESSERA_TRITON_PYTHON, str(runtime_dir),
           settings.TESSERA_TRITON_IMAGE, str(settings.TESSERA_MODEL_STORE_ROOT), settings.TESSERA_INSTALLATION_ID,
           settings.TESSERA_SANDBOX_SUBNET, settings.TESSERA_SANDBOX_CGROUP, str(repo_root()))
    with _runtimes_lock:
        found = _runtimes.get(key)
        if found is None:
            if kind == "process":
                box = sb.Sandbox(installation=settings.TESSERA_INSTALLATION_ID, subnet=settings.TESSERA_SANDBOX_SUBNET,
                                 cgroup_parent=settings.TESSERA_SANDBOX_CGROUP, state_dir=work_root())
                found = rt.ProcessRuntime(binary=settings.TESSERA_TRITONSERVER, python=settings.TESSERA_TRITON_PYTHON,
                                          runtime_dir=runtime_dir, sandbox=box)
            elif kind == "docker":
                found = rt.DockerRuntime(settings.TESSERA_TRITON_IMAGE, model_store=settings.TESSERA_MODEL_STORE_ROOT,
                                         sandbox=sb.Sandbox(installation=settings.TESSERA_INSTALLATION_ID,
                                                            state_dir=work_root()))
            elif kind == "sim":
                found = rt.SimRuntime()
            else:
                raise ValueError(f"TESSERA_SERVING_RUNTIME must be one of {', '.join(rt.RUNTIME_KINDS)}, not {kind!r}")
            _runtimes[key] = found
        return found


def reset_runtimes() -> None:
    """Forget the runtimes (tests)."""
    with _runtimes_lock:
        _runtimes.clear()


def secret_for(server: TritonServer) -> str:
    return salted_hmac("tessera.serving.repository-key", f"{server.pk}:{server.nonce}",
                       algorithm="sha256").hexdigest()


def admin_headers(server: TritonServer) -> dict[str, str]:
    return {rt.SECRET_HEADER: secret_for(server)}


def slice_memory_mb(allocation: Allocation) -> int:
    """One device's memory (a multi-GPU tier: one GPU's; each tensor-parallel rank sizes its own share)."""
    return allocation.tier.gpu_memory_mib


def sandbox_limits(allocation: Allocation) -> sb.Limits:
    """What the slice's sandbox may use of the node: the tier's host memory, the node's process cap, a CPU
    weight of 100 per compute slice (a whole GPU: 8)."""
    tier = allocation.tier
    profile = tier.profile if tier.profile_id else None
    cpus: tuple[int, ...] = ()
    if tier.gpu_count > 1:  # a GPU group's server runs on the CPUs of its GPUs' NUMA node(s)
        node = _placed_node(allocation)
        p = node.platform
        topo = platform_topology(p.key, p.gpu_count, p.interconnect)
        cpus = topo.numa_cpus([g.index for g in group_gpus(allocation)])
    return sb.Limits(memory_mib=tier.host_memory_allowance_mib, pids=settings.TESSERA_SANDBOX_PIDS,
                     cpu_weight=min(10000, 100 * (profile.compute_slices if profile else 8 * tier.gpu_count)),
                     file_size_mib=settings.TESSERA_SANDBOX_FILE_MIB, tmpfs_mib=settings.TESSERA_SANDBOX_TMPFS_MIB,
                     cpus=cpus)


def group_gpus(allocation: Allocation) -> list[Gpu]:
    """The GPUs an allocation serves on, in index order: its GPU, and a group's other GPUs."""
    inst = allocation.instance
    if inst is None:
        return []
    ids = [inst.gpu_id, *GpuInstance.objects.filter(group_lead=inst).values_list("gpu_id", flat=True)]
    return list(Gpu.objects.filter(pk__in=ids).order_by("index"))


def device_uuid_of(allocation: Allocation) -> str:
    """What CUDA_VISIBLE_DEVICES lists for the allocation's server: the MIG device, the GPU, or a group's GPUs
    (comma-separated, in index order: rank i of tensor parallelism on the i-th)."""
    if allocation.tier.gpu_count > 1:
        return ",".join(g.uuid for g in group_gpus(allocation))
    return allocation.mig_uuid or allocation.gpu_uuid


def _placed_node(allocation: Allocation) -> Node:
    """The slice's node: a served allocation is placed, and its node is never cleared."""
    node = allocation.node
    if node is None:
        raise ValueError(f"allocation {allocation.pk} is not placed on a node")
    return node


def spec_for(server: TritonServer, allocation: Allocation) -> rt.ServerSpec:
    tier = allocation.tier
    profile = tier.profile if tier.profile_id else None
    node = _placed_node(allocation)
    return rt.ServerSpec(
        name=server.name, repo_dir=repo_dir(allocation.pk), work_dir=work_dir(allocation.pk),
        device_uuid=device_uuid_of(allocation), address=node.serving_address,
        reach=server.address if server.address != node.serving_address else "",
        http_port=server.http_port or 1, grpc_port=server.grpc_port or 2, metrics_port=server.metrics_port or 3,
        secret=secret_for(server), isolate=settings.TESSERA_SERVING_ISOLATE,
        gpu_metrics=settings.TESSERA_NVML_BACKEND == "pynvml",
        labels={rt.NODE_LABEL: node.hostname, "tessera.allocation": str(allocation.pk)},
        memory_mb=slice_memory_mb(allocation), tokens_per_s=modelled_tokens_per_s(tier.gpu_model, profile),
        installation=settings.TESSERA_INSTALLATION_ID, limits=sandbox_limits(allocation),
        binds=(str(settings.TESSERA_MODEL_STORE_ROOT),))


def _device_nodes(allocation: Allocation) -> tuple[str, ...]:
    """The GPU's device nodes for the slice's sandbox (the GPU, and a MIG slice's two capabilities)."""
    from marketplace.hardware.nvml import NvmlClient

    inst = allocation.instance
    if inst is None or settings.TESSERA_NVML_BACKEND != "pynvml":  # simulated GPUs have no device nodes
        return ()
    with NvmlClient() as client:
        if allocation.tier.gpu_count > 1:  # every GPU of the group (whole GPUs: no MIG capabilities)
            gpus = group_gpus(allocation)
            return tuple(dict.fromkeys(d for g in gpus for d in client.device_nodes(g.index, None, None)))
        return tuple(client.device_nodes(inst.gpu.index, inst.gi_id, inst.ci_id))


def client_for(allocation: Allocation, server: TritonServer | None = None) -> triton.TritonBackend:
    """A Triton client for the slice's running server, holding its secret; ServerNotUp if none runs."""
    if runtime_kind() == "sim":
        return _client(allocation, None)
    server = server or TritonServer.objects.filter(allocation=allocation).first()
    if server is None or server.state != TritonServer.State.RUNNING or not server.http_port:
        raise ServerNotUp(f"allocation {allocation.pk} has no running Triton server")
    return _client(allocation, server)


def _client(allocation: Allocation, server: TritonServer | None) -> triton.TritonBackend:
    """A client for the server whatever its recorded state (while it starts, for health checks)."""
    if runtime_kind() == "sim":
        tier = allocation.tier
        return triton.get_triton_backend(
            "sim", repo_dir=repo_dir(allocation.pk), memory_mb=slice_memory_mb(allocation),
            tokens_per_s=modelled_tokens_per_s(tier.gpu_model, tier.profile if tier.profile_id else None))
    assert server is not None
    spec = spec_for(server, allocation)
    return triton.get_triton_backend("http", url=spec.http_url, metrics_url=spec.metrics_url,
                                     headers=admin_headers(server))


def _answers_ready(allocation: Allocation, server: TritonServer) -> bool:
    with _client(allocation, server) as client:
        return client.is_server_ready()


def _update(server: TritonServer, **fields) -> None:
    fields["updated_at"] = timezone.now()
    TritonServer.objects.filter(pk=server.pk).update(**fields)
    for k, v in fields.items():
        setattr(server, k, v)


# --- ports ---------------------------------------------------------------------------------------

def _reserve_ports(server: TritonServer, *, check_os: bool) -> None:
    """Three consecutive free ports from the node's pool, recorded on the server (unique per node)."""
    for _ in range(3):  # a concurrent reservation on the same node: try again with what it left
        with transaction.atomic():
            node = Node.objects.select_for_update().get(pk=server.node_id)
            taken: set[int] = set()
            for row in (TritonServer.objects.filter(node=node).exclude(pk=server.pk)
                        .exclude(http_port__isnull=True).values_list("http_port", "grpc_port", "metrics_port")):
                taken.update(p for p in row if p)
            for base in range(node.serving_port_min, node.serving_port_max - 1, 3):
                ports = (base, base + 1, base + 2)
                if taken.intersection(ports):
                    continue
                if check_os and rt._ports_in_use(node.serving_address, ports):
                    continue  # something else on the host holds it
                try:
                    with transaction.atomic():
                        _update(server, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                                address=node.serving_address)
                except IntegrityError:
                    break
                return
            else:
                size = (node.serving_port_max - node.serving_port_min + 1) // 3
                raise ServingError("the node has no free port for the slice's inference server",
                                   f"no free ports in {node.hostname}'s serving pool {node.serving_port_min}-"
                                   f"{node.serving_port_max} ({size} servers fit; {len(taken) // 3} hold ports)")
    raise ServingError("the node has no free port for the slice's inference server",
                       "port reservation kept colliding with concurrent reservations")


# --- start / wait / stop ----------------------------------------------------------------------------

def ensure_server(allocation: Allocation, *, timeout: float | None = None) -> TritonServer:
    """Start the slice's server unless it runs, and wait until it answers ``/v2/health/ready``.

    Idempotent (a replayed task finds the running server). Raises ServingError with the reason (the log tail
    for operators) when the binary is missing, the pool is exhausted, the user cannot be created, or the
    server exits or stays unready past ``TESSERA_SERVING_START_TIMEOUT_S``.
    """
    node = _placed_node(allocation)
    run = runtime()
    server, _ = TritonServer.objects.get_or_create(
        allocation=allocation, defaults={"node": node, "runtime": run.kind, "address": node.serving_address})
    if server.node_id != node.pk:  # re-placed on another node after a failure
        _update(server, node=node, http_port=None, grpc_port=None, metrics_port=None, address=node.serving_address)
    if server.http_port is None:
        listens = run.kind == "process" or (run.kind == "sim" and settings.TESSERA_SIM_TRITON_HTTP)
        _reserve_ports(server, check_os=listens)
    spec = spec_for(server, allocation)
    status = run.status(spec)
    if status.running and status.address and status.address != server.address:  # found by a restarted worker
        _update(server, address=status.address)
        spec = spec_for(server, allocation)
    if status.running and _answers_ready(allocation, server):
        _mark_running(server, allocation, run, spec, status)
        return server
    if not status.running:  # (one that runs but is not ready yet, a replayed task's: wait for it below)
        _update(server, nonce=secrets.token_hex(16), state=TritonServer.State.STARTING, reason="", exit_code=None,
                started_at=timezone.now(), runtime=run.kind, oom_kills=0, pid_limit_hits=0)
        spec = spec_for(server, allocation)
        try:
            if run.isolation(spec) == "sandbox":
                spec = dataclasses.replace(spec, devices=_device_nodes(allocation))
            status = run.start(spec)
        except (rt.RuntimeFault, OSError) as exc:
            _fail(server, f"could not start: {exc}", run.logs(spec))
            raise ServingError("the slice's inference server could not be started", str(exc)) from None
        _update(server, pid=status.pid, container_id=status.container_id, isolation=run.isolation(spec),
                unix_user=spec.unix_user if run.isolation(spec) == "sandbox" else "",
                address=status.address or spec.address)
        spec = spec_for(server, allocation)
    return _wait_ready(server, allocation, run, spec, timeout)


def _wait_ready(server, allocation, run, spec, timeout) -> TritonServer:
    timeout = settings.TESSERA_SERVING_START_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    with _client(allocation, server) as client:
        while True:
            status = run.status(spec)
            if not status.running:
                tail = run.logs(spec)
                why = f"exited with code {status.exit_code} before it was ready"
                _fail(server, why, tail, exit_code=status.exit_code)
                raise ServingError("the slice's inference server exited at start", f"{why}; log tail:\n{tail}")
            if client.is_server_ready():
                _mark_running(server, allocation, run, spec, status)
                return server
            if time.monotonic() > deadline:
                run.stop(spec)
                tail = run.logs(spec)
                why = f"not ready within {timeout:.0f} s; stopped"
                _fail(server, why, tail)
                raise ServingError("the slice's inference server did not become ready", f"{why}; log tail:\n{tail}")
            time.sleep(READY_POLL_S)


def _mark_running(server, allocation, run, spec, status) -> None:
    now = timezone.now()
    _update(server, state=TritonServer.State.RUNNING, ready_at=server.ready_at or now, last_health_at=now,
            last_health_ok=True,
            pid=status.pid or server.pid, container_id=status.container_id or server.container_id,
            log_tail=run.logs(spec, LOG_TAIL_CHARS), reason="")
    Allocation.objects.filter(pk=allocation.pk).update(triton_url=spec.http_url, triton_metrics_url=spec.metrics_url)
    allocation.triton_url, allocation.triton_metrics_url = spec.http_url, spec.metrics_url


def _fail(server: TritonServer, reason: str, tail: str, exit_code: int | None = None) -> None:
    _update(server, state=TritonServer.State.FAILED, reason=reason[:1000], log_tail=tail[-LOG_TAIL_CHARS:],
            exit_code=exit_code,
            last_health_at=timezone.now(), last_health_ok=False)
    log.warning("triton server failed", extra={"server": server.name, "reason": reason})


def stop_server(allocation: Allocation, reason: str = "slice released") -> bool:
    """Stop the slice's server and give its ports back; a server that never started or is gone is a no-op.
    Returns whether there was a server record."""
    server = TritonServer.objects.filter(allocation=allocation).first()
    if server is None:
        return False
    run = runtime()
    spec = spec_for(server, allocation)
    code = run.stop(spec)
    tail = run.logs(spec)
    try:
        run.cleanup(spec)
    except rt.RuntimeFault as exc:  # the release goes on; an operator must remove what is left
        log.error("server cleanup failed", extra={"server": server.name, "err": str(exc)})
        DriftEvent.objects.create(node_id=server.node_id, kind=DriftEvent.Kind.ERROR, allocation=allocation,
                                  resolved=False, detail=f"the Triton server of allocation {allocation.pk} stopped, "
                                                         f"but {exc}"[:1000])
    _update(server, state=TritonServer.State.STOPPED, stopped_at=timezone.now(), http_port=None, grpc_port=None,
            metrics_port=None,
            pid=None, exit_code=code, reason=reason[:1000], log_tail=tail[-LOG_TAIL_CHARS:] or server.log_tail)
    Allocation.objects.filter(pk=allocation.pk).update(triton_url="", triton_metrics_url="")
    return True


def own_repository(allocation: Allocation) -> None:
    """After Tessera wrote model files: hand the repository to the server's own user (mode 0700)."""
    server = TritonServer.objects.filter(allocation=allocation).first()
    if server is not None and server.state == TritonServer.State.RUNNING:
        runtime().hand_over(spec_for(server, allocation))


def remove_files(allocation_id: int) -> None:
    """The slice's repository and the server's work folder (idempotent)."""
    for folder in (repo_dir(allocation_id), work_dir(allocation_id)):
        shutil.rmtree(folder, ignore_errors=True)


# --- supervision (reconcile) ----------------------------------------------------------------------

def check(server: TritonServer, allocation: Allocation) -> bool:
    """Is it running and ready? Records the health check and the log tail."""
    run = runtime()
    spec = spec_for(server, allocation)
    run.trim_log(spec)
    status = run.status(spec)
    ok = status.running and _answers_ready(allocation, server)
    fields = {"last_health_at": timezone.now(), "last_health_ok": ok, "log_tail": run.logs(spec)[-LOG_TAIL_CHARS:]}
    if not status.running:
        fields.update(exit_code=status.exit_code, pid=None)
    _update(server, **fields)
    return ok


def restart(server: TritonServer, allocation: Allocation) -> TritonServer:
    """Start a dead or hung server again (same ports, a new secret); raises ServingError. A server that still
    runs is scraped first: its statistics die with it."""
    run = runtime()
    spec = spec_for(server, allocation)
    if run.status(spec).running:
        scrape_served(allocation, server)
    run.stop(spec)  # a hung one, or its orphaned python stubs
    TritonServer.objects.filter(pk=server.pk).update(restarts=server.restarts + 1)
    server.refresh_from_db()
    return ensure_server(allocation)


def scrape_served(allocation: Allocation, server: TritonServer) -> int:
    """Count what each of the slice's ready models served since the last scrape (before the server is stopped
    or restarted: its counters go with it). Returns how many models were read; one that does not answer is
    logged and skipped."""
    from telemetry.services import scrape  # telemetry builds on the marketplace

    read = 0
    deps = ModelDeployment.objects.filter(allocation=allocation, state=ModelDeployment.State.READY).order_by("pk")
    try:
        with _client(allocation, server) as client:
            for dep in deps:
                try:
                    scrape.record_counters(dep, scrape.reader(client, dep.name))
                    read += 1
                except Exception as exc:  # one model's statistics must not stop the others
                    log.warning("scrape before restart failed", extra={"deployment": dep.pk, "err": str(exc)})
    except Exception as exc:  # the server does not answer at all
        log.warning("scrape before restart failed", extra={"server": server.name, "err": str(exc)})
    return read


def stray_servers(node: Node) -> list[str]:
    """Servers the runtime has running on this node that no live slice owns."""
    names = runtime().running(work_root(), node.hostname)
    live = {f"allocation-{pk}" for pk in Allocation.objects.filter(
        node=node, state__in=[Allocation.State.PROVISIONING, Allocation.State.READY, Allocation.State.ACTIVE,
                              Allocation.State.RELEASING]).values_list("pk", flat=True)}
    return [n for n in names if n not in live]


def stop_stray(node: Node, name: str) -> None:
    """Stop a server found running for no live slice (its allocation was released or never existed here)."""
    allocation_id = int(name.removeprefix("allocation-"))
    allocation = Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model").filter(
        pk=allocation_id).first()
    if allocation is not None and TritonServer.objects.filter(allocation=allocation).exists():
        stop_server(allocation, "stopped by reconcile: no live slice")
        return
    # no record of it: stop it by name (the ports and secret do not matter to stop)
    spec = rt.ServerSpec(name=name, repo_dir=repo_dir(allocation_id), work_dir=work_dir(allocation_id),
                         device_uuid="", address=node.serving_address, http_port=1, grpc_port=2, metrics_port=3,
                         secret="", isolate=settings.TESSERA_SERVING_ISOLATE, labels={rt.NODE_LABEL: node.hostname},
                         installation=settings.TESSERA_INSTALLATION_ID)
    runtime().stop(spec)
    runtime().cleanup(spec)
