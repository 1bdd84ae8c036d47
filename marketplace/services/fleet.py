"""Writes for the fleet: register nodes from what NVML reports, place and release GPU instances.

Placement is serialized per GPU model: `place_instance` first locks the model's row (the placement
lock), then reads the candidate GPUs, asks the placement engine (marketplace.placement) for a GPU and
start, and reserves the slots with the GPU row locked. Concurrent orders therefore never plan on the
same free slots (each plans on what the previous placement committed) instead of all choosing the
same best GPU, queueing on its row and re-planning when they get it. The lock is held until the
caller's transaction ends, so a caller places last (orders.create_order): nothing but placement
and the commit runs under it. The per-slot unique constraint stays the last line: if another writer
got there first (an operator's dedication, a writer that does not take the lock) the insert fails,
nothing is kept, and the engine is asked again with fresh state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.core.exceptions import ValidationError
from django.core.validators import validate_ipv46_address
from django.db import IntegrityError, transaction
from django.utils import timezone

from marketplace import placement as engine
from marketplace.models import Gpu, GpuInstance, GpuModel, GpuSlot, MigPlacement, MigProfile, Node, ServerPlatform
from marketplace.selectors.catalog import gpu_states_of, ready_gpus
from tenants import audit
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.models import Tenant

log = logging.getLogger("tessera.fleet")

PLACEMENT_ATTEMPTS = 5


class NoCapacityError(Conflict):
    """No GPU can host the request now. The message is the tenant-safe summary; the engine's
    diagnostic (GPU ids, fleet size, GPUs dedicated to other tenants) is the operators' only."""


@dataclass(frozen=True)
class DiscoveredGpu:
    index: int
    uuid: str
    name: str
    mig_mode: bool
    numa_node: int | None = None  # None: topology not reported (group placement uses the platform's table)
    nvlink_domain: int | None = None


def discover(client) -> list[DiscoveredGpu]:
    """What a node's NVML reports (client: marketplace.hardware.nvml.NvmlClient, opened), with its topology
    when NVML answers the topology calls (marketplace.hardware.topology)."""
    from pynvml import NVMLError

    try:
        topo = client.topology()
    except NVMLError:
        topo = None
    out = []
    for g in client.gpus():
        t = topo.gpus[g.index] if topo is not None and g.index < len(topo.gpus) else None
        out.append(DiscoveredGpu(g.index, g.uuid, g.name, bool(g.mig_current),
                                 t.numa_node if t else None, t.nvlink_domain if t else None))
    return out


def normalize_hostname(hostname: str) -> str:
    """A node's name as registered (and as the simulator derives its GPUs' UUIDs from it)."""
    return hostname.strip().lower()


@transaction.atomic
def register_node(hostname: str, platform: ServerPlatform, gpus: list[DiscoveredGpu], principal=None) -> Node:
    """Create or update a node and its GPUs from discovery. GPU models are matched on the NVML
    name; a GPU that does not match the platform's model is refused (nothing stored). principal: the
    operator registering it from the console (an audit event; a node's own worker registers unaudited)."""
    hostname = normalize_hostname(hostname)
    if not hostname:
        raise ServiceError("may not be blank", field="hostname")
    models_by_name = {m.nvml_name: m for m in GpuModel.objects.all()}
    for g in gpus:
        model = models_by_name.get(g.name)
        if model is None:
            raise ServiceError(f"GPU {g.index} is a '{g.name}', which the catalog does not sell", field="gpus")
        if model.pk != platform.gpu_model_id:
            raise ServiceError(f"GPU {g.index} is a '{g.name}' but {platform.key} has {platform.gpu_model.name}",
                               field="gpus")
    if len(gpus) != platform.gpu_count:
        raise ServiceError(f"{platform.key} has {platform.gpu_count} GPUs; the node reports {len(gpus)}",
                           field="gpus")
    defaults = {"platform": platform, "queue": Node.queue_for(hostname)}
    if principal is None:  # the node's own worker: a heartbeat. An operator's registration is not one: the node
        defaults["last_heartbeat"] = timezone.now()  # takes no work until its worker is heard (working_nodes_q)
    with transaction.atomic():
        node, _ = Node.objects.update_or_create(hostname=hostname, defaults=defaults)
        for g in gpus:
            Gpu.objects.update_or_create(
                node=node, index=g.index,
                defaults={"uuid": g.uuid, "gpu_model": platform.gpu_model, "mig_mode": g.mig_mode,
                          "numa_node": g.numa_node, "nvlink_domain": g.nvlink_domain},
            )
        Gpu.objects.filter(node=node).exclude(index__in=[g.index for g in gpus]).delete()
        if principal is not None:
            audit.record(principal, "node.register", f"node:{hostname}", platform=platform.key, gpus=len(gpus))
    log.info("node registered", extra={"node": hostname, "gpus": len(gpus)})
    return node


