"""Reads for models on slices: the library, a tenant's repositories, and "find a tier" (every tier the model
fits, its price per hour, the expected tokens/s and the expected cost per 1M tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

from django.utils import timezone

from marketplace import fit
from marketplace.models import LibraryModel, LoraAdapter, ModelRepository, PricePlan, Tier
from marketplace.selectors import orders as order_sel
from marketplace.selectors.capacity_planning import shape_figures, window
from marketplace.services import models as model_svc
from marketplace.services.billing.plans import in_force
from tenants.scoping import Principal


def library(active_only: bool = True):
    qs = LibraryModel.objects.all()
    return qs.filter(active=True) if active_only else qs


def repositories(principal: Principal):
    return ModelRepository.objects.visible_to(principal).select_related("tenant")


def adapters(principal: Principal):
    return LoraAdapter.objects.visible_to(principal).select_related("tenant", "base")


@dataclass
class TierOption:
    tier: Tier
    fit: fit.Fit
    plan: PricePlan | None
    tokens_per_s: float
    tokens_per_s_source: str  # measured (the planner's figure for this shape) | modelled (how: see README)
    cost_per_1m_tokens: Decimal | None  # slice-hours at full load + the plan's token prices
    shape_measured_tokens_per_s: float | None = None  # the shape's measured figure, over whatever models it served

    def as_dict(self) -> dict:
        t, p = self.tier, self.plan
        return {
            "tier": t.key, "tier_name": t.name, "gpu_model": t.gpu_model.key,
            "profile": t.profile.name if t.profile is not None else None, "memory_mib": t.memory_mib,
            "gpu_count": t.gpu_count,
            "fits": self.fit.fits, "reason": self.fit.reason, "needed_mib": self.fit.needed_mib,
            "headroom_mib": self.fit.headroom_mib, "max_cached_tokens": self.fit.max_cached_tokens,
            "max_context": self.fit.max_context, "max_concurrency": self.fit.max_concurrency,
            "currency": p.currency if p else None,
            "price_per_hour": str(p.price_per_slice_hour) if p else None,
            "price_per_1m_input_tokens": str(p.price_per_1m_input_tokens) if p else None,
            "price_per_1m_output_tokens": str(p.price_per_1m_output_tokens) if p else None,
            "tokens_per_s": round(self.tokens_per_s, 1), "tokens_per_s_source": self.tokens_per_s_source,
            "shape_measured_tokens_per_s": (None if self.shape_measured_tokens_per_s is None
                                            else round(self.shape_measured_tokens_per_s, 1)),
            "cost_per_1m_tokens": str(self.cost_per_1m_tokens) if self.cost_per_1m_tokens is not None else None,
        }


def _plan(tier, currency: str) -> PricePlan | None:
    return in_force(tier.plans.all(), timezone.now()).get((PricePlan.Kind.ON_DEMAND, currency))


def roofline_tokens_per_s(shape: fit.ModelShape, tier, result: fit.Fit) -> float | None:
    """Decode is memory-bound: each step reads the weights once for the whole batch plus each sequence's cache,
    so tokens/s ~ concurrency x slice bandwidth / (weights + concurrency x context x KV per token). The slice's
    bandwidth is the GPU's times its share of the memory slices (NVIDIA MIG User Guide: memory and its
    bandwidth are partitioned with the memory slices)."""
    if not shape.params:
        return None
    share = (tier.profile.memory_slices / tier.gpu_model.memory_slices) if tier.profile_id else 1.0
    bandwidth = float(tier.gpu_model.bandwidth_tbps) * 1e12 * share * tier.gpu_count
    per_step = shape.weights_bytes + result.concurrency * max(result.context, 1) * shape.kv_bytes_per_token
    return result.concurrency * bandwidth / per_step


def find_tiers(shape: fit.ModelShape, *, context: int = 0, concurrency: int = 1, currency: str = "USD",
               input_share: float = 0.5, fitting_only: bool = True) -> list[TierOption]:
    """Every active tier the model fits at ``context`` x ``concurrency``, cheapest per 1M tokens first."""
    since, until = window()
    figures = {(f.gpu_model.pk, f.profile.pk if f.profile else None): f for f in shape_figures(since, until)}
    out = []
    for tier, result in model_svc.fit_tiers(shape, context=context, concurrency=concurrency,
                                            tiers=order_sel.tiers().filter(active=True)):
        if fitting_only and not result.fits:
            continue
        f = figures.get((tier.gpu_model_id, tier.profile_id)) if tier.gpu_count == 1 else None  # one GPU's figures
        # Like with like: every tier is ranked on this model's own modelled figure. What the shape measured comes
        # from whatever models its slices served (the demo's toy model is far faster than an 8B one), so it is
        # shown beside the figure, never ranked against another tier's modelled one.
        roof = roofline_tokens_per_s(shape, tier, result) if result.fits else None
        if roof is not None:
            tps, source = roof, "modelled (memory-bandwidth roofline for this model)"
        else:
            tps, source = (f.modelled_tps if f else 0.0), "modelled (planner: tokens/s per TB/s)"
        measured = f.measured_tps if f is not None else None
        plan = _plan(tier, currency)
        cost = None
        if plan is not None and tps > 0:
            slice_part = plan.price_per_slice_hour * Decimal(10**6) / Decimal(str(tps * 3600))
            share = Decimal(str(input_share))
            tokens = plan.price_per_1m_input_tokens * share + plan.price_per_1m_output_tokens * (1 - share)
            cost = (slice_part + tokens).quantize(Decimal("0.0001"), ROUND_HALF_UP)
        out.append(TierOption(tier, result, plan, tps, source, cost, measured))
    out.sort(key=lambda o: (o.cost_per_1m_tokens is None, o.cost_per_1m_tokens or 0, o.tier.key))
    return out
