"""Writes for multi-GPU tiers: reserve a group of whole GPUs (2, 4 or 8 of one model on one node).

Same discipline as ``fleet.place_instance`` (whose placement lock it takes): under the GPU model's lock,
read the candidate GPUs, ask the group engine (``marketplace.placement_groups``) for a node and its GPUs,
and reserve every GPU of the group -- one whole-GPU ``GpuInstance`` with its 8 ``GpuSlot`` rows per GPU.
The first GPU's instance is the allocation's; the others point to it (``group_lead``) and go with it when
it is released. The per-slot unique constraint stays the last line: a GPU taken meanwhile by a writer that
does not take the lock makes the whole group's insert fail (a savepoint), and the engine is asked again.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from django.db import IntegrityError, transaction

from marketplace import placement_groups as engine
from marketplace.hardware.topology import GpuTopo, NodeTopology, platform_topology
from marketplace.models import Gpu, GpuInstance, GpuModel, GpuSlot, Node, Tier
from marketplace.services.fleet import PLACEMENT_ATTEMPTS, NoCapacityError, candidate_gpus, placement_lock
from tenants.errors import ServiceError
from tenants.models import Tenant

log = logging.getLogger("tessera.groups")


def node_states(gpu_model: GpuModel, tenant_id: int | None) -> list[engine.NodeState]:
    """Every ready node with an eligible GPU of the model, as the group engine sees it: three queries whatever
    the fleet.
    A GPU is eligible when ``candidate_gpus`` allows it (healthy, ready node, MIG off) and it is not dedicated
    to another tenant; busy when any instance holds it."""
    whole = candidate_gpus(gpu_model, whole_gpu=True)
    eligible = whole.values_list("pk", "node_id", "index", "dedicated_tenant_id")
    busy = set(GpuInstance.objects.filter(gpu__in=whole.values("pk")).values_list("gpu_id", flat=True))
    by_node: dict[int, dict[int, int | None]] = defaultdict(dict)
    for pk, node_id, index, owner in eligible:
        ok = owner is None or owner == tenant_id
        by_node[node_id][index] = pk if ok else None
    nodes = {n.pk: n for n in Node.objects.filter(pk__in=list(by_node)).select_related("platform")}
    reported: dict[int, list[tuple[int, int | None, int | None]]] = defaultdict(list)
    for node_id, index, numa, domain in Gpu.objects.filter(node_id__in=list(by_node)).values_list(
            "node_id", "index", "numa_node", "nvlink_domain"):
        reported[node_id].append((index, numa, domain))
    out = []
    for node_id, gpus in sorted(by_node.items()):
        node = nodes[node_id]
        p = node.platform
        topo = reported_topology(reported[node_id]) or platform_topology(p.key, p.gpu_count, p.interconnect)
        ids = tuple(gpus.get(i) for i in range(len(topo.gpus)))
        held = [i for i, pk in enumerate(ids) if pk is not None and pk in busy]
        out.append(engine.NodeState(node_id, gpu_model.key, ids, held, topo, node.hostname))
    return out


def reported_topology(gpus: list[tuple[int, int | None, int | None]]) -> NodeTopology | None:
    """A node's topology as its worker registered it from NVML: (index, NUMA node, NVLink domain) per GPU;
    None when any GPU's was not reported (the platform's table is used then)."""
    if not gpus or any(numa is None for _i, numa, _d in gpus) or sorted(i for i, _n, _d in gpus) != list(
            range(len(gpus))):
        return None
    return NodeTopology(tuple(GpuTopo(i, numa, domain, ()) for i, numa, domain in sorted(gpus)))  # type: ignore[arg-type]


def place_group(tenant: Tenant, tier: Tier, *, policy: str = engine.BEST_FIT) -> GpuInstance:
    """Reserve the whole GPUs of one allocation of a multi-GPU tier. Returns the first GPU's instance (the
    others are its ``group_members``), with ``summary`` set (tenant-safe) and ``reason`` the operators'.
    Raises NoCapacityError."""
    if tier.profile_id is not None:
        raise ServiceError("a GPU group is made of whole GPUs", field="tier")
    model = tier.gpu_model
    request = engine.GroupRequest(model.key, tenant.pk, tier.gpu_count)
    last = ""
    with transaction.atomic():
        placement_lock(model)
        for _attempt in range(PLACEMENT_ATTEMPTS):
            decision = engine.GroupFleet(node_states(model, tenant.pk), policy=policy).choose(request)
            if isinstance(decision, engine.GroupNoCapacity):
                raise NoCapacityError(engine.group_no_capacity_summary(model.name, tier.gpu_count), field="tier",
                                      diagnostic=decision.reason)
            try:
                lead = _reserve_group(tenant, decision)
            except (IntegrityError, _Taken) as exc:
                last = str(exc)
                log.info("group placement raced, re-planning", extra={"node": decision.node_id, "why": last})
                continue
            lead.summary = engine.group_placed_summary(model.name, tier.gpu_count)
            return lead
    raise NoCapacityError("capacity changed while placing this order; try again",
                          diagnostic=f"the fleet changed under {PLACEMENT_ATTEMPTS} attempts ({last})")


class _Taken(Exception):
    pass


def _reserve_group(tenant: Tenant, d: engine.GroupDecision) -> GpuInstance:
    with transaction.atomic():  # savepoint: a lost race leaves nothing of the group behind
        gpus = {g.pk: g for g in Gpu.objects.select_for_update().filter(pk__in=d.gpu_ids).order_by("pk")}
        if len(gpus) != len(d.gpu_ids) or GpuInstance.objects.filter(gpu_id__in=d.gpu_ids).exists():
            raise _Taken("a GPU of the group was taken meanwhile")
        if any(g.dedicated_tenant_id not in (None, tenant.pk) for g in gpus.values()):
            raise _Taken("a GPU of the group was dedicated to another tenant meanwhile")
        lead: GpuInstance | None = None
        for gid in d.gpu_ids:
            inst = GpuInstance.objects.create(gpu=gpus[gid], placement=None, tenant=tenant, start=0, size=8,
                                              reason=d.reason[:500], group_lead=lead)
            GpuSlot.objects.bulk_create([GpuSlot(gpu_id=gid, slot=s, instance=inst) for s in range(8)])
            lead = lead or inst
    assert lead is not None
    log.info("group placed", extra={"node": d.node_id, "gpus": list(d.indexes), "tenant": tenant.slug})
    return lead

