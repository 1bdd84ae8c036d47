"""Reads for catalog and fleet."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Prefetch, Q, QuerySet
from django.utils import timezone

from marketplace import placement as engine
from marketplace import placement_groups as group_engine
from marketplace.models import Gpu, GpuInstance, GpuModel, MigPlacement, MigProfile, Node, ServerPlatform, Tier
from tenants.scoping import Principal

DEFAULT_TOKENS_PER_S_PER_TBPS = 3000.0  # whole GPU; decode is memory-bound: H100 ~10k tok/s, H200 ~14k


def modelled_tokens_per_s(gpu_model: GpuModel, profile: MigProfile | None) -> float:
    """What one slice serves flat out, in tokens/s, by the model (not a measurement):
    TESSERA_TOKENS_PER_S_PER_TBPS x the GPU's memory bandwidth x the slice's share of the compute
    slices (a whole GPU: all of them). The simulated Triton runs at this rate; the planner uses it
    where a shape has no measurement."""
    per_tbps = float(getattr(settings, "TESSERA_TOKENS_PER_S_PER_TBPS", DEFAULT_TOKENS_PER_S_PER_TBPS))
    share = 1.0 if profile is None else profile.compute_slices / gpu_model.compute_slices
    return per_tbps * float(gpu_model.bandwidth_tbps) * share


def gpu_models():
    return GpuModel.objects.all()


def mig_profiles():
    return MigProfile.objects.select_related("gpu_model").prefetch_related(
        Prefetch("placements", queryset=MigPlacement.objects.order_by("start"))
    )


def platforms():
    return ServerPlatform.objects.select_related("gpu_model")


def nodes(principal: Principal):
    qs = Node.objects.select_related("platform", "platform__gpu_model").annotate(
        gpu_count=Count("gpus", distinct=True),
        used_slots=Count("gpus__slots", distinct=True),
    )
    return qs if principal.can("operate") else qs.none()


def gpus(principal: Principal):
    qs = Gpu.objects.select_related("node", "gpu_model", "dedicated_tenant").prefetch_related(
        Prefetch("instances", queryset=GpuInstance.objects.select_related("tenant", "placement__profile"))
    ).annotate(used_slots=Count("slots", distinct=True),
               instance_count=Count("instances", filter=Q(instances__isnull=False), distinct=True))
    return qs if principal.can("operate") else qs.none()


def gpu_instances(principal: Principal):
    return GpuInstance.objects.visible_to(principal).select_related(
        "gpu__node", "gpu__gpu_model", "placement__profile", "tenant"
    )


def platforms_by_gpu_model(*, in_fleet_only: bool = False) -> dict[int, list[ServerPlatform]]:
    """The server platforms each GPU model comes in (one query), each with `node_count`, the nodes
    registered on it; `in_fleet_only`: only platforms with a registered node (what a tier runs on)."""
    qs = ServerPlatform.objects.select_related("gpu_model").annotate(node_count=Count("nodes"))
    if in_fleet_only:
        qs = qs.filter(node_count__gt=0)
    out: dict[int, list[ServerPlatform]] = {}
    for p in qs.order_by("-node_count", "vendor", "key"):
        out.setdefault(p.gpu_model_id, []).append(p)
    return out


def _gpu_state_rows(gpus: QuerySet[Gpu]) -> list[tuple[int, bool, engine.GpuState]]:
    """``(gpu_model_id, mig_mode, state)`` for every GPU of ``gpus``, read as plain values in two queries (the
    GPUs with their model's key and their node's hostname; the instances on them), no model instances."""
    gpus = gpus.order_by().prefetch_related(None)
    instances: dict[int, list[tuple[int | None, int, int]]] = {}
    for gpu_id, pid, start, tenant_id in (GpuInstance.objects.filter(gpu__in=gpus.values("pk")).order_by()
                                          .values_list("gpu_id", "placement__profile__profile_id", "start",
                                                       "tenant_id")):
        instances.setdefault(gpu_id, []).append((pid, start, tenant_id))
    no_instances: list[tuple[int | None, int, int]] = []
    return [(model_id, mig_mode, engine.GpuState(
        gpu_id=pk, geometry=model_key, node_id=node_id, instances=instances.get(pk, no_instances),
        dedicated_tenant_id=owner, dedication_sticky=sticky, label=Gpu.label_for(hostname, index),
    )) for pk, model_id, model_key, mig_mode, node_id, hostname, index, owner, sticky in gpus.values_list(
        "pk", "gpu_model_id", "gpu_model__key", "mig_mode", "node_id", "node__hostname", "index",
        "dedicated_tenant_id", "dedicated_sticky")]


def gpu_states_of(gpus: QuerySet[Gpu]) -> list[engine.GpuState]:
    """The placement engine's view of the GPUs a queryset selects (their instances' profile ids, starts and
    tenants, dedication, label), read as plain values: two queries whatever the fleet's size, no model
    instances. The placement service and the catalog's availability both read the fleet through it."""
    return [state for _model, _mig, state in _gpu_state_rows(gpus)]


