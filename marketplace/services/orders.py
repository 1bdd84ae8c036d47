"""Orders: quota checks, placement of every allocation in one transaction, provisioning enqueued
on commit. A refused order (quota, price, capacity) reserves nothing."""

from __future__ import annotations

import logging
from functools import partial

from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from marketplace import enqueue
from marketplace.models import Allocation, Order, PricePlan, Tier
from marketplace.models.offers import memory_gb_sums
from marketplace.models.orders import LIVE_STATES, live_slices
from marketplace.services import allocations, billing, fleet, groups
from tenants import audit
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.models import Tenant
from tenants.scoping import Principal

log = logging.getLogger("tessera.orders")


class QuotaExceeded(ServiceError):
    status_code = 409


def actor_of(principal: Principal) -> str:
    if principal.api_key is not None:
        return f"key:{principal.api_key.prefix}"
    if principal.user is not None:
        return f"user:{principal.user.email}"
    return "system"


def plan_in_force(tier: Tier, currency: str, kind: str, at=None) -> PricePlan | None:
    at = at or timezone.now()
    return (PricePlan.objects.filter(tier=tier, currency=currency, kind=kind, effective_from__lte=at)
            .order_by("-effective_from").first())


def check_quota(tenant: Tenant, tier: Tier, quantity: int) -> None:
    """One query (the order runs it under the tenant's lock): slices in use, of this tier, and their memory.
    A multi-GPU allocation counts as its GPUs (``Tier.gpu_count``; 1 for a slice or a whole GPU) against
    the slice quotas, and its memory is every GPU's (``Tier.memory_gb``; in SQL its twin ``memory_gb_sums``)."""
    live = Allocation.objects.filter(tenant=tenant, state__in=LIVE_STATES).aggregate(
        total=live_slices(), same_tier=Sum("tier__gpu_count", filter=Q(tier=tier)), **memory_gb_sums())
    total = live["total"] or 0
    gpus = quantity * tier.gpu_count
    if total + gpus > tenant.max_slices:
        raise QuotaExceeded(f"quota: {total} of {tenant.max_slices} slices in use; {gpus} more would exceed it",
                            field="quantity", code="quota")
    same_tier = live["same_tier"] or 0
    if same_tier + gpus > tenant.max_slices_per_tier:
        raise QuotaExceeded(f"quota: {same_tier} of {tenant.max_slices_per_tier} slices of {tier.name} in use",
                            field="quantity", code="quota")
    used = (live["mem_profile"] or 0) + (live["mem_whole"] or 0)
    wanted = tier.memory_gb * quantity
    if used + wanted > tenant.max_memory_gb:
        raise QuotaExceeded(f"quota: {used} GB of {tenant.max_memory_gb} GB GPU memory in use; "
                            f"{wanted} GB more would exceed it", field="quantity", code="quota")


def create_order(principal: Principal, *, tenant: Tenant, tier: Tier, quantity: int = 1,
                 plan_kind: str = PricePlan.Kind.ON_DEMAND, idempotency_key: str = "") -> Order:
    if not principal.can("deploy", tenant.pk):
        raise Forbidden("Your role or API-key scopes do not allow ordering for this tenant.")
    if idempotency_key:
        existing = Order.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
        if existing is not None:
            return _replayed(existing, tier, quantity)
    if not tier.active:
        raise ServiceError(f"{tier.name} is not on sale", field="tier")
    if quantity < 1 or quantity > 64:
        raise ServiceError("must be between 1 and 64", field="quantity")
    currency = billing.period_currency(tenant, billing.month_of(timezone.now()))
    if plan_in_force(tier, currency, plan_kind) is None:
        raise ServiceError(f"{tier.name} has no {plan_kind} price in {currency}", field="plan_kind")
    actor = actor_of(principal)
    # Before any lock (ordering does not change the spend: a slice costs from when it is active). The spend rule
    # (None = no limit, 0 = nothing may be spent) is the billing package's; here it is only asked.
    billing.check_can_order(tenant)
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)  # one order at a time per tenant: exact quotas
        if not tenant.is_active:
            raise Forbidden("the tenant is suspended", field="tenant")
        if idempotency_key:  # the same key sent twice at once: the second waited for the first's lock
            existing = Order.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
            if existing is not None:
                return _replayed(existing, tier, quantity)
        check_quota(tenant, tier, quantity)
        order = Order.objects.create(
            tenant=tenant, tier=tier, quantity=quantity, plan_kind=plan_kind, idempotency_key=idempotency_key,
            created_by=principal.user, api_key=principal.api_key,
        )
        requested = []
        for _ in range(quantity):
            alloc = Allocation.objects.create(order=order, tenant=tenant, tier=tier)
            allocations.record_created(alloc, actor)
            requested.append(alloc)
        # Placement last: place_instance takes the GPU model's placement lock, held to this commit, so nothing
        # but placement runs under it (concurrent orders of other tenants wait for placements, not for orders).
        placed = []
        for alloc in requested:
            instance = place_for(tenant, tier)
            placed.append(allocations.place(alloc, instance, "placement-engine"))
        for alloc in placed:
            transaction.on_commit(partial(enqueue_provision, alloc))
    log.info("order placed", extra={"order": order.pk, "tenant": tenant.slug, "tier": tier.key, "n": quantity})
    return order