def candidate_gpus(gpu_model: GpuModel, whole_gpu: bool):
    """GPUs that may take new work: healthy, on a ready node (``ready_gpus``, the catalog's availability reads
    the same), in the right MIG mode."""
    return ready_gpus().filter(gpu_model=gpu_model, mig_mode=not whole_gpu)


def place_instance(tenant: Tenant, gpu_model: GpuModel, profile: MigProfile | None, *, dedicated: bool = False,
                   policy: str = engine.BEST_FIT) -> GpuInstance:
    """Reserve slots for a new GPU instance (profile None: a whole GPU). Raises NoCapacityError.

    The instance's ``reason`` is the engine's diagnostic (operators only); ``summary``, set on the
    returned object and not stored on it, is the tenant-safe account the allocation records."""
    if profile is not None and profile.gpu_model_id != gpu_model.pk:
        raise ServiceError(f"{profile.name} is not a {gpu_model.name} profile", field="profile")
    request = engine.Request(
        geometry=gpu_model.key, tenant_id=tenant.pk,
        profile_id=profile.profile_id if profile else None, whole_gpu=profile is None, dedicated=dedicated,
    )
    last_reason = ""
    with transaction.atomic():
        placement_lock(gpu_model)
        for _attempt in range(PLACEMENT_ATTEMPTS):
            fleet = engine.Fleet(gpu_states_of(candidate_gpus(gpu_model, profile is None)), policy=policy)
            decision = fleet.choose(request)
            if isinstance(decision, engine.NoCapacity):
                raise NoCapacityError(decision.summary, field="profile", diagnostic=decision.reason)
            try:
                inst = _reserve(tenant, profile, decision)
            except (IntegrityError, _StaleState) as exc:  # another writer took it first: re-plan
                last_reason = str(exc)
                log.info("placement raced, re-planning", extra={"gpu": decision.gpu_id, "why": last_reason})
                continue
            inst.summary = decision.summary
            return inst
    raise NoCapacityError("capacity changed while placing this order; try again",
                          diagnostic=f"the fleet changed under {PLACEMENT_ATTEMPTS} attempts; try again "
                                     f"({last_reason})")


def placement_lock(gpu_model: GpuModel) -> None:
    """Take the placement lock of `gpu_model` (its row, FOR NO KEY UPDATE: rows that refer to the model are
    still written meanwhile) until the current transaction ends. Re-taking it in the same transaction is free.
    SQLite has no row locks: its transactions take the database's write lock when they begin
    (``transaction_mode=IMMEDIATE``), which serializes placements already."""
    GpuModel.objects.select_for_update(no_key=True).filter(pk=gpu_model.pk).values_list("pk", flat=True).first()


class _StaleState(Exception):
    pass


@transaction.atomic
def _reserve(tenant: Tenant, profile: MigProfile | None, d: engine.Decision) -> GpuInstance:
    gpu = Gpu.objects.select_for_update(of=("self",)).select_related("gpu_model").get(pk=d.gpu_id)
    # Re-check under the lock with what is committed now.
    current = [(i.placement.profile.profile_id if i.placement is not None else None, i.start)
               for i in GpuInstance.objects.filter(gpu=gpu).select_related("placement__profile")]
    pid = profile.profile_id if profile else None
    problems = engine.layout_problems(gpu.gpu_model.key, [*current, (pid, d.start)])
    if problems:
        raise _StaleState("; ".join(problems))
    if gpu.dedicated_tenant_id not in (None, tenant.pk):
        raise _StaleState("GPU was dedicated to another tenant meanwhile")
    placement = None
    if profile is not None:
        placement = MigPlacement.objects.get(profile=profile, start=d.start)
    with transaction.atomic():  # savepoint: a lost race leaves nothing behind
        inst = GpuInstance.objects.create(
            gpu=gpu, placement=placement, tenant=tenant, start=d.start, size=d.size,
            media_extensions=bool(profile and profile.media_extensions), reason=d.reason[:500],
        )
        GpuSlot.objects.bulk_create([GpuSlot(gpu=gpu, slot=s, instance=inst) for s in inst.slot_range])
    if d.newly_dedicated and gpu.dedicated_tenant_id is None:
        gpu.dedicated_tenant = tenant
        gpu.dedicated_sticky = False
        gpu.save(update_fields=["dedicated_tenant", "dedicated_sticky"])
    log.info("instance placed", extra={"gpu": gpu.pk, "start": d.start, "size": d.size, "tenant": tenant.slug})
    return inst


