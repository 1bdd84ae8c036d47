"""The allocation lifecycle as explicit transitions: one function each, illegal ones refused,
every change written to the allocation's event history (who/what, when, why)."""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from marketplace import placement as engine
from marketplace.models import Allocation, AllocationEvent
from tenants.errors import Conflict

log = logging.getLogger("tessera.allocations")

TRANSITIONS: dict[str, frozenset[str]] = {
    Allocation.State.REQUESTED: frozenset({Allocation.State.PLACED, Allocation.State.FAILED}),
    Allocation.State.PLACED: frozenset({Allocation.State.PROVISIONING, Allocation.State.RELEASING,
                                      Allocation.State.FAILED}),
    Allocation.State.PROVISIONING: frozenset({Allocation.State.READY, Allocation.State.RELEASING,
                                            Allocation.State.FAILED}),
    Allocation.State.READY: frozenset({Allocation.State.ACTIVE, Allocation.State.RELEASING, Allocation.State.FAILED}),
    Allocation.State.ACTIVE: frozenset({Allocation.State.RELEASING, Allocation.State.FAILED}),
    Allocation.State.RELEASING: frozenset({Allocation.State.RELEASED, Allocation.State.FAILED}),
    # from failed: retry (re-place or re-provision) or release what is left
    Allocation.State.FAILED: frozenset({Allocation.State.PLACED, Allocation.State.PROVISIONING,
                                      Allocation.State.RELEASING, Allocation.State.RELEASED}),
    Allocation.State.RELEASED: frozenset(),
}


class IllegalTransition(Conflict):
    pass


def _move(allocation: Allocation, to: str, actor: str, reason: str = "", detail: str = "", **fields) -> Allocation:
    """Lock the row, check the transition against the current state, apply it, record the event.
    ``reason`` is shown to the tenant; ``detail`` (fleet internals allowed) to operators only."""
    with transaction.atomic():
        current = Allocation.objects.select_for_update().get(pk=allocation.pk)
        if to not in TRANSITIONS[current.state]:
            raise IllegalTransition(f"an allocation cannot go from {current.state} to {to}", field="state")
        now = timezone.now()
        AllocationEvent.objects.create(allocation=current, from_state=current.state, to_state=to,
                                       actor=actor[:200], reason=reason[:1000], detail=detail[:1000], at=now)
        current.state = to
        current.updated_at = now
        for name, value in fields.items():
            setattr(current, name, value)
        current.save()
    log.info("allocation transition", extra={"allocation": current.pk, "to": to, "actor": actor})
    allocation.__dict__.update(current.__dict__)
    return allocation


def record_created(allocation: Allocation, actor: str) -> AllocationEvent:
    """The first event: the allocation exists in state requested."""
    return AllocationEvent.objects.create(
        allocation=allocation, from_state="", to_state=Allocation.State.REQUESTED, actor=actor)


def place(allocation: Allocation, instance, actor: str) -> Allocation:
    """The engine's diagnostic (``instance.reason``: GPU and node ids, fleet figures) is kept for
    operators; the tenant reads the summary (``instance.summary``, set by fleet.place_instance)."""
    summary = getattr(instance, "summary", "") or placed_summary(allocation.tier, instance)
    return _move(allocation, Allocation.State.PLACED, actor, summary, instance.reason, instance=instance,
                 node_id=instance.gpu.node_id, gpu_uuid=instance.gpu.uuid, start=instance.start, size=instance.size,
                 placement_reason=summary[:500], placement_detail=instance.reason[:500], failure_reason="")


def placed_summary(tier, instance) -> str:
    """The tenant-safe placement text for an instance placed without the engine's summary."""
    gpu = instance.gpu
    profile = instance.placement.profile.name if instance.placement_id else None
    return engine.placed_summary(tier.gpu_model.name, profile, gpu.dedicated_tenant_id == instance.tenant_id)


def begin_provisioning(allocation: Allocation, actor: str, reason: str = "") -> Allocation:
    return _move(allocation, Allocation.State.PROVISIONING, actor, reason, attempts=allocation.attempts + 1)


def mark_ready(allocation: Allocation, actor: str, mig_uuid: str, reason: str = "", detail: str = "") -> Allocation:
    return _move(allocation, Allocation.State.READY, actor, reason, detail, mig_uuid=mig_uuid)


def activate(allocation: Allocation, actor: str) -> Allocation:
    return _move(allocation, Allocation.State.ACTIVE, actor, "billing clock started", activated_at=timezone.now())


def begin_release(allocation: Allocation, actor: str, reason: str = "") -> Allocation:
    return _move(allocation, Allocation.State.RELEASING, actor, reason)


def mark_released(allocation: Allocation, actor: str, reason: str = "") -> Allocation:
    return _move(allocation, Allocation.State.RELEASED, actor, reason, released_at=timezone.now(), instance=None)


def fail(allocation: Allocation, actor: str, reason: str, detail: str = "") -> Allocation:
    """``reason`` is the tenant's (no fleet internals); ``detail`` the operators'."""
    return _move(allocation, Allocation.State.FAILED, actor, reason, detail, failure_reason=reason[:1000])
