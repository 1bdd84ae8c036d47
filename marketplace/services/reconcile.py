"""Reconcile a node: what the database wants (GPU instances) against what the node's NVML has.

- a GPU instance on the GPU that no database instance explains is an orphan: destroyed;
- a database instance that was created but is gone from the GPU is re-created at its placement;
- an allocation stuck in placed/provisioning/releasing past the threshold is re-queued;
- an active slice whose Triton server is dead (killed, crashed, hung) gets it restarted;
- a Triton server running on the node for no live slice is stopped;
- a model Tessera marks ready that the slice's Triton server does not have loaded (the server
  restarted: explicit model control loads nothing by itself) is loaded again from its repository;
- a model loaded on a slice's server that Tessera did not deploy is unloaded.
Every finding is a DriftEvent the console shows; one that could not be repaired stays unresolved.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from pynvml import NVMLError

from marketplace import enqueue
from marketplace.models import Allocation, DriftEvent, GpuInstance, ModelDeployment, Node, TritonServer
from marketplace.services import deployments, nodes, serving

log = logging.getLogger("tessera.reconcile")
MAX_REQUEUES = 3


def fan_out() -> int:
    n = 0
    for node in Node.objects.filter(state__in=[Node.State.READY, Node.State.DRAINING]):
        enqueue.send(enqueue.RECONCILE_NODE, [node.pk], node.queue)
        n += 1
    return n


def reconcile_node(node_id: int) -> dict:
    node = Node.objects.select_related("platform__gpu_model").get(pk=node_id)
    found = {"orphans_destroyed": 0, "recreated": 0, "requeued": 0, "servers_restarted": 0, "servers_stopped": 0,
             "models_reloaded": 0, "models_unloaded": 0, "models_stopped": 0, "errors": 0}
    desired = {}
    for inst in (GpuInstance.objects.filter(gpu__node=node, placement__isnull=False)
                 .select_related("gpu", "placement__profile")):
        desired[(inst.gpu.index, inst.start)] = inst
    try:
        with nodes.nvml_client(node) as client:
            for gpu in node.gpus.filter(mig_mode=True).order_by("index"):
                try:
                    _reconcile_gpu(node, gpu, client, desired, found)
                except NVMLError as exc:
                    found["errors"] += 1
                    DriftEvent.objects.create(node=node, gpu_index=gpu.index, kind=DriftEvent.Kind.ERROR,
                                              detail=f"{exc.__class__.__name__}: {exc}", resolved=False)
    except NVMLError as exc:
        DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.UNREACHABLE, detail=str(exc), resolved=False)
        return {**found, "errors": found["errors"] + 1}
    found["requeued"] = _requeue_stuck(node)
    _reconcile_servers(node, found)
    _reconcile_models(node, found)
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now())
    if any(found.values()):
        log.info("reconciled with drift", extra={"node": node.hostname, **found})
    return found


def _reconcile_gpu(node, gpu, client, desired, found) -> None:
    actual = {s.start: s for s in client.slices(gpu.index)}
    for start, s in actual.items():
        inst = desired.get((gpu.index, start))
        if inst is not None and inst.placement.profile.profile_id == s.profile_id:
            continue
        client.destroy_slice(gpu.index, s.gi_id)
        found["orphans_destroyed"] += 1
        DriftEvent.objects.create(node=node, gpu_index=gpu.index, kind=DriftEvent.Kind.ORPHAN_DESTROYED,
                                  detail=f"GI {s.gi_id} (profile {s.profile_id}) at {s.start}:{s.size} had no "
                                         f"allocation; destroyed")
    for (index, start), inst in desired.items():
        if index != gpu.index or start in actual or inst.state != GpuInstance.State.CREATED:
            continue
        s = client.create_slice(gpu.index, inst.placement.profile.profile_id, inst.start)
        GpuInstance.objects.filter(pk=inst.pk).update(gi_id=s.gi_id, ci_id=s.ci_id, mig_uuid=s.mig_uuid)
        Allocation.objects.filter(instance=inst).update(mig_uuid=s.mig_uuid)
        found["recreated"] += 1
        alloc = Allocation.objects.filter(instance=inst).first()
        DriftEvent.objects.create(node=node, gpu_index=gpu.index, kind=DriftEvent.Kind.MISSING_RECREATED,
                                  allocation=alloc, detail=f"{inst} was missing on the GPU; re-created as GI "
                                                           f"{s.gi_id} ({s.mig_uuid})")


def _requeue_stuck(node: Node) -> int:
    from marketplace.services.orders import enqueue_provision, enqueue_release

    cutoff = timezone.now() - timedelta(seconds=settings.TESSERA_PROVISION_STUCK_AFTER_S)
    n = 0
    stuck = Allocation.objects.filter(node=node, updated_at__lt=cutoff,
                                      state__in=[Allocation.State.PLACED, Allocation.State.PROVISIONING,
                                                 Allocation.State.READY,
                                                 Allocation.State.RELEASING])
    for a in stuck.select_related("node"):
        tries = DriftEvent.objects.filter(kind=DriftEvent.Kind.STUCK_REQUEUED, allocation=a, at__gte=a.updated_at)
        if tries.count() >= MAX_REQUEUES:  # re-queueing did not help: an operator must look, not a loop
            if not tries.filter(resolved=False).exists():
                DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.STUCK_REQUEUED, allocation=a, resolved=False,
                                          detail=f"allocation {a.pk} is still {a.state} after {MAX_REQUEUES} "
                                                 f"re-queues; not re-queued again")
            continue
        (enqueue_release if a.state == Allocation.State.RELEASING else enqueue_provision)(a)
        DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.STUCK_REQUEUED, allocation=a,
                                  detail=f"allocation {a.pk} was {a.state} since {a.updated_at:%H:%M:%S}; re-queued")
        n += 1
    return n


def _reconcile_servers(node: Node, found: dict) -> None:
    active = (Allocation.objects.filter(node=node, state=Allocation.State.ACTIVE)
              .select_related("node", "tier__profile", "tier__gpu_model").order_by("pk"))
    servers = {s.allocation_id: s for s in TritonServer.objects.filter(allocation__in=active)}
    for a in active:
        server = servers.get(a.pk)
        try:
            if server is not None and serving.check(server, a):
                continue
            before = f"exit code {server.exit_code}" if server is not None and server.exit_code is not None else \
                "not answering" if server is not None else "never started"
            if server is None:
                serving.ensure_server(a)
            else:
                serving.restart(server, a)
        except serving.ServingError as exc:
            found["errors"] += 1
            DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.SERVER_RESTARTED, allocation=a, resolved=False,
                                      detail=f"the Triton server of allocation {a.pk} is down and could not be "
                                             f"restarted: {exc.detail}"[:1000])
            continue
        found["servers_restarted"] += 1
        DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.SERVER_RESTARTED, allocation=a,
                                  detail=f"the Triton server of allocation {a.pk} was down ({before}); restarted")
    for name in serving.stray_servers(node):
        serving.stop_stray(node, name)
        found["servers_stopped"] += 1
        DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.SERVER_STOPPED,
                                  detail=f"Triton server {name} was running for no live slice; stopped")


def _reconcile_models(node: Node, found: dict) -> None:
    """Per running server: unload what is loaded there that Tessera did not deploy (asking Triton what it has
    loaded, not only its repository index); stop a model that hit its sandbox's limits; load again what Tessera
    marks ready and the server lost, or whose processes died."""
    servers = (TritonServer.objects.filter(node=node, state=TritonServer.State.RUNNING,
                                           allocation__state=Allocation.State.ACTIVE)
               .select_related("allocation__node", "allocation__tier__profile", "allocation__tier__gpu_model")
               .order_by("allocation_id"))
    deps: dict[int, dict[str, ModelDeployment]] = {}
    for dep in ModelDeployment.objects.filter(
            allocation__node=node, allocation__state=Allocation.State.ACTIVE,
            state__in=[ModelDeployment.State.READY, ModelDeployment.State.LOADING]).order_by("pk"):
        deps.setdefault(dep.allocation_id, {})[dep.name] = dep
    for server in servers:
        a = server.allocation
        mine = deps.get(a.pk, {})
        folders = {f for dep in mine.values() for f in deployments.model_folders(dep)}
        try:
            with serving.client_for(a, server) as client:
                loaded = client.loaded_models()
                for name in sorted(loaded - folders):
                    client.unload_model(name)
                    found["models_unloaded"] += 1
                    DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.MODEL_UNLOADED, allocation=a,
                                              detail=f"model {name} was loaded on the Triton server of allocation "
                                                     f"{a.pk} but Tessera did not deploy it; unloaded"[:1000])
                dead = _enforce_limits(node, server, a, mine, client, found)
        except Exception as exc:  # one unreachable server must not stop the others
            found["errors"] += 1
            DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.ERROR, allocation=a,
                                      detail=f"the Triton server of allocation {a.pk} did not answer: "
                                             f"{exc.__class__.__name__}: {exc}"[:1000], resolved=False)
            continue
        for dep in mine.values():
            if dep.state != ModelDeployment.State.READY or (dep.name in loaded and dep.name not in dead):
                continue
            ModelDeployment.objects.filter(pk=dep.pk, state=ModelDeployment.State.READY).update(
                state=ModelDeployment.State.LOADING)
            try:
                outcome = deployments.load(dep.pk)
            except deployments.WaitingForServer:
                outcome = "waiting for the server"
            found["models_reloaded"] += 1
            why = ("its processes had died" if dep.name in dead else
                   "was not loaded on its Triton server (restarted?)")
            DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.MODEL_RELOADED, allocation=a,
                                      resolved=outcome == "ready",
                                      detail=f"model {dep.name} (deployment {dep.pk}) {why}; loaded again: "
                                             f"{outcome}"[:1000])


def _enforce_limits(node: Node, server: TritonServer, a: Allocation, mine: dict[str, ModelDeployment], client,
                    found: dict) -> set[str]:
    """Read the server's sandbox: a python model whose processes hit the slice's process limit (the most tasks)
    or were killed at its memory limit (none left) is stopped, unloaded and failed with the reason its tenant
    sees; another one whose processes are gone without a limit hit is returned, to be loaded again."""
    run = serving.runtime()
    spec = serving.spec_for(server, a)
    census = run.census(spec)
    if census is None:
        return set()
    python = {n: d for n, d in mine.items() if d.state == ModelDeployment.State.READY and d.backend == "python"}
    stubless = {n for n in python if not census.stubs.get(n)}
    limits = spec.limits
    stopped: dict[str, str] = {}
    if census.pid_limit_hits > server.pid_limit_hits and census.stubs:
        worst = max(census.stubs, key=lambda n: sum(census.stubs[n].values()))
        if worst in python:
            stopped[worst] = (f"stopped: it started more processes and threads than this slice allows "
                              f"({limits.pids if limits else '?'}); fix the model and retry it")
    if census.oom_kills > server.oom_kills:
        for name in sorted(stubless):
            stopped.setdefault(name, f"stopped: it used more memory than this slice allows "
                                     f"({limits.memory_mib if limits else '?':,} MiB of host memory, its /tmp and "
                                     f"/dev/shm included); fix the model or declare its memory, and retry it")
    TritonServer.objects.filter(pk=server.pk).update(oom_kills=census.oom_kills, pid_limit_hits=census.pid_limit_hits)
    for name, reason in stopped.items():
        dep = python[name]
        run.kill_model(spec, name)
        try:
            client.unload_model(name)
        except Exception as exc:  # killed processes: the unload may time out; the model is failed anyway
            log.warning("unload after a sandbox limit failed", extra={"deployment": dep.pk, "err": str(exc)})
        deployments.fail(dep, reason)
        found["models_stopped"] += 1
        DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.SANDBOX_LIMIT, allocation=a,
                                  detail=f"model {name} (deployment {dep.pk}) of allocation {a.pk}: {reason}"[:1000])
    if census.oom_kills > server.oom_kills and not stopped:
        DriftEvent.objects.create(node=node, kind=DriftEvent.Kind.SANDBOX_LIMIT, allocation=a, resolved=False,
                                  detail=f"the sandbox of allocation {a.pk} hit its memory limit "
                                         f"({census.oom_kills - server.oom_kills} process(es) killed) and no model "
                                         f"could be named for it"[:1000])
    return stubless - set(stopped)
