"""Reads for catalog and fleet."""

from __future__ import annotations

from django.conf import settings
from django.db.models import Count, Prefetch, Q

from marketplace.models import Gpu, GpuInstance, GpuModel, MigPlacement, MigProfile, Node, ServerPlatform
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
