"""An invoice's per-key breakdown: each token line's amount split over the API keys that were served under it.

The split rule, in one place: a line's key shares are proportional to the tokens each key was served under the
line (one unit price per line, so tokens are money), floored to the cent, and the cents left over go one each
to the keys with the largest remainders (ties: the key with more tokens, then the key's prefix), so the shares of
a line sum to its amount exactly. Written with the lines (``write_shares``, by ``invoices.refresh`` and
``invoices.finalize``); a finalized invoice's shares never change. Read by ``selectors.billing.key_breakdown``.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import ROUND_FLOOR, Decimal

from marketplace.models import InvoiceLine, InvoiceLineKey

from .rating import Draft
from .units import CENT


def split_cents(amount: Decimal, weights: dict[str, int]) -> dict[str, Decimal]:
    """`amount` (to the cent, not negative) over `weights` (tokens, positive), by largest remainder."""
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("a split needs at least one positive weight")
    cents = int((amount / CENT).to_integral_value())
    if Decimal(cents) * CENT != amount or cents < 0:
        raise ValueError(f"{amount} is not a non-negative amount in cents")
    floors, rest = {}, []
    for key, w in weights.items():
        exact = Decimal(cents) * w / total
        floors[key] = int(exact.to_integral_value(rounding=ROUND_FLOOR))
        rest.append((exact - floors[key], w, key))
    left = cents - sum(floors.values())
    for _, _, key in sorted(rest, key=lambda r: (-r[0], -r[1], r[2]))[:left]:
        floors[key] += 1
    return {key: Decimal(c) * CENT for key, c in floors.items()}


def shares(line: InvoiceLine, draft: Draft) -> list[InvoiceLineKey]:
    if not draft.keys or line.amount < 0:
        return []
    kept = {k: t for k, t in draft.keys.items() if t > 0}
    if not kept:
        return []
    return [InvoiceLineKey(line=line, api_key=key, tokens=kept[key], amount=amount)
            for key, amount in sorted(split_cents(line.amount, kept).items())]


def write_shares(lines: Iterable[InvoiceLine], drafts: Iterable[Draft]) -> None:
    """The key shares of freshly written `lines` (in the order of the `drafts` they were made from)."""
    InvoiceLineKey.objects.bulk_create([s for line, d in zip(lines, drafts, strict=True) for s in shares(line, d)])
