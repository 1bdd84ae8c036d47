"""What a node worker does for an allocation: create the slice on the GPU, start its Triton server, and
only when that server answers ready mark the slice ready and active (the billing clock starts); on release
unload the models, stop the server, remove the repository, destroy the GPU instance and return the slots.
Every step is idempotent: running it twice (a replayed task, a worker killed half-way and restarted) leaves
one GPU instance, one server and the same state; a step whose object is already gone is done.
"""

from __future__ import annotations

import logging

from django.db import transaction
from pynvml import NVMLError, NVMLError_InsufficientResources, NVMLError_InUse

from marketplace.models import Allocation, GpuInstance, Node
from marketplace.services import allocations, deployments, fleet, nodes, serving

log = logging.getLogger("tessera.provisioning")
ACTOR = "task:provision"


class TransientProvisioningError(Exception):
    """Worth retrying with backoff (the GPU is busy, an orphan holds the placement...)."""


def _load(allocation_id: int) -> Allocation:
    return Allocation.objects.select_related(
        "node__platform__gpu_model", "instance__gpu", "instance__placement__profile", "tier"
    ).get(pk=allocation_id)


def provision(allocation_id: int, *, final_attempt: bool = False) -> str:
    a = _load(allocation_id)
    if a.state in (Allocation.State.READY, Allocation.State.ACTIVE, Allocation.State.RELEASING,
                   Allocation.State.RELEASED):
        if a.state == Allocation.State.READY:
            allocations.activate(a, ACTOR)
            return "activated"
        return f"nothing to do ({a.state})"
    if a.state == Allocation.State.REQUESTED:
        return "not placed yet"
    inst, node = a.instance, a.node  # as _load read them: a transition re-reads the row and drops them
    if a.state in (Allocation.State.PLACED, Allocation.State.FAILED):
        if inst is None:
            return "no reservation (failed before placement)"
        allocations.begin_provisioning(a, ACTOR)
    if inst is None:  # never: a placed slice keeps its reservation until it is released
        raise ValueError(f"allocation {a.pk} has no reserved GPU instance to provision")
    try:
        mig_uuid = _create_on_gpu(a, inst, node)
    except (NVMLError_InsufficientResources, NVMLError_InUse) as exc:
        if final_attempt:
            _fail_and_return_slots(a, f"GPU refused the slice: {exc.__class__.__name__}")
            return "failed"
        raise TransientProvisioningError(f"{exc.__class__.__name__} creating {inst}") from exc
    except NVMLError as exc:
        _fail_and_return_slots(a, f"NVML error: {exc.__class__.__name__}: {exc}")
        return "failed"
    Allocation.objects.filter(pk=a.pk).update(mig_uuid=mig_uuid)  # the device its server is pinned to
    a = _load(a.pk)
    try:
        server = serving.ensure_server(a)
    except serving.ServingError as exc:
        _fail_and_clean(a, exc.reason, exc.detail)
        return "failed"
    a = allocations.mark_ready(a, ACTOR, mig_uuid, "slice created; its Triton server answers ready",
                               detail=f"{server.name} on {server.address}:{server.http_port} (isolation: "
                                      f"{server.isolation})")
    allocations.activate(a, ACTOR)  # mark_ready left `a` as it committed it (the transition re-reads it locked)
    return "activated"


def _create_on_gpu(a: Allocation, inst: GpuInstance, node: Node | None = None) -> str:
    gpu = inst.gpu
    placement = inst.placement
    if placement is None:  # a whole GPU (or a group's GPUs): MIG is off, nothing to carve
        GpuInstance.objects.filter(pk=inst.pk).update(state=GpuInstance.State.CREATED, mig_uuid=gpu.uuid)
        for member, uuid in GpuInstance.objects.filter(group_lead=inst).values_list("pk", "gpu__uuid"):
            GpuInstance.objects.filter(pk=member).update(state=GpuInstance.State.CREATED, mig_uuid=uuid)
        return gpu.uuid
    with nodes.nvml_client(node or _node(a)) as client:
        # create_slice adopts a GPU instance already at this placement with this profile, so a
        # replayed or restarted task finds what the first run made instead of making another.
        s = client.create_slice(gpu.index, placement.profile.profile_id, inst.start)
    if s.mig_uuid is None:  # create_slice makes the compute instance too, so NVML names the device
        raise TransientProvisioningError(f"NVML reported no MIG device for {inst}")
    GpuInstance.objects.filter(pk=inst.pk).update(
        state=GpuInstance.State.CREATED, gi_id=s.gi_id, ci_id=s.ci_id, mig_uuid=s.mig_uuid)
    return s.mig_uuid


def _node(a: Allocation) -> Node:
    node = a.node
    if node is None:  # never: a placed slice keeps its node until it is released
        raise ValueError(f"allocation {a.pk} has no node")
    return node


def _fail_and_return_slots(a: Allocation, reason: str) -> None:
    """Nothing was created on the GPU: give the slots back so the capacity is not lost."""
    with transaction.atomic():
        a = _load(a.pk)
        inst = a.instance
        allocations.fail(a, ACTOR, reason)
        if inst is not None and inst.state == GpuInstance.State.RESERVED:
            fleet.release_instance(inst)
    log.warning("provisioning failed", extra={"allocation": a.pk, "reason": reason})


def _fail_and_clean(a: Allocation, reason: str, detail: str) -> None:
    """The slice's server did not come up: leave nothing half-made (server, files, GPU instance, slots)."""
    serving.stop_server(a, f"provisioning failed: {detail}"[:1000])
    serving.remove_files(a.pk)
    _destroy_on_gpu(a)
    with transaction.atomic():
        a = _load(a.pk)
        allocations.fail(a, ACTOR, reason, detail=detail[:1000])
        if a.instance is not None:
            fleet.release_instance(a.instance)
    log.warning("provisioning failed: the slice's server did not start",
                extra={"allocation": a.pk, "detail": detail[:500]})


def _destroy_on_gpu(a: Allocation) -> None:
    inst = a.instance
    if inst is None or inst.placement is None:
        return
    profile_id = inst.placement.profile.profile_id
    with nodes.nvml_client(_node(a)) as client:
        for s in client.slices(inst.gpu.index):
            if s.start == inst.start and s.profile_id == profile_id:
                client.destroy_slice(inst.gpu.index, s.gi_id)  # NotFound: already gone


def release_allocation(allocation_id: int) -> str:
    """The node's side of a release (task `tessera.release_allocation`, queued by orders.request_release)."""
    a = _load(allocation_id)
    if a.state == Allocation.State.RELEASED:
        return "already released"
    if a.state != Allocation.State.RELEASING:
        return f"not releasing ({a.state})"
    deployments.unload_all(a)  # Triton lets go of the slice before NVML destroys it (a gone server: skipped)
    serving.stop_server(a)
    serving.remove_files(a.pk)
    inst = a.instance
    if inst is not None:
        _destroy_on_gpu(a)
        fleet.release_instance(inst)
    allocations.mark_released(_load(a.pk), "task:release", "server stopped, slice destroyed, slots returned")
    return "released"
