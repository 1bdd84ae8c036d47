"""Catalog pages' building blocks: the tiers & prices list as a comparable table (one column per
price component, one block of rows per currency)."""

from __future__ import annotations

from dataclasses import dataclass, field

from marketplace.models import PricePlan
from marketplace.services.billing.plans import in_force

# (kind, plan field, header); one column per price component the model has
PRICE_COLUMNS = [
    (PricePlan.Kind.ON_DEMAND, "price_per_slice_hour", "On demand · slice-hour"),
    (PricePlan.Kind.ON_DEMAND, "price_per_1m_input_tokens", "On demand · 1M input tokens"),
    (PricePlan.Kind.ON_DEMAND, "price_per_1m_output_tokens", "On demand · 1M output tokens"),
    (PricePlan.Kind.RESERVED, "price_per_slice_hour", "Reserved · slice-hour"),
    (PricePlan.Kind.RESERVED, "price_per_1m_input_tokens", "Reserved · 1M input tokens"),
    (PricePlan.Kind.RESERVED, "price_per_1m_output_tokens", "Reserved · 1M output tokens"),
    (PricePlan.Kind.RESERVED, "monthly_commit", "Reserved · monthly commit"),
]


@dataclass
class PriceRow:
    tier: object
    cells: list = field(default_factory=list)  # one value (or None) per PRICE_COLUMNS entry
    scheduled: int = 0


@dataclass
class CurrencyBlock:
    currency: str
    rows: list[PriceRow] = field(default_factory=list)


def price_table(tiers, now, currency: str = "") -> tuple[list[CurrencyBlock], list[str], list[object]]:
    """Blocks of rows (one per currency with a plan in force, or only `currency`), the currencies
    seen, and the tiers without any price in force. `tiers` have their plans prefetched newest first."""
    blocks: dict[str, CurrencyBlock] = {}
    unpriced = []
    for tier in tiers:
        plans = list(tier.plans.all())
        current = in_force(plans, now)
        scheduled: dict[str, int] = {}
        for p in plans:
            if p.effective_from > now:
                scheduled[p.currency] = scheduled.get(p.currency, 0) + 1
        if not current:
            unpriced.append(tier)
        for cur in sorted({c for _, c in current}):
            row = PriceRow(tier=tier, scheduled=scheduled.get(cur, 0))
            for kind, attr, _ in PRICE_COLUMNS:
                plan = current.get((kind, cur))
                row.cells.append(getattr(plan, attr) if plan else None)
            blocks.setdefault(cur, CurrencyBlock(cur)).rows.append(row)
    seen = sorted(blocks)
    chosen = [blocks[c] for c in seen if not currency or c == currency]
    return chosen, seen, unpriced
