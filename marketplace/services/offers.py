"""Writes for tiers and price plans. A plan whose time has come is never edited or removed."""

from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from marketplace.models import PricePlan, Tier
from tenants import audit
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.scoping import Principal


def _operator(principal: Principal) -> None:
    if not principal.can("operate"):
        raise Forbidden("only MSP operators manage tiers and prices")


@transaction.atomic
def create_tier(principal: Principal, **fields) -> Tier:
    _operator(principal)
    profile = fields.get("profile")
    if profile is not None and profile.gpu_model_id != fields["gpu_model"].pk:
        raise ServiceError(f"{profile.name} is not a {fields['gpu_model'].name} profile", field="profile")
    if Tier.objects.filter(key=fields["key"]).exists():
        raise Conflict("a tier with this key exists", field="key")
    tier = Tier.objects.create(**fields)
    audit.record(principal, "tier.create", f"tier:{tier.key}")
    return tier


@transaction.atomic
def update_tier(principal: Principal, tier: Tier, **fields) -> Tier:
    _operator(principal)
    allowed = {"name", "description", "active"}
    bad = set(fields) - allowed
    if bad:
        raise ServiceError(f"cannot be changed once a tier exists: {', '.join(sorted(bad))}")
    for k, v in fields.items():
        setattr(tier, k, v)
    tier.save(update_fields=list(fields) or None)
    audit.record(principal, "tier.update", f"tier:{tier.key}", fields=fields)
    return tier


def add_price_plan(principal: Principal, *, tier: Tier, effective_from=None, **fields) -> PricePlan:
    """A new price from `effective_from` (default now). It may not start in the past: hours already
    served keep the price they had."""
    _operator(principal)
    now = timezone.now()
    effective_from = effective_from or now
    if effective_from < now - timedelta(seconds=5):
        raise ServiceError("a price cannot start in the past (it would rewrite rated hours)", field="effective_from")
    kind = fields.get("kind", PricePlan.Kind.ON_DEMAND)
    if kind == PricePlan.Kind.RESERVED and fields.get("monthly_commit") is None:
        raise ServiceError("a reserved plan needs a monthly commit", field="monthly_commit")
    if kind == PricePlan.Kind.ON_DEMAND and fields.get("monthly_commit") is not None:
        raise ServiceError("only reserved plans have a monthly commit", field="monthly_commit")
    try:
        with transaction.atomic():
            plan = PricePlan.objects.create(tier=tier, effective_from=effective_from, **fields)
            audit.record(principal, "price_plan.add", f"price_plan:{plan.pk}", tier=tier.key,
                         effective_from=effective_from, **fields)
            return plan
    except IntegrityError:
        raise Conflict("a plan for this tier, kind and currency already starts then", field="effective_from") from None


@transaction.atomic
def withdraw_price_plan(principal: Principal, plan: PricePlan) -> None:
    _operator(principal)
    if plan.effective_from <= timezone.now():
        raise Conflict("this price is or was in force; add a new plan instead of removing it")
    audit.record(principal, "price_plan.withdraw", f"price_plan:{plan.pk}", tier=plan.tier.key)
    plan.delete()
