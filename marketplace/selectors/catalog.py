"""Reads for catalog and fleet."""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings
from django.db.models import Count, Prefetch, Q

from marketplace import placement as engine
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


def gpu_states(gpus: Iterable[Gpu]) -> list[engine.GpuState]:
    """The placement engine's view of GPUs (fetched with gpu_model and instances__placement__profile)."""
    return [engine.GpuState(
        gpu_id=gpu.pk, geometry=gpu.gpu_model.key, node_id=gpu.node_id,
        instances=[(i.placement.profile.profile_id if i.placement is not None else None, i.start, i.tenant_id)
                   for i in gpu.instances.all()],
        dedicated_tenant_id=gpu.dedicated_tenant_id, dedication_sticky=gpu.dedicated_sticky,
        label=gpu.label,
    ) for gpu in gpus]


#: The catalog shows free places up to this many ("10+" beyond): an exact count would tell a
#: tenant the fleet's size and load.
AVAILABILITY_CAP = 10


def availability(tiers: Iterable[Tier], tenant_id: int) -> dict[int, int | str]:
    """Free places now per tier for this tenant (engine.Fleet.free_places: every start where the tier's
    profile fits, on the GPUs the placement engine would give the tenant), over the healthy GPUs of ready
    nodes, capped at AVAILABILITY_CAP (one query for the GPUs with their nodes, whose hostnames label them, and
    one for their instances)."""
    groups: dict[tuple[int, bool], list[Gpu]] = {}
    for g in (Gpu.objects.filter(state=Gpu.State.OK, node__state=Node.State.READY)
              .select_related("gpu_model", "node").prefetch_related("instances__placement__profile")):
        groups.setdefault((g.gpu_model_id, g.mig_mode), []).append(g)
    fleets = {key: (engine.Fleet(gpu_states(group)), group[0].gpu_model.key) for key, group in groups.items()}
    out: dict[int, int | str] = {}
    for tier in tiers:
        profile = tier.profile  # None: a whole GPU
        fleet, geometry = fleets.get((tier.gpu_model_id, profile is not None), (None, ""))
        n = 0
        if fleet is not None:
            n = fleet.free_places(engine.Request(geometry, tenant_id, whole_gpu=profile is None,
                                                 profile_id=None if profile is None else profile.profile_id,
                                                 dedicated=tier.dedicated))
        out[tier.pk] = n if n <= AVAILABILITY_CAP else f"{AVAILABILITY_CAP}+"
    return out