def working_nodes_q(prefix: str = "", now: datetime | None = None) -> Q:
    """The one rule for a node that can take work: ready, and its own worker heard from within
    TESSERA_NODE_HEARTBEAT_STALE_S (a node an operator registered is not working until its worker has sent a
    heartbeat; one whose worker went quiet is not either). ``prefix``: the path to the node ("node__")."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.TESSERA_NODE_HEARTBEAT_STALE_S)
    return Q(**{f"{prefix}state": Node.State.READY, f"{prefix}last_heartbeat__gte": cutoff})


def ready_gpus() -> QuerySet[Gpu]:
    """GPUs that may take new work: healthy, on a working node (:func:`working_nodes_q`; the placement service
    narrows it to a model and a MIG mode)."""
    return Gpu.objects.filter(working_nodes_q("node__"), state=Gpu.State.OK)


#: The catalog shows free places up to this many ("10+" beyond): an exact count would tell a
#: tenant the fleet's size and load.
AVAILABILITY_CAP = 10


def availability(tiers: Iterable[Tier], tenant_id: int) -> dict[int, int | str]:
    """Free places now per tier for this tenant (engine.Fleet.free_places: every start where the tier's
    profile fits, on the GPUs the placement engine would give the tenant), over the GPUs placement may use
    (:func:`ready_gpus`, read as the placement service reads them: :func:`gpu_states_of`), capped at
    AVAILABILITY_CAP. Two queries whatever the fleet's size (and three per GPU model with a multi-GPU tier: the
    group engine's count of free groups), and plain values, not model instances."""
    groups: dict[tuple[int, bool], list[engine.GpuState]] = {}
    for model_id, mig_mode, state in _gpu_state_rows(ready_gpus()):
        groups.setdefault((model_id, mig_mode), []).append(state)
    fleets = {key: (engine.Fleet(states), states[0].geometry) for key, states in groups.items()}
    out: dict[int, int | str] = {}
    group_fleets: dict[int, group_engine.GroupFleet] = {}
    for tier in tiers:
        profile = tier.profile  # None: a whole GPU
        fleet, geometry = fleets.get((tier.gpu_model_id, profile is not None), (None, ""))
        n = 0
        if tier.gpu_count > 1:  # whole-GPU groups: the group engine's count, three queries per GPU model
            from marketplace.services.groups import node_states

            if tier.gpu_model_id not in group_fleets:
                group_fleets[tier.gpu_model_id] = group_engine.GroupFleet(node_states(tier.gpu_model, tenant_id))
            n = group_fleets[tier.gpu_model_id].free_groups(tier.gpu_model.key, tier.gpu_count, AVAILABILITY_CAP + 1)
        elif fleet is not None:
            n = fleet.free_places(engine.Request(geometry, tenant_id, whole_gpu=profile is None,
                                                 profile_id=None if profile is None else profile.profile_id,
                                                 dedicated=tier.dedicated))
        out[tier.pk] = n if n <= AVAILABILITY_CAP else f"{AVAILABILITY_CAP}+"
    return out