@transaction.atomic
def release_instance(instance: GpuInstance) -> None:
    """Free the instance's slots (the GPU-side destroy is the provisioning task's job)."""
    gpu = Gpu.objects.select_for_update().get(pk=instance.gpu_id)
    GpuInstance.objects.filter(pk=instance.pk).delete()  # slots cascade
    if gpu.dedicated_tenant_id and not gpu.dedicated_sticky and not gpu.instances.exists():
        gpu.dedicated_tenant = None
        gpu.save(update_fields=["dedicated_tenant"])


@transaction.atomic
def dedicate_gpu(gpu: Gpu, tenant: Tenant | None) -> Gpu:
    """An operator reserves a GPU for one tenant (sticky) or returns it to the shared pool."""
    gpu = Gpu.objects.select_for_update().get(pk=gpu.pk)
    if tenant is not None and gpu.instances.exclude(tenant=tenant).exists():
        raise Conflict("the GPU hosts other tenants' instances", field="dedicated_tenant")
    gpu.dedicated_tenant = tenant
    gpu.dedicated_sticky = tenant is not None
    gpu.save(update_fields=["dedicated_tenant", "dedicated_sticky"])
    return gpu


#: What an operator may change on a node (console's node page, PATCH /api/v1/fleet/nodes/{id}/).
NODE_EDITABLE = ("state", "serving_address", "serving_port_min", "serving_port_max")


def update_node(principal, node: Node, **fields) -> Node:
    """An operator changes a node: its state (draining or maintenance: no new work; its slices stay), or its
    serving address and port pool, which must hold the ports of the servers running there now. Audited with what
    changed; nothing is stored when a value is refused."""
    from marketplace.models import TritonServer

    if not principal.can("operate"):
        raise Forbidden("only operators change nodes")
    unknown = sorted(set(fields) - set(NODE_EDITABLE))
    if unknown:
        raise ServiceError(f"{', '.join(unknown)} cannot be changed", field=unknown[0])
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        before = {f: getattr(node, f) for f in fields}
        for f, v in fields.items():
            setattr(node, f, v)
        if node.state not in Node.State.values:
            raise ServiceError(f"is not one of {', '.join(Node.State.values)}", field="state")
        try:
            validate_ipv46_address(str(node.serving_address))
        except ValidationError:
            raise ServiceError("is not an IPv4 or IPv6 address", field="serving_address") from None
        lo, hi = node.serving_port_min, node.serving_port_max
        if not 1024 <= lo <= 65535:
            raise ServiceError("must be a port from 1024 to 65535", field="serving_port_min")
        if not 1024 <= hi <= 65535:
            raise ServiceError("must be a port from 1024 to 65535", field="serving_port_max")
        if hi < lo + 2:
            raise ServiceError("the pool needs at least 3 ports (a server's HTTP, gRPC and metrics ports)",
                               field="serving_port_max")
        used = [p for row in TritonServer.objects.filter(node=node).exclude(state=TritonServer.State.STOPPED)
                .values_list("http_port", "grpc_port", "metrics_port") for p in row if p is not None]
        outside = sorted(p for p in used if not lo <= p <= hi)
        if outside:
            raise ServiceError(f"servers running on this node use ports {', '.join(map(str, outside[:5]))} outside "
                               f"{lo}-{hi}; release them first or keep them in the pool", field="serving_port_min")
        node.save(update_fields=list(fields))
        changes = {f: str(getattr(node, f)) for f in fields if before[f] != getattr(node, f)}
        if changes:
            audit.record(principal, "node.update", f"node:{node.hostname}", **changes)
    return node
