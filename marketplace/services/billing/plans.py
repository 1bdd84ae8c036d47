"""Prices in force: a plan is in force for its tier, plan kind and currency from its `effective_from` until the
next plan of the same tier, kind and currency starts (marketplace.models.offers).

The rule is `in_force` (Python). Its copies, each held equal to it by the property test
tests/unit/test_price_in_force.py:

* `PlanBook.at` and `PlanBook.spans`: the rule over a book sorted once per rating run, at an instant and over an
  interval (slice-hours are split where the plan in force changes);
* `PlanBook.case` and `PlanBook.token_money`: a SECOND COPY in SQL (conditions from `PlanBook._in_force`), kept for
  speed: the database groups and prices the hourly rollups by the plan in force instead of returning every hour;
* `marketplace.services.orders.plan_in_force`: the ORM's (latest `effective_from` at or before the time), for one
  tier, kind and currency when an order is placed.

Tokens are priced at the plan in force at the instant they were served (their usage event's `ts`). The hourly
rollups stand for their events wherever no plan starts inside the hour (then every instant of the hour has the
plan in force at its start); the few **split hours** (`PlanBook.split_hours`: a plan of the book starts after the
hour's start) are priced from their events instead (billing.rating.token_groups, billing.spread.token_sums). Late
usage of a split hour (tokens that arrived after its month was finalized) cannot be told apart from the events
already billed: it is priced at the plan in force at the hour's end (`PlanBook.rollup_case`), which always exists.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import Case, DecimalField, F, IntegerField, Q, Value, When
from django.db.models.functions import Cast

from marketplace.models import PricePlan

from .units import MILLION

HOUR = timedelta(hours=1)


def hour_of(t: datetime) -> datetime:
    """The start of the UTC hour that holds t."""
    return t.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def in_force(plans: Iterable[PricePlan], at: datetime) -> dict[tuple[str, str], PricePlan]:
    """THE rule: among `plans` (one tier's, in any order, e.g. prefetched newest first), the plan in force at `at`
    per (kind, currency): the one with the latest `effective_from` at or before `at`. A (kind, currency) without
    one is absent: no price in force there (the rating alerts; never a silent 0)."""
    out: dict[tuple[str, str], PricePlan] = {}
    for p in plans:
        if p.effective_from <= at:
            best = out.get((p.kind, p.currency))
            if best is None or p.effective_from > best.effective_from:
                out[(p.kind, p.currency)] = p
    return out


class PlanBook:
    """The plans of one currency, loaded once per rating run; answers 'which plan at time t' (`at`, `case`) and
    'which plans over [a, b)' (`spans`), each by `in_force`'s rule."""

    def __init__(self, currency: str, plans: list[PricePlan] | None = None):
        self.currency = currency
        self.by_key: dict[tuple[int, str], list[PricePlan]] = defaultdict(list)
        self.by_pk: dict[int, PricePlan] = {}
        if plans is None:
            plans = list(PricePlan.objects.filter(currency=currency).order_by("effective_from", "pk"))
        for p in plans:
            self.by_key[(p.tier_id, p.kind)].append(p)
            self.by_pk[p.pk] = p

    @classmethod
    def many(cls, currencies: set[str]) -> dict[str, PlanBook]:
        """A book per currency, from one query."""
        plans: dict[str, list[PricePlan]] = {c: [] for c in currencies}
        for p in PricePlan.objects.filter(currency__in=currencies).order_by("effective_from", "pk"):
            plans[p.currency].append(p)
        return {c: cls(c, ps) for c, ps in plans.items()}

    def split_hours(self) -> list[datetime]:
        """The UTC hours in which a plan of this book starts after the hour's start: their tokens are priced at
        two plans (or none, then one), so they are priced from their usage events, not from the hourly rollups."""
        return sorted({hour_of(p.effective_from) for p in self.by_pk.values()
                       if hour_of(p.effective_from) != p.effective_from})

    def rollup_case(self, tier: str, kind: str, late_before: datetime) -> Case:
        """`case` at an hourly rollup's `hour`, except for a late rollup (its hour before `late_before`: usage of a
        finalized month billed later) of a split hour: the plan in force at that hour's end (its last instant),
        which always exists, so that late usage of the hour in which a tier's first plan started is priced."""
        late = {}  # only where a plan of the row's tier and kind starts inside the hour (elsewhere: the same plan)
        for (tier_id, plan_kind), plans in self.by_key.items():
            for h in {hour_of(p.effective_from) for p in plans}:
                if h < late_before and (h, tier_id, plan_kind) not in late:
                    p = in_force(plans, h + HOUR - timedelta(microseconds=1)).get((plan_kind, self.currency))
                    if p is not None and p.effective_from > h:
                        late[(h, tier_id, plan_kind)] = When(Q(hour=h, **{tier: tier_id, kind: plan_kind}),
                                                             then=Value(p.pk))
        whens = [When(cond, then=Value(p.pk)) for p, cond in self._in_force(tier, kind, "hour")]
        return Case(*late.values(), *whens, default=Value(None), output_field=IntegerField())

    def plan(self, pk: int | None) -> PricePlan | None:
        return self.by_pk.get(pk) if pk is not None else None

    def case(self, tier: str, kind: str, at: str) -> Case:
        """A SQL expression: the pk of the plan in force for the row's tier and plan kind at its time `at`
        (null: no price in force). A SECOND COPY of `in_force` in SQL (see the module docstring), for the database
        to group by."""
        whens = [When(cond, then=Value(p.pk)) for p, cond in self._in_force(tier, kind, at)]
        return Case(*whens, default=Value(None), output_field=IntegerField())

    def _in_force(self, tier: str, kind: str, at: str) -> Iterator[tuple[PricePlan, Q]]:
        """Each plan and the condition on a row's tier, plan kind and time `at` under which it is in force: from
        its start until the next plan of its tier and kind in this book starts (`in_force`'s rule, in SQL)."""
        for (tier_id, plan_kind), plans in self.by_key.items():
            for i, p in enumerate(plans):
                span = {f"{at}__gte": p.effective_from}
                if i + 1 < len(plans):
                    span[f"{at}__lt"] = plans[i + 1].effective_from
                yield p, Q(**{tier: tier_id, kind: plan_kind, **span})

    def token_money(self, tier: str, kind: str, at: str) -> tuple[Case, Decimal]:
        """A SQL expression and its divisor: the row's tokens priced at the plan in force for its tier and
        plan kind at its time `at` (the plan `case` picks), input_tokens x the input price + output_tokens x
        the output price, null when no price is in force. The prices are whole numbers (x 10**places), never
        floats: PostgreSQL multiplies and sums them as numeric (exact, unbounded); SQLite as 64-bit integers,
        where a product past 2**63 (some 1e12 tokens in one rollup row at 10 per 1M) turns into a float, which
        the caller refuses. The money is the sum / divisor (divisor: 10**places x 1M tokens)."""
        prices = [x for p in self.by_pk.values() for x in (p.price_per_1m_input_tokens, p.price_per_1m_output_tokens)]
        places = max([0, *(-int(x.as_tuple().exponent) for x in prices)])
        scale = Decimal(10) ** places
        whens = [When(cond, then=F("input_tokens") * Value(Decimal(int(p.price_per_1m_input_tokens * scale)))
                      + F("output_tokens") * Value(Decimal(int(p.price_per_1m_output_tokens * scale))))
                 for p, cond in self._in_force(tier, kind, at)]
        # the default a typed NULL: a currency without plans makes a CASE of no WHEN, which PostgreSQL would not sum
        nothing = Cast(Value(None), output_field=DecimalField(max_digits=65, decimal_places=0))
        return Case(*whens, default=nothing, output_field=DecimalField()), scale * MILLION

    def at(self, tier_id: int, kind: str, t: datetime) -> PricePlan | None:
        """The plan in force for a tier and plan kind at `t` (`in_force`)."""
        return in_force(self.by_key.get((tier_id, kind), ()), t).get((kind, self.currency))

    def spans(self, tier_id: int, kind: str, a: datetime, b: datetime) -> list[tuple[PricePlan, datetime, datetime]]:
        """[a, b) cut where the plan in force changes: (plan, from, to) for each part with a plan in force (`at` of
        every instant of the part is its plan); the parts before the first plan starts are left out."""
        plans = self.by_key.get((tier_id, kind), [])
        out = []
        for i, p in enumerate(plans):
            p_to = plans[i + 1].effective_from if i + 1 < len(plans) else b
            lo, hi = max(a, p.effective_from), min(b, p_to)
            if lo < hi:
                out.append((p, lo, hi))
        return out


def list_price_per_hour(plan: PricePlan, slices: float, tokens_per_hour: float, input_share: float) -> float:
    """What `slices` slices serving `tokens_per_hour` cost a tenant per hour at `plan` (the planner's list
    price): the same per-unit prices the rating charges, slice-hours plus input and output tokens."""
    per_token = (Decimal(str(input_share)) * plan.price_per_1m_input_tokens
                 + (1 - Decimal(str(input_share))) * plan.price_per_1m_output_tokens) / MILLION
    return float(Decimal(str(slices)) * plan.price_per_slice_hour + Decimal(str(tokens_per_hour)) * per_token)
