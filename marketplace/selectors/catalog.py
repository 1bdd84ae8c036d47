"""Reads for catalog and fleet."""

from __future__ import annotations

from django.db.models import Count, Prefetch, Q

from marketplace.models import Gpu, GpuInstance, GpuModel, MigPlacement, MigProfile, Node, ServerPlatform
from tenants.scoping import Principal


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
