"""Writes for tiers and price plans. A plan whose time has come is never edited or removed.

A new plan may start in the past (an operator corrects usage that had no price, or a price change made late) only
over hours no finalized invoice holds: it would price hours that are already invoiced for good. Draft invoices
are re-rated by the rating beat (and on refresh), so they take it up; an "unpriced" billing alert it covers
resolves then (billing.alerts.note_unpriced)."""

from __future__ import annotations

from datetime import datetime

from django.db import IntegrityError, transaction
from django.utils import timezone

from marketplace.models import Invoice, PricePlan, Tier
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
    if fields.get("gpu_count", 1) > 1 and profile is not None:
        raise ServiceError("a tier of several GPUs sells whole GPUs: leave the profile empty", field="gpu_count")
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


def backdating_conflicts(tier: Tier, kind: str, currency: str, effective_from: datetime,
                         now: datetime | None = None) -> list[Invoice]:
    """The finalized invoices (any tenant's) that hold hours a new plan of `tier`, `kind` and `currency` starting at
    `effective_from` would price: those in that currency with a line on that tier at a plan of that kind whose
    usage overlaps the new plan's past (from `effective_from` until the next plan of the same tier, kind and
    currency starts, or now). None when the plan starts in the future."""
    now = now or timezone.now()
    nxt = (PricePlan.objects.filter(tier=tier, kind=kind, currency=currency, effective_from__gt=effective_from)
           .order_by("effective_from").values_list("effective_from", flat=True).first())
    until = min(nxt, now) if nxt is not None else now
    if effective_from >= until:
        return []
    return list(Invoice.objects.filter(
        status=Invoice.Status.FINALIZED, currency=currency, lines__tier=tier, lines__plan__kind=kind,
        lines__usage_from__lt=until, lines__usage_to__gt=effective_from).select_related("tenant")
        .distinct().order_by("period_start", "number"))


def add_price_plan(principal: Principal, *, tier: Tier, effective_from=None, **fields) -> PricePlan:
    """A new price from `effective_from` (default now). It may start in the past only over hours no finalized
    invoice holds (`backdating_conflicts`): a finalized invoice never changes; drafts are re-rated."""
    _operator(principal)
    now = timezone.now()
    effective_from = effective_from or now
    kind = fields.get("kind", PricePlan.Kind.ON_DEMAND)
    currency = fields.get("currency", PricePlan._meta.get_field("currency").default)
    held = backdating_conflicts(tier, kind, currency, effective_from, now) if effective_from < now else []
    if held:
        names = ", ".join(f"{inv.number} ({inv.tenant.slug}, {inv.period_start:%Y-%m})" for inv in held[:5])
        more = f" and {len(held) - 5} more" if len(held) > 5 else ""
        raise ServiceError(f"a {kind} {currency} price for {tier.key} from {effective_from:%Y-%m-%d %H:%M} UTC would "
                           f"reprice hours that finalized invoices hold: {names}{more}; start it after their usage, "
                           f"or correct them with a credit note", field="effective_from")
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