def place_for(tenant: Tenant, tier: Tier):
    """Reserve what one allocation of ``tier`` holds: a slice (fleet), or whole GPUs (groups: one or a group, in
    aligned blocks so that single GPUs do not strand the 4- and 8-GPU shapes; a dedicated whole-GPU tier keeps
    the fleet engine's dedication). Raises NoCapacityError."""
    if tier.gpu_count > 1 or (tier.profile_id is None and not tier.dedicated):
        return groups.place_group(tenant, tier)
    return fleet.place_instance(tenant, tier.gpu_model, tier.profile, dedicated=tier.dedicated)


def _replayed(existing: Order, tier: Tier, quantity: int) -> Order:
    """An order sent again with its idempotency key: the first one, if it asked for the same."""
    if existing.tier_id != tier.pk or existing.quantity != quantity:
        raise Conflict("this idempotency key was used for a different order", field="idempotency_key")
    return existing


def _node_queue(allocation: Allocation) -> str:
    node = allocation.node
    if node is None:  # never: only placed allocations are provisioned or released, and they keep their node
        raise ValueError(f"allocation {allocation.pk} has no node to queue its task on")
    return node.queue


def enqueue_provision(allocation: Allocation) -> None:
    enqueue.send(enqueue.PROVISION_ALLOCATION, [allocation.pk], _node_queue(allocation))


def enqueue_release(allocation: Allocation) -> None:
    enqueue.send(enqueue.RELEASE_ALLOCATION, [allocation.pk], _node_queue(allocation))


def request_release(principal: Principal, allocation: Allocation, reason: str = "released by the tenant") -> Allocation:
    """The tenant (or an operator) asks for a slice back: it moves to releasing and the node's
    `tessera.release_allocation` task (provisioning.release_allocation) tears it down after the commit (a failed
    slice with nothing on the GPU is released at once)."""
    if not principal.can("deploy", allocation.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow releasing this allocation.")
    with transaction.atomic():
        allocation = Allocation.objects.select_for_update().get(pk=allocation.pk)
        audit.record(principal, "allocation.release", f"allocation:{allocation.pk}", allocation.tenant_id,
                     reason=reason, state=allocation.state)
        if allocation.state == Allocation.State.FAILED and allocation.instance_id is None:
            return allocations.mark_released(allocation, actor_of(principal), "nothing was left on the GPU")
        allocations.begin_release(allocation, actor_of(principal), reason)
        transaction.on_commit(lambda: enqueue_release(allocation))
    return allocation


def retry(principal: Principal, allocation: Allocation) -> Allocation:
    """Operators retry a failed allocation: re-provision its reservation, or re-place it."""
    if not principal.can("operate"):
        raise Forbidden("only operators retry allocations")
    with transaction.atomic():
        allocation = (Allocation.objects.select_for_update(of=("self",)).select_related("tier", "tenant")
                      .get(pk=allocation.pk))
        if allocation.state != Allocation.State.FAILED:
            raise Conflict(f"only failed allocations are retried (this one is {allocation.state})", field="state")
        if allocation.instance_id is None:
            instance = place_for(allocation.tenant, allocation.tier)
            allocations.place(allocation, instance, actor_of(principal))
        audit.record(principal, "allocation.retry", f"allocation:{allocation.pk}", allocation.tenant_id,
                     instance=allocation.instance_id)
        transaction.on_commit(lambda: enqueue_provision(allocation))
    return allocation
