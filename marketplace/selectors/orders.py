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


def _allocation_rows():
    return Allocation.objects.select_related(
        "tenant", "tier", "node", "tier__gpu_model", "tier__profile", "triton_server").prefetch_related(
        Prefetch("events", queryset=AllocationEvent.objects.order_by("at", "pk")))


def orders(principal: Principal):
    """Orders with their allocations as the API nests them (a constant number of queries per page)."""
    return Order.objects.visible_to(principal).select_related("tenant", "tier").prefetch_related(
        Prefetch("allocations", queryset=_allocation_rows()))


def allocations(principal: Principal):
    return _allocation_rows().visible_to(principal)


def drift_events(principal: Principal):
    qs = DriftEvent.objects.select_related("node")
    return qs if principal.can("operate") else qs.none()


def deployments(principal: Principal):
    return (ModelDeployment.objects.visible_to(principal).select_related("tenant", "allocation", "library_model")
            .prefetch_related("adapters"))
