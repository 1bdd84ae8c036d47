"""Reads for tiers, plans, orders and allocations."""

from __future__ import annotations

from django.db.models import Prefetch

from marketplace.models import Allocation, AllocationEvent, DriftEvent, ModelDeployment, Order, PricePlan, Tier
from tenants.scoping import Principal


def tiers():
    return Tier.objects.select_related("gpu_model", "profile").prefetch_related(
        Prefetch("plans", queryset=PricePlan.objects.order_by("-effective_from")))


def price_plans():
    return PricePlan.objects.select_related("tier")


def orders(principal: Principal):
    return Order.objects.visible_to(principal).select_related("tenant", "tier").prefetch_related("allocations")


def allocations(principal: Principal):
    return Allocation.objects.visible_to(principal).select_related(
        "tenant", "tier", "node", "tier__gpu_model", "tier__profile", "triton_server").prefetch_related(
        Prefetch("events", queryset=AllocationEvent.objects.order_by("at", "pk")))


def drift_events(principal: Principal):
    qs = DriftEvent.objects.select_related("node")
    return qs if principal.can("operate") else qs.none()


def deployments(principal: Principal):
    return ModelDeployment.objects.visible_to(principal).select_related("tenant", "allocation")
