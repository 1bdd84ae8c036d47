"""Rating and invoices.

Rating turns what a tenant used in a calendar month into priced lines, with the plan that was in
force at the time of each use: slice-hours of its allocations while active (per second, split at
every price change) and input/output tokens of its deployments per hour, each LoRA adapter on its own
line (from the hourly rollups, never the raw events). A draft is re-rated whenever asked; finalizing it
(once the month is over) numbers it, freezes it, and marks the rolled-up usage it charged as billed. Usage that arrives
later for a finalized month goes onto the next invoice as adjustment lines.

Reserved plans carry a monthly commitment (`PricePlan.monthly_commit`, a minimum billed per month).
It is owed per tenant, month and reserved plan (one plan row: tier, currency, from its
`effective_from` to the next price change), only by a tenant that held reserved capacity on that
tier, and only for the time it held it:

* held: the union of the active spans (the very spans slice-hours are billed for) of the tenant's
  allocations whose order chose `plan_kind="reserved"` on the tier. Two reserved slices held at
  once owe one commitment, not two; an order never activated owes nothing.
* owed for plan P in the month: ``money(P.monthly_commit * held seconds while P was in force in
  the month / seconds in the calendar month)``. A whole month held owes exactly the commitment;
  a start, a release or a price change mid-month pro-rates it (each plan its own share).
* charged under P: the month's own slice-hour and token lines rated at P (rounded amounts), i.e.
  usage of reserved allocations while P was in force. On-demand lines, other tiers and
  adjustment lines (late usage of a finalized month) never count.
* if charged < owed, one line of kind ``commitment_topup`` for the difference (quantity 1, unit
  "top-up", unit price = amount), with the calculation in its description; else no line. So a
  plan's lines plus its top-up sum to exactly what was owed.

A draft accrues the commitment up to `now` (month to date), so spend limits see it too. Re-rating
replaces every line, so a draft never holds two top-ups for one plan. The top-up of a month is
settled when its invoice is finalized and never revisited: late usage of that month is charged in
full on a later invoice as adjustment lines, counts toward no later month's commitment, and
re-bills no commitment. Late usage at a reserved plan that would have lowered the settled top-up is
credited instead (`commitment_credits`: a negative line, never more than the top-up less earlier credits).

Credit notes (`issue_credit_note`): an operator corrects a finalized invoice (which never changes) with a
numbered, immutable credit note; its corrected charges ride on the next invoice as `correction` lines.

Currency: an invoice is rated in its own `currency`, fixed when the invoice is created (the tenant's
billing currency then); an operator's change of the tenant's currency applies from the next period.
Usage or held capacity with no plan in the invoice's currency is never a silent 0: it is listed in
`Rated.unpriced`, raises a BillingAlert and blocks finalization until a plan covers it.

Reads never write: `spend_status` rates in memory; drafts are stored by the beat
(`rate_all`) and by an explicit refresh. Every tenant with usage or held capacity in a month gets that
month's invoice (`ensure_invoices`, run by the beat before month-end finalization).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from functools import lru_cache

from django.db import connections, transaction
from django.db.models import (
    Aggregate,
    BigIntegerField,
    BooleanField,
    Case,
    Count,
    DateTimeField,
    DecimalField,
    F,
    IntegerField,
    Max,
    Min,
    Q,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Cast, Coalesce, Greatest, Least, TruncMonth
from django.utils import timezone

from marketplace import enqueue
from marketplace.models import (
    Allocation,
    BillingAlert,
    Invoice,
    InvoiceLine,
    InvoiceSequence,
    ModelDeployment,
    PricePlan,
    RatingRun,
    RatingRunTenant,
    SpendNotice,
    Tier,
)
from marketplace.services.dbretry import retry_on_conflict
from telemetry.models import UsageHourly
from telemetry.sqlbuckets import EpochBucket
from tenants import audit
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.models import Tenant

log = logging.getLogger("tessera.billing")
CENT = Decimal("0.01")
MILLION = Decimal(1_000_000)
QTY = Decimal("0.000001")
L = InvoiceLine.Kind
USAGE_KINDS = (L.SLICE_HOURS, L.INPUT_TOKENS, L.OUTPUT_TOKENS)  # what counts toward a commitment


class SpendLimitReached(ServiceError):
    status_code = 409


def month_of(d: date | datetime) -> date:
    return date(d.year, d.month, 1)


def next_month(d: date) -> date:
    return date(d.year + (d.month == 12), d.month % 12 + 1, 1)


def bounds(period_start: date) -> tuple[datetime, datetime]:
    start = datetime(period_start.year, period_start.month, 1, tzinfo=UTC)
    end_d = next_month(period_start)
    return start, datetime(end_d.year, end_d.month, 1, tzinfo=UTC)


def money(x: Decimal) -> Decimal:
    return x.quantize(CENT, rounding=ROUND_HALF_UP)


def seconds(td: timedelta) -> Decimal:
    """A duration in seconds, exactly (no float)."""
    return Decimal(td.days * 86_400 + td.seconds) + Decimal(td.microseconds) / 1_000_000


# --- prices in force ---------------------------------------------------------------------------

class PlanBook:
    """The plans of one currency, loaded once per rating run; answers 'which plan at time t' and
    'which plans over [a, b)'."""

    def __init__(self, currency: str, plans: list[PricePlan] | None = None):
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

    def plan(self, pk: int | None) -> PricePlan | None:
        return self.by_pk.get(pk) if pk is not None else None

    def case(self, tier: str, kind: str, at: str) -> Case:
        """A SQL expression: the pk of the plan in force for the row's tier and plan kind at its time `at`
        (null: no price in force). The same rule as `at`, for the database to group by."""
        whens = [When(cond, then=Value(p.pk)) for p, cond in self._in_force(tier, kind, at)]
        return Case(*whens, default=Value(None), output_field=IntegerField())

    def _in_force(self, tier: str, kind: str, at: str) -> Iterator[tuple[PricePlan, Q]]:
        """Each plan and the condition on a row's tier, plan kind and time `at` under which it is in force."""
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
        found = None
        for p in self.by_key.get((tier_id, kind), ()):
            if p.effective_from <= t:
                found = p
            else:
                break
        return found

    def spans(self, tier_id: int, kind: str, a: datetime, b: datetime) -> list[tuple[PricePlan, datetime, datetime]]:
        plans = self.by_key.get((tier_id, kind), [])
        out = []
        for i, p in enumerate(plans):
            p_to = plans[i + 1].effective_from if i + 1 < len(plans) else b
            lo, hi = max(a, p.effective_from), min(b, p_to)
            if lo < hi:
                out.append((p, lo, hi))
        return out


# --- rating -------------------------------------------------------------------------------------

@dataclass
class Draft:
    kind: str
    tier: Tier
    plan: PricePlan
    description: str
    unit: str
    quantity: Decimal = Decimal(0)
    usage_from: datetime | None = None
    usage_to: datetime | None = None
    allocation_id: int | None = None
    deployment_id: int | None = None
    price: Decimal | None = None  # a fixed unit price (commitment top-up); else the plan's price for the kind
    rows: list[int] = field(default_factory=list)
    pieces: list[tuple[datetime, datetime, Decimal]] = field(default_factory=list)  # (from, to, quantity)

    def add(self, q: Decimal, a: datetime, b: datetime) -> None:
        self.pieces.append((a, b, q))
        self.quantity += q
        self.usage_from = a if self.usage_from is None else min(self.usage_from, a)
        self.usage_to = b if self.usage_to is None else max(self.usage_to, b)

    @property
    def unit_price(self) -> Decimal:
        if self.price is not None:
            return self.price
        if self.kind == L.SLICE_HOURS:
            return self.plan.price_per_slice_hour
        if self.kind in (L.INPUT_TOKENS, L.ADJUSTMENT_INPUT):
            return self.plan.price_per_1m_input_tokens
        return self.plan.price_per_1m_output_tokens

    @property
    def rounded_quantity(self) -> Decimal:
        return self.quantity.quantize(QTY, rounding=ROUND_HALF_UP)

    @property
    def amount(self) -> Decimal:
        """What the line will charge: rounded quantity times unit price, rounded to the cent."""
        return money(self.rounded_quantity * self.unit_price)

    def line(self, invoice: Invoice) -> InvoiceLine:
        if self.usage_from is None or self.usage_to is None:  # every draft is made with its first piece
            raise ValueError(f"draft {self.description!r} has no usage span")
        return InvoiceLine(invoice=invoice, kind=self.kind, tier=self.tier, plan=self.plan,
                           allocation_id=self.allocation_id, deployment_id=self.deployment_id,
                           description=self.description[:300], quantity=self.rounded_quantity, unit=self.unit,
                           unit_price=self.unit_price, amount=self.amount,
                           usage_from=self.usage_from, usage_to=self.usage_to)


@dataclass
class Rated:
    drafts: list[Draft]
    usage_rows: QuerySet  # the UsageHourly rows rated (this month's and late ones); all charged when all priced
    currency: str = "USD"
    unpriced: list[str] = field(default_factory=list)  # usage or capacity with no plan in `currency`

    @property
    def total(self) -> Decimal:
        return sum((d.amount for d in self.drafts), Decimal(0))


Pieces = tuple[int, datetime, datetime]


def _piece(pieces: Pieces) -> Case:
    """SQL: the piece of an hourly row (see token_groups)."""
    step, lo, hi = pieces
    hour = timedelta(hours=1)
    minus = Value(-1, output_field=BigIntegerField())
    return Case(When(hour__lt=lo - hour, then=Value(-1)), When(hour__gte=hi + hour, then=Value(-2)),
                When(Q(hour__lt=lo) | Q(hour__gte=hi), then=EpochBucket("hour", 3600) * minus),  # -(its epoch)
                default=EpochBucket("hour", step), output_field=BigIntegerField())


TIER, PLAN_KIND = "deployment__allocation__tier_id", "deployment__allocation__order__plan_kind"


def token_groups(rows: QuerySet, book: PlanBook, month_start: datetime, pieces: Pieces | None = None, *,
                 by_tenant: bool = False, by_deployment: bool = True):
    """UsageHourly `rows` summed by the database per (deployment, adapter, tier, plan kind, plan in force,
    late: before `month_start`, month[, piece]): the rating's token input, however many hours there are.
    pieces = (step, lo, hi): also per UTC time bucket of `step` seconds inside [lo, hi), each hour a period's
    edges cut (just outside [lo, hi)) its own piece (-its epoch), and the hours before and after in one
    piece each (-1, -2). Yields dicts with the sums, first/last hour and the number of hours.
    by_deployment=False: only the token sums per tier, plan kind, plan in force[, tenant][, piece] (what
    spreading a month's lines over time needs; `rows` within one month)."""
    qs = rows.annotate(plan_id=book.case(TIER, PLAN_KIND, "hour"))
    keys = [TIER, PLAN_KIND, "plan_id"] + (["tenant_id"] if by_tenant else [])
    sums: dict[str, Aggregate] = {"input_tokens": Sum("input_tokens"), "output_tokens": Sum("output_tokens")}
    if by_deployment:  # what an invoice needs besides: the line keys, late usage, what was billed before
        qs = qs.annotate(
            late=Case(When(hour__lt=month_start, then=Value(True)), default=Value(False), output_field=BooleanField()),
            month=TruncMonth("hour", tzinfo=UTC))
        keys = ["deployment_id", "adapter", *keys, "late", "month"]
        sums.update(billed_input_tokens=Sum("billed_input_tokens"), billed_output_tokens=Sum("billed_output_tokens"),
                    requests=Sum("requests"), first=Min("hour"), last=Max("hour"), hours=Count("pk"))
    if pieces:
        qs = qs.annotate(piece=_piece(pieces))
        keys.append("piece")
    for g in qs.values(*keys).annotate(**sums).order_by(*keys):
        g["tier_id"], g["plan_kind"] = g.pop(TIER), g.pop(PLAN_KIND)
        yield g


def period_currency(tenant: Tenant, period_start: date) -> str:
    """The currency a period is billed in: its invoice's, else (no invoice yet) the tenant's."""
    found = Invoice.objects.filter(tenant=tenant, period_start=period_start).values_list("currency", flat=True).first()
    return found or tenant.currency


@dataclass
class MonthInputs:
    """What rating one tenant-month reads: its currency's plan book, the allocations active in the month,
    and its hourly usage summed per line key (token_groups) with the tiers and model names they name."""

    currency: str
    book: PlanBook
    allocs: list[Held]
    groups: list[dict]
    tiers: dict[int, Tier]
    names: dict[int, str]


@dataclass(frozen=True)
class Held:
    """An allocation as rating sees it: its tier and plan kind, and when it was active (stopped: released,
    or failed at its last change; None: still active)."""

    tier_id: int
    plan_kind: str
    activated_at: datetime
    stopped_at: datetime | None


def _held(allocations: QuerySet) -> Iterator[tuple[int, Held]]:
    """(tenant id, Held) of each allocation: one query, no model instances."""
    for tenant_id, tier_id, kind, state, activated, released, updated in allocations.values_list(
            "tenant_id", "tier_id", "order__plan_kind", "state", "activated_at", "released_at", "updated_at"):
        yield tenant_id, Held(tier_id, kind, activated,
                              released or (updated if state == Allocation.State.FAILED else None))


def _held_spans(allocations: QuerySet, lo: datetime, hi: datetime, now: datetime
                ) -> list[tuple[int, int, str, datetime, datetime, int]]:
    """(tenant id, tier id, plan kind, from, to, how many) of `allocations`: each one's active time (`Held`:
    activated until stopped, else `now`) clipped to [lo, hi) by the database, the allocations with the same
    tenant, tier, plan kind and clipped span counted as one row (to <= from: none of it inside)."""
    stopped = Coalesce("released_at", Case(When(state=Allocation.State.FAILED, then=F("updated_at"))), Value(now),
                       output_field=DateTimeField())
    return list(allocations.annotate(a_from=Greatest("activated_at", Value(lo), output_field=DateTimeField()),
                                     a_to=Least(stopped, Value(hi), output_field=DateTimeField()))
                .values_list("tenant_id", "tier_id", "order__plan_kind", "a_from", "a_to")
                .annotate(n=Count("pk")).order_by())


def _times_hours(per_hour: Decimal, td: timedelta) -> Decimal:
    """per_hour x the hours of td, exactly as per_hour x seconds / 3600 (a whole number of hours: one product)."""
    if not td.microseconds and not td.seconds % 3600:
        return per_hour * (td.days * 24 + td.seconds // 3600)
    return per_hour * seconds(td) / 3600


def _active_allocations(start: datetime, end: datetime, now: datetime) -> QuerySet:
    return (Allocation.objects.filter(activated_at__isnull=False, activated_at__lt=min(end, now))
            .filter(Q(released_at__isnull=True) | Q(released_at__gt=start)))


def rate(tenant: Tenant, period_start: date, now: datetime | None = None, currency: str | None = None,
         invoice_id: int | None = None, pieces: Pieces | None = None) -> Rated:
    """Price a tenant's month (pure: reads only). currency: the invoice's (default: the period's);
    invoice_id: the invoice being rated (its own credits and corrections are not counted as given);
    pieces: (step, lo, hi): token lines keep their quantity per UTC time bucket of `step` seconds, and per
    hour outside [lo, hi), so that `amount_between` is exact for [lo, hi) and buckets of that step inside
    it (the charts); default: one piece per line (invoices need none)."""
    now = now or timezone.now()
    start, end = bounds(period_start)
    currency = currency or period_currency(tenant, period_start)
    book = PlanBook(currency)
    allocs = [h for _, h in _held(_active_allocations(start, end, now).filter(tenant=tenant))]
    # tokens: this month's hourly rollups, plus late usage of finalized months (adjustments)
    finalized = list(Invoice.objects.filter(tenant=tenant, status=Invoice.Status.FINALIZED,
                                            period_start__lt=period_start).values_list("period_start", flat=True))
    late = Q()
    for p in finalized:
        p_start, p_end = bounds(p)
        late |= Q(hour__gte=p_start, hour__lt=p_end)
    this_month = Q(hour__gte=start, hour__lt=end)
    pending_late = Q(input_tokens__gt=F("billed_input_tokens")) | Q(output_tokens__gt=F("billed_output_tokens"))
    rows = UsageHourly.objects.filter(tenant=tenant).filter(this_month | (late & pending_late) if finalized
                                                             else this_month)
    groups = list(token_groups(rows, book, start, pieces))
    tiers = Tier.objects.in_bulk({g["tier_id"] for g in groups} | {a.tier_id for a in allocs})
    names = dict(ModelDeployment.objects.filter(pk__in={g["deployment_id"] for g in groups})
                 .values_list("pk", "name"))
    drafts, unpriced, late_reserved = rate_month(MonthInputs(currency, book, allocs, groups, tiers, names),
                                                 start, end, now)
    drafts += commitment_credits(tenant, late_reserved, invoice_id)
    drafts += corrections(tenant, period_start, invoice_id)
    return Rated(drafts, rows, currency, unpriced)


def rate_month(inp: MonthInputs, start: datetime, end: datetime, now: datetime
               ) -> tuple[list[Draft], list[str], dict[tuple[date, int], Decimal]]:
    """The rating rule itself (no queries): slice-hours of every allocation while active, per second,
    each plan span at its own price; tokens at the plan in force at their hour (late usage of finalized
    months as adjustments); reserved commitments topped up. Returns the month's drafts, what had no
    price, and late usage at reserved plans per (month, plan) for the commitment credits."""
    book, currency = inp.book, inp.currency
    unpriced: dict[str, None] = {}
    drafts: dict[tuple, Draft] = {}
    held: dict[int, list[tuple[datetime, datetime]]] = defaultdict(list)  # reserved capacity held, per tier
    for a in inp.allocs:
        tier = inp.tiers[a.tier_id]
        a_from, a_to = max(a.activated_at, start), min(a.stopped_at or now, end, now)
        if a.plan_kind == PricePlan.Kind.RESERVED and a_from < a_to:
            held[a.tier_id].append((a_from, a_to))
        spans = book.spans(a.tier_id, a.plan_kind, a_from, a_to)
        if a_from < a_to and sum((hi - lo for _, lo, hi in spans), timedelta(0)) < a_to - a_from:
            unpriced[f"{tier.name}: {a.plan_kind} slice-hours with no {currency} price in force"] = None
        for span_plan, lo, hi in spans:
            key = (L.SLICE_HOURS, a.tier_id, span_plan.pk)
            d = drafts.get(key) or drafts.setdefault(key, Draft(
                L.SLICE_HOURS, tier, span_plan, f"{tier.name}: slice-hours at {span_plan.price_per_slice_hour}/h "
                f"({span_plan.get_kind_display().lower()})", "hour"))
            d.add(Decimal((hi - lo).total_seconds()) / 3600, lo, hi)
    late_reserved: dict[tuple[date, int], Decimal] = defaultdict(Decimal)
    for g in inp.groups:
        tier, plan = inp.tiers[g["tier_id"]], book.plan(g["plan_id"])
        if plan is None:
            log.warning("usage without a price in force", extra={"tier": g["tier_id"], "hours": g["hours"]})
            unpriced[f"{tier.name}: {g['plan_kind']} tokens with no {currency} price in force"] = None
            continue
        is_late = g["late"]
        ins, outs = (g["input_tokens"] - g["billed_input_tokens"], g["output_tokens"] - g["billed_output_tokens"]) \
            if is_late else (g["input_tokens"], g["output_tokens"])
        if is_late and plan.kind == PricePlan.Kind.RESERVED:
            late_reserved[(month_of(g["first"]), plan.pk)] += (
                Decimal(max(ins, 0)) * plan.price_per_1m_input_tokens
                + Decimal(max(outs, 0)) * plan.price_per_1m_output_tokens) / MILLION
        for kind, tokens in (((L.ADJUSTMENT_INPUT, ins), (L.ADJUSTMENT_OUTPUT, outs)) if is_late
                             else ((L.INPUT_TOKENS, ins), (L.OUTPUT_TOKENS, outs))):
            if tokens <= 0:
                continue
            line_key = (kind, tier.pk, plan.pk, g["deployment_id"], g["adapter"])  # a LoRA adapter: its own line
            what = "input" if kind in (L.INPUT_TOKENS, L.ADJUSTMENT_INPUT) else "output"
            prefix = "late usage from a finalized month: " if is_late else ""
            name = inp.names.get(g["deployment_id"], "")
            served = f"LoRA adapter {g['adapter']} of {name}" if g["adapter"] else name
            d = drafts.get(line_key) or drafts.setdefault(line_key, Draft(
                kind, tier, plan, f"{prefix}{served} on {tier.name}: {what} tokens (per 1M)",
                "1M tokens", deployment_id=g["deployment_id"]))
            d.add(Decimal(tokens) / MILLION, g["first"], g["last"] + timedelta(hours=1))
    out = list(drafts.values())
    out += commitment_topups(book, held, out, start, end)
    return out, list(unpriced), late_reserved


def _month_books(tenants: list[Tenant], period_start: date) -> tuple[dict[int, str], dict[str, PlanBook]]:
    """Each tenant's currency for the month (its invoice's, else its own) and a plan book per currency."""
    ids = [t.pk for t in tenants]
    invoiced = dict(Invoice.objects.filter(tenant_id__in=ids, period_start=period_start)
                    .values_list("tenant_id", "currency"))
    currency = {t.pk: invoiced.get(t.pk) or t.currency for t in tenants}
    return currency, PlanBook.many(set(currency.values()))


def rate_months_many(tenants: list[Tenant], period_start: date, now: datetime,
                     pieces: Pieces | None = None, *, tokens: Q | None = None,
                     month_books: tuple[dict[int, str], dict[str, PlanBook]] | None = None
                     ) -> dict[int, tuple[list[Draft], str]]:
    """The month's own lines (no adjustments, credits or corrections: what the charts count) of many
    tenants, each rated by `rate_month` exactly as its invoice is, in its invoice's currency, with a
    fixed number of queries: one per currency in use for the usage, plus a handful. tokens: only the
    usage rows it matches are rated (default: all). month_books: `_month_books` of the month, when already read."""
    start, end = bounds(period_start)
    ids = [t.pk for t in tenants]
    currency, books = month_books or _month_books(tenants, period_start)
    allocs: dict[int, list[Held]] = defaultdict(list)
    for tenant_id, h in _held(_active_allocations(start, end, now).filter(tenant_id__in=ids)):
        allocs[tenant_id].append(h)
    groups: dict[int, list[dict]] = defaultdict(list)
    for cur, book in books.items():
        mine = [t for t in ids if currency[t] == cur]
        rows = UsageHourly.objects.filter(tenant_id__in=mine, hour__gte=start, hour__lt=end)
        for g in token_groups(rows if tokens is None else rows.filter(tokens), book, start, pieces, by_tenant=True):
            groups[g.pop("tenant_id")].append(g)
    every = [g for gs in groups.values() for g in gs]
    tiers = Tier.objects.in_bulk({g["tier_id"] for g in every} | {a.tier_id for al in allocs.values() for a in al})
    names = dict(ModelDeployment.objects.filter(pk__in={g["deployment_id"] for g in every})
                 .values_list("pk", "name"))
    out = {}
    for t in ids:
        cur = currency[t]
        drafts, _unpriced, _late = rate_month(MonthInputs(cur, books[cur], allocs[t], groups[t], tiers, names),
                                              start, end, now)
        out[t] = (drafts, cur)
    return out


def commitment_credits(tenant: Tenant, late_reserved: dict[tuple[date, int], Decimal],
                       invoice_id: int | None) -> list[Draft]:
    """Late usage of a finalized month at a reserved plan would have counted toward that month's
    commitment: it is charged in full (adjustment lines) and the settled top-up is credited by as much,
    never more than the top-up less the credits already given on other invoices (one negative line per
    month and plan, kind commitment_credit)."""
    out = []
    for (month, plan_pk), late_amount in sorted(late_reserved.items()):
        m_start, m_end = bounds(month)
        topup = (InvoiceLine.objects.filter(invoice__tenant=tenant, invoice__period_start=month,
                                            invoice__status=Invoice.Status.FINALIZED, kind=L.COMMITMENT_TOPUP,
                                            plan_id=plan_pk).select_related("plan", "tier").first())
        if topup is None:
            continue
        credit_lines = InvoiceLine.objects.filter(
            invoice__tenant=tenant, invoice__status=Invoice.Status.FINALIZED, kind=L.COMMITMENT_CREDIT,
            plan_id=plan_pk, usage_from=m_start)
        if invoice_id is not None:  # (no invoice yet: nothing of its own to leave out)
            credit_lines = credit_lines.exclude(invoice_id=invoice_id)
        given = -sum((li.amount for li in credit_lines), Decimal(0))
        credit = min(money(late_amount), topup.amount - given)
        if credit <= 0:
            continue
        d = Draft(L.COMMITMENT_CREDIT, topup.tier, topup.plan,
                  f"{topup.tier.name}: late usage of {month:%Y-%m} at the reserved plan counts toward that month's "
                  f"commitment: credit against its top-up of {topup.amount} ({given} credited before)",
                  "credit", price=-credit)
        d.add(Decimal(1), m_start, m_end)
        out.append(d)
    return out


def corrections(tenant: Tenant, period_start: date, invoice_id: int | None) -> list[Draft]:
    """The corrected charges of credit notes on earlier invoices not yet carried by a finalized invoice
    (or carried by the one being rated): one `correction` line each."""
    from marketplace.models import CreditNote

    out = []
    notes = (CreditNote.objects.filter(tenant=tenant, invoice__period_start__lt=period_start)
             .filter(Q(recharged_on__isnull=True) | Q(recharged_on_id=invoice_id) if invoice_id
                     else Q(recharged_on__isnull=True))
             .select_related("invoice").prefetch_related("lines__invoice_line__tier", "lines__invoice_line__plan"))
    for cn in notes.order_by("pk"):
        first = next(iter(cn.lines.all()), None)
        if first is None:
            continue
        tier, plan = first.invoice_line.tier, first.invoice_line.plan
        for item in cn.recharge:
            d = Draft(L.CORRECTION, tier, plan, f"corrected charge of {cn.invoice.number} (credit note {cn.number}): "
                      f"{item['description']}", "charge", price=Decimal(item["amount"]))
            d.add(Decimal(1), *bounds(cn.invoice.period_start))
            d.rows.append(cn.pk)
            out.append(d)
    return out


ADJUSTMENT_KINDS = (L.ADJUSTMENT_INPUT, L.ADJUSTMENT_OUTPUT)
#: lines about another month's usage or another invoice: the charts count each month's own lines only
NOT_THIS_MONTH = (*ADJUSTMENT_KINDS, L.COMMITMENT_CREDIT, L.CORRECTION)


def rated_lines(tenant: Tenant, start: datetime, end: datetime, now: datetime | None = None,
                step: int = 10**9) -> list[tuple[Draft, str]]:
    """One tenant's `rated_lines_many`."""
    return rated_lines_many([tenant], start, end, now, step).get(tenant.pk, [])


def rated_lines_many(tenants: list[Tenant], start: datetime, end: datetime, now: datetime | None = None,
                     step: int = 10**9) -> dict[int, list[tuple[Draft, str]]]:
    """The one rating, for anything that prices use over [start, end) (the charts): each month it
    touches rated for each tenant exactly as its invoice is (the invoice's currency, reserved commitments
    included), as tenant id -> [(line, currency)], in a fixed number of queries per month. Adjustment
    lines are left out: late usage is counted in the month it happened (that month's own rating includes
    it). Spread a line over [start, end) or over UTC buckets of `step` seconds inside it with
    `amount_between` (exact: token pieces are cut there)."""
    now = now or timezone.now()
    lo, hi = _whole_hours(start, end)
    out: dict[int, list[tuple[Draft, str]]] = defaultdict(list)
    if not tenants:
        return out
    for m in _months(start, min(end, now)):
        _, m_end = bounds(m)
        for tid, (drafts, currency) in rate_months_many(tenants, m, min(now, m_end), (step, lo, hi)).items():
            out[tid].extend((d, currency) for d in drafts if d.kind not in NOT_THIS_MONTH)
    return out


TOKEN_KINDS = (L.INPUT_TOKENS, L.OUTPUT_TOKENS)


def spread_lines_many(tenants: list[Tenant], start: datetime, end: datetime, now: datetime | None = None,
                      step: int = 10**9) -> dict[int, list[tuple[Draft, str]]]:
    """`rated_lines_many` for charts, with a fixed number of queries per month whatever the fleet: the same
    month rating, but its token lines summed per tier and plan in force (a chart never shows a deployment's
    line) and cut into pieces from the hourly rollups near [start, end) only. Each month's token lines of
    reserved plans are still rated per line (they decide the commitment top-ups, on rounded amounts); the
    on-demand ones need no month total. `amount_between` and `amount_by_bucket` of what it returns equal
    those of `rated_lines_many` (token amounts are linear: the same tokens at the same plans)."""
    now = now or timezone.now()
    lo, hi = _whole_hours(start, end)
    hour = timedelta(hours=1)
    out: dict[int, list[tuple[Draft, str]]] = defaultdict(list)
    if not tenants:
        return out
    ids = [t.pk for t in tenants]
    reserved = Q(**{PLAN_KIND: PricePlan.Kind.RESERVED})
    for m in _months(start, min(end, now)):
        m_start, m_end = bounds(m)
        month = rate_months_many(tenants, m, min(now, m_end), tokens=reserved)
        for tid, (drafts, currency) in month.items():
            out[tid].extend((d, currency) for d in drafts if d.kind not in NOT_THIS_MONTH and d.kind not in TOKEN_KINDS)
        currency_of = {tid: cur for tid, (_, cur) in month.items()}
        books = PlanBook.many(set(currency_of.values()))
        groups: list[tuple[str, dict]] = []
        for cur, book in books.items():
            rows = UsageHourly.objects.filter(tenant_id__in=[t for t in ids if currency_of[t] == cur],
                                              hour__gte=max(m_start, lo - hour), hour__lt=min(m_end, hi + hour))
            groups += [(cur, g) for g in token_groups(rows, book, m_start, (step, lo, hi), by_tenant=True,
                                                      by_deployment=False)]
        tiers = Tier.objects.in_bulk({g["tier_id"] for _, g in groups})
        lines: dict[tuple, Draft] = {}
        for cur, g in groups:
            plan = books[cur].plan(g["plan_id"])
            if plan is None:  # no price in force: the invoice alerts; a chart has nothing to add
                continue
            for kind, tokens in ((L.INPUT_TOKENS, g["input_tokens"]), (L.OUTPUT_TOKENS, g["output_tokens"])):
                if tokens <= 0:
                    continue
                key = (g["tenant_id"], kind, plan.pk)
                d = lines.get(key)
                if d is None:
                    d = lines[key] = Draft(kind, tiers[g["tier_id"]], plan, "", "1M tokens")
                    out[g["tenant_id"]].append((d, cur))
                d.add(Decimal(tokens) / MILLION, *_piece_span(g["piece"], step, lo, hi))
    return out


#: what part of a tier's money a spread amount is (`spread_amounts`)
TOKENS, SLICES, COMMITMENT = "tokens", "slices", "commitment"
PART_OF: dict[str, str] = {L.SLICE_HOURS: SLICES, L.COMMITMENT_TOPUP: COMMITMENT}


@dataclass
class Spread:
    """What `spread_amounts` returns. money: (tenant id, currency, tier id, part, bucket start or None) ->
    amount (unrounded), part one of TOKENS, SLICES, COMMITMENT. used: (tenant id, currency, tier id, bucket
    start or None) -> [tokens, requests] of the hourly rollups whose hour is in [start, end), in the currency
    the tenant is billed in for that month. currency: tenant id -> the currency of its first month in the range."""

    money: dict[tuple, Decimal] = field(default_factory=lambda: defaultdict(Decimal))
    used: dict[tuple, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    currency: dict[int, str] = field(default_factory=dict)


def spread_amounts(tenants: list[Tenant], start: datetime, end: datetime, now: datetime | None = None,
                   step: int | None = None, *, by_tier: bool = True) -> Spread:
    """The charts' money, a second implementation of the linear part of the rating (`rate_month`), proven
    equal to the invoices' own lines by tests/unit/test_spread_amounts.py (property test) and
    test_one_rating.py: `amount_between` [start, end) (step None) or `amount_by_bucket` (UTC buckets of `step`
    seconds, a multiple of an hour) of the month's own lines (`rated_lines_many`), summed per tenant, currency,
    tier (None unless by_tier) and part, without building a line per deployment or token group.

    * tokens: priced straight from the database's sums per tenant, tier, plan in force and piece (tokens x the
      plan's prices, an edge hour in proportion to its time in [start, end));
    * slice-hours of tenants that hold no reserved capacity in the month: each allocation's active time (as
      `rate_month` clips it) split at the price changes (`PlanBook.spans`), swept per tenant as one price per
      hour that changes at span ends;
    * tenants holding reserved capacity: their slice-hours and commitment top-ups are the month rating's own
      lines (`rate_months_many`: a top-up depends on the whole month's rounded lines).

    The same products `Draft.amount` and `amount_between` compute, in another order. A fixed number of queries
    per month and currency."""
    now = now or timezone.now()
    lo, hi = _whole_hours(start, end)
    hour = timedelta(hours=1)
    out = Spread()
    if not tenants:
        return out
    ids = [t.pk for t in tenants]
    reserved = Q(**{PLAN_KIND: PricePlan.Kind.RESERVED})
    piece_step = step or 10**9
    bucket_td = timedelta(seconds=step) if step else None
    for m in _months(start, min(end, now)):
        m_start, m_end = bounds(m)
        m_now = min(now, m_end)
        currency_of, books = _month_books(tenants, m)
        for t in ids:
            out.currency.setdefault(t, currency_of[t])
        # the month's allocations, each clipped to the range (`rate_month`'s clip, then [start, end)) by the
        # database, and counted per tenant, tier, plan kind and clipped span (the same span: one row)
        held = _held_spans(_active_allocations(m_start, m_end, m_now).filter(tenant_id__in=ids),
                           max(m_start, start), min(m_end, m_now, end), m_now)
        committed = {tid for tid, _tier, kind, _a, _b, _n in held if kind == PricePlan.Kind.RESERVED}
        if committed:
            month = rate_months_many([t for t in tenants if t.pk in committed], m, m_now, tokens=reserved,
                                     month_books=(currency_of, books))
            for tid, (drafts, cur) in month.items():
                for d in drafts:
                    part = PART_OF.get(d.kind)
                    if part is None:  # token lines (spread below), adjustments, credits, corrections
                        continue
                    tier_key = d.tier.pk if by_tier else None
                    if bucket_td is None:
                        out.money[(tid, cur, tier_key, part, None)] += amount_between(d, start, end)
                    else:
                        for b, x in amount_by_bucket(d, start, end, bucket_td).items():
                            out.money[(tid, cur, tier_key, part, b)] += x
        # the others' slice-hours: the price per hour of what is held, changing at span ends
        changes: dict[tuple, dict[datetime, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
        for tid, tier_id, kind, a_from, a_to, n in held:
            if tid in committed or a_from >= a_to:
                continue
            cur = currency_of[tid]
            for plan, p_lo, p_hi in books[cur].spans(tier_id, kind, a_from, a_to):
                ch = changes[(tid, cur, tier_id if by_tier else None)]
                ch[p_lo] += plan.price_per_slice_hour * n
                ch[p_hi] -= plan.price_per_slice_hour * n
        for (tid, cur, tier_key), ch in changes.items():
            per_hour, times = Decimal(0), sorted(ch)
            for at, nxt in zip(times, times[1:], strict=False):
                per_hour += ch[at]
                if not per_hour:
                    continue
                if bucket_td is None:
                    out.money[(tid, cur, tier_key, SLICES, None)] += _times_hours(per_hour, nxt - at)
                    continue
                b, whole = _bucket_start(at, piece_step), None
                while at < nxt:  # bucket by bucket: a whole one costs per_hour x its hours
                    edge = min(nxt, b + bucket_td)
                    if edge - at == bucket_td:
                        whole = whole or _times_hours(per_hour, bucket_td)
                        out.money[(tid, cur, tier_key, SLICES, b)] += whole
                    else:
                        out.money[(tid, cur, tier_key, SLICES, b)] += _times_hours(per_hour, edge - at)
                    at, b = edge, b + bucket_td
        for cur, book in books.items():
            rows = UsageHourly.objects.filter(tenant_id__in=[t for t in ids if currency_of[t] == cur],
                                              hour__gte=max(m_start, lo - hour), hour__lt=min(m_end, hi + hour))
            # the database prices the tokens (the plan in force at each hour) and sums them per tenant[, tier]
            # and piece: one row per bucket, whatever the plans, deployments and hours
            priced, divisor = book.token_money(TIER, PLAN_KIND, "hour")
            keys = ["tenant_id", TIER] if by_tier else ["tenant_id"]
            qs = (rows.annotate(piece=_piece((piece_step, lo, hi))).values_list(*keys, "piece")
                  .annotate(i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests"), m=Sum(priced))
                  .order_by())
            acc, used = out.money, out.used
            of_piece: dict[int, tuple[datetime | None, bool, Decimal | None]] = {}
            for row in _raw_rows(qs):
                tid, piece, ins, outs, reqs, m = row[0], row[-5], row[-4], row[-3], row[-2], row[-1]
                tier_key = row[1] if by_tier else None
                known = of_piece.get(piece)
                if known is None:  # (bucket, inside the range, an edge hour's seconds inside it)
                    a, b = _piece_span(piece, piece_step, lo, hi)
                    known = of_piece[piece] = (None if bucket_td is None else _bucket_start(a, piece_step),
                                               start <= a < end,
                                               seconds(max(min(b, end) - max(a, start), timedelta(0)))
                                               if piece < 0 else None)
                bucket, inside, edge_s = known
                if inside:  # the hour (or bucket) is inside the range: its tokens are the range's
                    u = used[(tid, cur, tier_key, bucket)]
                    u[0] += int(ins + outs)
                    u[1] += int(reqs)
                if m is None:  # no price in force: the invoice alerts; a chart has nothing to add
                    continue
                if isinstance(m, float):  # (SQLite: an integer overflowed into a float)
                    raise ArithmeticError("token money overflowed the database's integers")
                amount = Decimal(m) / divisor
                if edge_s is not None:  # an edge hour: the part of it inside [start, end)
                    if not edge_s:
                        continue
                    amount = amount * edge_s / 3600
                acc[(tid, cur, tier_key, TOKENS, bucket)] += amount
    return out


def _raw_rows(qs: QuerySet) -> list[tuple]:
    """A values_list queryset's rows as the database driver returns them (no per-value converters: sums of
    integers and numerics only)."""
    sql, params = qs.query.get_compiler(using=qs.db).as_sql()
    with connections[qs.db].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


@lru_cache(maxsize=4096)
def _piece_span(piece: int, step: int, lo: datetime, hi: datetime) -> tuple[datetime, datetime]:
    """The time a piece of `_piece` covers: an edge hour's hour; an inner bucket's part of [lo, hi)."""
    if piece < 0:
        a = datetime.fromtimestamp(-piece, tz=UTC)
        return a, a + timedelta(hours=1)
    a = datetime.fromtimestamp(piece, tz=UTC)
    return max(a, lo), min(a + timedelta(seconds=step), hi)


def _whole_hours(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """[lo, hi): the whole UTC hours inside [start, end)."""
    lo = start.replace(minute=0, second=0, microsecond=0)
    return (lo if lo == start else lo + timedelta(hours=1)), end.replace(minute=0, second=0, microsecond=0)


def amount_between(d: Draft, lo: datetime, hi: datetime) -> Decimal:
    """The part of a line's amount (unrounded) that falls in [lo, hi): each piece's quantity in
    proportion to its time inside (a commitment top-up accrues over the time it covers)."""
    price, q = d.unit_price, Decimal(0)
    for a, b, qty in d.pieces:
        if b <= a:
            q += qty if lo <= a < hi else 0
            continue
        ov = min(b, hi) - max(a, lo)
        if ov > timedelta(0):
            q += qty * seconds(ov) / seconds(b - a)
    return q * price


@lru_cache(maxsize=4096)
def _bucket_start(t: datetime, step_s: int) -> datetime:
    """The start of the epoch-aligned UTC bucket of `step_s` seconds that holds t (a chart asks for the same
    few bucket edges thousands of times)."""
    e = int(t.timestamp())
    return datetime.fromtimestamp(e - e % step_s, tz=UTC)


def amount_by_bucket(d: Draft, lo: datetime, hi: datetime, step: timedelta) -> dict[datetime, Decimal]:
    """`amount_between` of each UTC bucket of `step` (epoch-aligned: hours, days) inside [lo, hi), keyed by
    the bucket's start. A piece inside one bucket goes to it whole; the others accrue evenly over their time,
    summed as one rate that changes at their ends (a sweep: many slices held over the same span cost one
    pass over the buckets, not one each)."""
    price = d.unit_price
    out: dict[datetime, Decimal] = defaultdict(Decimal)
    step_s = int(step.total_seconds())

    def start_of(t: datetime) -> datetime:
        return _bucket_start(t, step_s)

    change: dict[datetime, Decimal] = defaultdict(Decimal)  # the amount per second starts/stops accruing at t
    for a, b, qty in d.pieces:
        if b <= a:
            if lo <= a < hi:
                out[start_of(a)] += qty * price
            continue
        first = start_of(a)
        if lo <= a and b <= hi and b <= first + step:  # inside one bucket and the range: all of it there
            out[first] += qty * price
            continue
        a2, b2 = max(a, lo), min(b, hi)
        if a2 < b2:
            rate = qty * price / seconds(b - a)
            change[a2] += rate
            change[b2] -= rate
    rate, times = Decimal(0), sorted(change)
    for t, nxt in zip(times, times[1:], strict=False):
        rate += change[t]
        while t < nxt and rate:
            edge = min(nxt, start_of(t) + step)
            out[start_of(t)] += rate * seconds(edge - t)
            t = edge
    return out


def list_price_per_hour(plan: PricePlan, slices: float, tokens_per_hour: float, input_share: float) -> float:
    """What `slices` slices serving `tokens_per_hour` cost a tenant per hour at `plan` (the planner's list
    price): the same per-unit prices the rating charges, slice-hours plus input and output tokens."""
    per_token = (Decimal(str(input_share)) * plan.price_per_1m_input_tokens
                 + (1 - Decimal(str(input_share))) * plan.price_per_1m_output_tokens) / MILLION
    return float(Decimal(str(slices)) * plan.price_per_slice_hour + Decimal(str(tokens_per_hour)) * per_token)


def merge(spans: list[tuple[datetime, datetime]]) -> list[tuple[datetime, datetime]]:
    """The union of [a, b) spans, as disjoint spans in order."""
    out: list[tuple[datetime, datetime]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def commitment_topups(book: PlanBook, held: dict[int, list[tuple[datetime, datetime]]], drafts: list[Draft],
                      start: datetime, end: datetime) -> list[Draft]:
    """One "commitment top-up" draft per reserved plan whose pro-rated commitment for the month
    exceeds the month's own charges at that plan (see the module docstring for the rules).

    held: per tier, the spans (within the month, up to now) in which the tenant held an active
    allocation of a reserved order. drafts: the month's lines rated so far."""
    month_s = seconds(end - start)
    charged: dict[int, Decimal] = defaultdict(Decimal)
    for d in drafts:
        if d.kind in USAGE_KINDS and d.plan.kind == PricePlan.Kind.RESERVED:
            charged[d.plan.pk] += d.amount
    covered: dict[int, list] = {}  # plan pk -> [plan, held seconds, first, last]
    for tier_id, spans in held.items():
        for a, b in merge(spans):
            for plan, lo, hi in book.spans(tier_id, PricePlan.Kind.RESERVED, a, b):
                c = covered.setdefault(plan.pk, [plan, Decimal(0), lo, hi])
                c[1] += seconds(hi - lo)
                c[2], c[3] = min(c[2], lo), max(c[3], hi)
    out = []
    for plan, held_s, first, last in sorted(covered.values(), key=lambda c: (c[0].tier_id, c[0].effective_from)):
        commit = plan.monthly_commit or Decimal(0)
        owed = money(commit * held_s / month_s)
        used = charged.get(plan.pk, Decimal(0))
        top_up = owed - used
        if top_up <= 0:
            continue
        days, month_days = (held_s / 86_400).quantize(CENT), (month_s / 86_400).quantize(Decimal(1))
        d = Draft(L.COMMITMENT_TOPUP, plan.tier, plan,
                  f"{plan.tier.name}: reserved commitment {commit} {plan.currency}/month, held {days} of "
                  f"{month_days} days = {owed} owed, {used} charged at this plan's rates: top-up",
                  "top-up", price=top_up)
        d.add(Decimal(1), first, last)
        out.append(d)
    return out


# --- invoices -----------------------------------------------------------------------------------

def draft_for(tenant: Tenant, period_start: date) -> Invoice:
    invoice, _ = Invoice.objects.get_or_create(
        tenant=tenant, period_start=period_start,
        defaults={"period_end": next_month(period_start), "currency": tenant.currency})
    return invoice


def alert(tenant: Tenant, period_start: date | None, kind: str, message: str) -> BillingAlert:
    """Record (or refresh) an open billing alert for operators, and log it as an error."""
    log.error("billing alert", extra={"tenant": tenant.slug, "kind": kind, "period": str(period_start),
                                      "alert": message})
    a, _ = BillingAlert.objects.update_or_create(
        tenant=tenant, period_start=period_start, kind=kind, resolved_at=None,
        defaults={"message": message[:1000], "at": timezone.now()})
    return a


def resolve_alerts(tenant: Tenant, period_start: date | None, kind: str) -> None:
    BillingAlert.objects.filter(tenant=tenant, period_start=period_start, kind=kind,
                                resolved_at__isnull=True).update(resolved_at=timezone.now())


def _note_unpriced(invoice: Invoice, rated: Rated) -> None:
    if rated.unpriced:
        alert(invoice.tenant, invoice.period_start, BillingAlert.Kind.UNPRICED,
              f"{invoice.period_start:%Y-%m} ({invoice.currency}): " + "; ".join(rated.unpriced))
    else:
        resolve_alerts(invoice.tenant, invoice.period_start, BillingAlert.Kind.UNPRICED)


@retry_on_conflict
@transaction.atomic
def refresh(invoice: Invoice, now: datetime | None = None) -> Invoice:
    """Re-rate a draft from the current usage, in the invoice's own currency. A finalized invoice
    is never touched."""
    invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice.pk)
    if invoice.status != Invoice.Status.DRAFT:
        raise Conflict(f"invoice {invoice.number} is finalized and cannot change")
    rated = rate(invoice.tenant, invoice.period_start, now, invoice.currency, invoice.pk)
    invoice.lines.all().delete()
    lines = InvoiceLine.objects.bulk_create([d.line(invoice) for d in rated.drafts])
    invoice.total = sum((line.amount for line in lines), Decimal(0))
    invoice.rated_at = timezone.now()
    invoice.save(update_fields=["total", "rated_at"])
    _note_unpriced(invoice, rated)
    return invoice


def current_invoice(tenant: Tenant, now: datetime | None = None) -> Invoice:
    """The current month's invoice, re-rated if it is a draft (a write: beat, explicit refresh, demo)."""
    now = now or timezone.now()
    invoice = draft_for(tenant, month_of(now))
    return refresh(invoice, now) if invoice.status == Invoice.Status.DRAFT else invoice


def _next_number(year: int) -> str:
    seq, _ = InvoiceSequence.objects.select_for_update().get_or_create(year=year)
    seq.last += 1
    seq.save(update_fields=["last"])
    return f"TSR-{year}-{seq.last:06d}"


class FinalizeBlocked(Conflict):
    code = "unpriced_usage"


@retry_on_conflict
def finalize(invoice: Invoice, *, now: datetime | None = None, force: bool = False, principal=None) -> Invoice:
    """Rate one last time, number and freeze the invoice, mark the usage it charged as billed.
    principal: who finalizes (audited); None for the monthly beat.

    Lock order (everywhere): the invoice row, then the tenant's rollup rows in (deployment, hour)
    order, the order in which ingest upserts them; then the year's invoice sequence."""
    now = now or timezone.now()
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice.pk)
        if invoice.status == Invoice.Status.FINALIZED:
            raise Conflict(f"invoice {invoice.number} is already finalized")
        _, end = bounds(invoice.period_start)
        if now < end and not force:
            raise ServiceError(f"the month is still open until {end:%Y-%m-%d}; finalize after it ends",
                               field="period_start")
        earlier = Invoice.objects.filter(tenant=invoice.tenant, period_start__lt=invoice.period_start,
                                         status=Invoice.Status.DRAFT).exists()
        if earlier:
            raise Conflict("finalize the tenant's earlier invoices first")
        # Lock the rollup rows this invoice may charge so concurrent ingest waits for us.
        list(UsageHourly.objects.select_for_update().filter(tenant=invoice.tenant, hour__lt=end)
             .order_by("deployment_id", "hour").values_list("pk"))
        rated = rate(invoice.tenant, invoice.period_start, min(now, end), invoice.currency, invoice.pk)
        if rated.unpriced:
            raise FinalizeBlocked(f"invoice for {invoice.period_start:%Y-%m} cannot be finalized: usage with no "
                                  f"price in {invoice.currency} ({'; '.join(rated.unpriced)}); add a plan in "
                                  f"{invoice.currency} from before that usage, then finalize")
        invoice.lines.all().delete()
        lines = InvoiceLine.objects.bulk_create([d.line(invoice) for d in rated.drafts])
        rated.usage_rows.update(
            billed_input_tokens=F("input_tokens"), billed_output_tokens=F("output_tokens"),
            billed_requests=F("requests"))
        invoice.total = sum((line.amount for line in lines), Decimal(0))
        from marketplace.models import CreditNote

        CreditNote.objects.filter(pk__in=[pk for d in rated.drafts if d.kind == L.CORRECTION for pk in d.rows]
                                  ).update(recharged_on=invoice)
        invoice.number = _next_number(invoice.period_start.year)
        invoice.status = Invoice.Status.FINALIZED
        invoice.finalized_at = now
        invoice.rated_at = now
        invoice.save()
        resolve_alerts(invoice.tenant, invoice.period_start, BillingAlert.Kind.UNPRICED)
        audit.record(principal if principal is not None else "system:beat", "invoice.finalize",
                     f"invoice:{invoice.number}", invoice.tenant, total=invoice.total, currency=invoice.currency,
                     forced=force)
        from marketplace.services import webhooks

        webhooks.emit(invoice.tenant, "invoice.finalized", f"invoice:{invoice.pk}", invoice_payload(invoice))
    log.info("invoice finalized", extra={"invoice": invoice.number, "total": str(invoice.total)})
    return invoice


def _months(a: datetime, b: datetime) -> list[date]:
    """The calendar months [a, b) touches."""
    out: list[date] = []
    m = month_of(a)
    while True:
        lo, _ = bounds(m)
        if lo >= b:
            return out
        out.append(m)
        m = next_month(m)


#: The beat looks for periods needing an invoice among rollups and allocations changed this recently
#: (it runs every few minutes: anything older was seen by an earlier run); None = everything.
ENSURE_LOOKBACK = timedelta(days=35)


def periods_used(now: datetime | None = None, since: datetime | None = None,
                 tenant: Tenant | None = None) -> dict[int, set[date]]:
    """Per tenant id: the months up to now with usage (hourly rollups) or held capacity (an
    allocation while active), and, where usage of a finalized month is still unbilled, the current
    month (whose draft will carry it as adjustments). since: only rollups updated and allocations
    still active (or stopped) since then."""
    now = now or timezone.now()
    out: dict[int, set[date]] = defaultdict(set)
    hourly = UsageHourly.objects.filter(hour__lt=now)
    allocs = Allocation.objects.filter(activated_at__isnull=False, activated_at__lt=now)
    if tenant is not None:
        hourly, allocs = hourly.filter(tenant=tenant), allocs.filter(tenant=tenant)
    if since is not None:
        hourly = hourly.filter(updated_at__gte=since)
        allocs = allocs.filter(Q(released_at__isnull=True) | Q(released_at__gte=since) | Q(updated_at__gte=since))
    for tenant_id, m in hourly.annotate(m=TruncMonth("hour", tzinfo=UTC)).values_list("tenant_id", "m").distinct():
        out[tenant_id].add(month_of(m))
    for tenant_id, activated, released, state, updated in allocs.values_list(
            "tenant_id", "activated_at", "released_at", "state", "updated_at"):
        assert activated is not None  # activated_at__isnull=False above
        stopped = released or (updated if state == Allocation.State.FAILED else None)
        out[tenant_id].update(_months(activated, min(stopped or now, now)))
    pending_late = (hourly.filter(Q(input_tokens__gt=F("billed_input_tokens"))
                                  | Q(output_tokens__gt=F("billed_output_tokens")))
                    .annotate(m=TruncMonth("hour", tzinfo=UTC)).values_list("tenant_id", "m").distinct())
    finalized = set(Invoice.objects.filter(status=Invoice.Status.FINALIZED).values_list("tenant_id", "period_start"))
    for tenant_id, m in pending_late:
        if (tenant_id, month_of(m)) in finalized:
            out[tenant_id].add(month_of(now))
    return out


def ensure_invoices(now: datetime | None = None, tenant: Tenant | None = None,
                    since: datetime | None = None) -> list[Invoice]:
    """Create the missing invoice (a draft, in the tenant's currency) of every period in which a
    tenant used something or held capacity, with one INSERT. Returns the invoices opened (a concurrent
    run's among them, if it opened one of the same at the same time). since: see periods_used."""
    now = now or timezone.now()
    used = periods_used(now, since, tenant)
    if tenant is not None:
        used = {tenant.pk: used.get(tenant.pk, set())}
    have = set(Invoice.objects.filter(tenant_id__in=list(used)).values_list("tenant_id", "period_start"))
    missing = sorted((t, m) for t, months in used.items() for m in months if (t, m) not in have)
    if not missing:
        return []
    currency = dict(Tenant.objects.filter(pk__in={t for t, _ in missing}).values_list("pk", "currency"))
    # one INSERT for all (another run may have opened some meanwhile: the unique constraint skips those)
    Invoice.objects.bulk_create([Invoice(tenant_id=t, period_start=m, period_end=next_month(m), currency=currency[t])
                                 for t, m in missing], ignore_conflicts=True, batch_size=1000)
    wanted = Q()
    for m in {m for _, m in missing}:
        wanted |= Q(period_start=m, tenant_id__in=[t for t, mm in missing if mm == m])
    created = list(Invoice.objects.filter(wanted, status=Invoice.Status.DRAFT).order_by("tenant_id", "period_start"))
    for inv in created:
        log.info("invoice opened", extra={"tenant": inv.tenant_id, "period": str(inv.period_start)})
    return created


def finalize_due(now: datetime | None = None, *, ensure: bool = True) -> list[str]:
    """Beat, month end: open the missing invoices, then finalize every draft whose month has ended,
    oldest first. Each invoice in its own transaction: one that fails (no price in its currency, a
    conflict) is alerted and holds back only that tenant's later invoices."""
    now = now or timezone.now()
    if ensure:
        ensure_invoices(now, since=now - ENSURE_LOOKBACK)
    return _finalize_drafts(Invoice.objects.filter(status=Invoice.Status.DRAFT, period_end__lte=now.date()), now)


def finalize_tenant_due(tenant_id: int, now: datetime | None = None) -> list[str]:
    """Month end for one tenant (its rating-run task): finalize its drafts whose month has ended, oldest
    first; one that fails is alerted and holds back its later ones. Idempotent: a finalized invoice is
    never picked again, so a retried or redelivered task bills nothing twice."""
    now = now or timezone.now()
    return _finalize_drafts(Invoice.objects.filter(tenant_id=tenant_id, status=Invoice.Status.DRAFT,
                                                   period_end__lte=now.date()), now)


def _finalize_drafts(drafts, now: datetime) -> list[str]:
    done, held_back = [], set()
    for inv in drafts.select_related("tenant").order_by("period_start", "tenant_id"):
        if inv.tenant_id in held_back:
            continue
        try:
            done.append(finalize(inv, now=now).number)
        except Exception as exc:  # recorded and alerted; the other tenants go on
            held_back.add(inv.tenant_id)
            alert(inv.tenant, inv.period_start, BillingAlert.Kind.FINALIZE_FAILED,
                  f"finalizing {inv.period_start:%Y-%m} failed: {exc}")
    return done


def rate_tenant(tenant: Tenant, now: datetime | None = None) -> list[str]:
    """Re-rate one tenant's current draft and check its spend, in one transaction; clears its rating
    alert. Returns the spend notices that fired. Raises on failure (the caller alerts)."""
    now = now or timezone.now()
    period = month_of(now)
    with transaction.atomic():
        inv = Invoice.objects.filter(tenant=tenant, period_start=period).first()
        if inv is not None and inv.status == Invoice.Status.DRAFT:
            refresh(inv, now)
        fired = evaluate_spend(tenant, now)
    resolve_alerts(tenant, period, BillingAlert.Kind.RATING_FAILED)
    return fired


def rating_failed(tenant: Tenant, period: date, exc: BaseException) -> None:
    log.error("rating failed", extra={"tenant": tenant.slug, "error": str(exc)})
    alert(tenant, period, BillingAlert.Kind.RATING_FAILED, f"rating {period:%Y-%m} failed: {exc}")


def rate_all(now: datetime | None = None) -> dict:
    """Re-rate every tenant's current draft and check its spend, in this process (the demo, tests and
    `start_rating_run`'s small cousin): each tenant in its own transaction; a tenant that fails is
    recorded (BillingAlert) and the others go on. Then the month-end finalization."""
    now = now or timezone.now()
    ensure_invoices(now, since=now - ENSURE_LOOKBACK)
    notices, failed = {}, []
    period = month_of(now)
    for t in Tenant.objects.filter(invoices__period_start=period).order_by("pk"):
        try:
            fired = rate_tenant(t, now)
            if fired:
                notices[t.slug] = fired
        except Exception as exc:  # recorded and alerted; the other tenants go on
            log.exception("rating failed", extra={"tenant": t.slug})
            rating_failed(t, period, exc)
            failed.append(t.slug)
    return {"finalized": finalize_due(now, ensure=False), "notices": notices, "failed": failed}


def start_rating_run(now: datetime | None = None) -> RatingRun:
    """The rating beat, fanned out: open missing invoices, then one task per tenant with an invoice this
    month or a draft whose month has ended (queue "control", retried on its own): each finalizes its
    tenant's ended months and re-rates its current draft, so month end is spread over the tenants' tasks
    too; the last to finish runs `finish_rating_run`. Its own work is a few queries whatever the number
    of tenants."""
    now = now or timezone.now()
    ensure_invoices(now, since=now - ENSURE_LOOKBACK)
    period = month_of(now)
    with transaction.atomic():
        run = RatingRun.objects.create(period_start=period, started_at=now)
        ids = sorted(set(Invoice.objects.filter(
            Q(period_start=period) | Q(status=Invoice.Status.DRAFT, period_end__lte=now.date()))
            .values_list("tenant_id", flat=True)))
        RatingRunTenant.objects.bulk_create([RatingRunTenant(run=run, tenant_id=t) for t in ids])
        if ids:
            def send_all() -> None:
                for t in ids:
                    enqueue.send(enqueue.RATE_TENANT, [run.pk, t], "control")

            transaction.on_commit(send_all)
    if not ids:
        finish_rating_run(run.pk)
    log.info("rating run started", extra={"run": run.pk, "tenants": len(ids)})
    return run


def rate_run_tenant(run_id: int, tenant_id: int, *, final_attempt: bool) -> str:
    """One tenant of a rating run (its task): rate it; a failure is re-raised for the task to retry
    until `final_attempt`, which records it. Counts once however often it is retried or redelivered."""
    item = RatingRunTenant.objects.select_related("run", "tenant").get(run_id=run_id, tenant_id=tenant_id)
    if item.status != RatingRunTenant.Status.PENDING:
        return item.status
    RatingRunTenant.objects.filter(pk=item.pk).update(attempts=F("attempts") + 1)
    try:
        now = timezone.now()
        finalize_tenant_due(tenant_id, now)  # month end: this tenant's ended months (alerted, not raised)
        fired = rate_tenant(item.tenant, now)
    except Exception as exc:
        if not final_attempt:
            raise
        rating_failed(item.tenant, item.run.period_start, exc)
        status, fired, error = RatingRunTenant.Status.FAILED, [], str(exc)[:500]
    else:
        status, error = RatingRunTenant.Status.DONE, ""
    marked = RatingRunTenant.objects.filter(pk=item.pk, status=RatingRunTenant.Status.PENDING).update(
        status=status, error=error, notices=fired)
    if marked and not RatingRunTenant.objects.filter(run_id=run_id, status=RatingRunTenant.Status.PENDING).exists():
        finish_rating_run(run_id)
    return status


def finish_rating_run(run_id: int) -> dict | None:
    """Once every tenant of the run is done: finalize the months that ended and record the summary (an
    audit event). Runs once per run (the first caller to set finished_at)."""
    now = timezone.now()
    if not RatingRun.objects.filter(pk=run_id, finished_at__isnull=True).update(finished_at=now):
        return None
    run = RatingRun.objects.get(pk=run_id)
    counts = dict(run.tenants.values_list("status").annotate(n=Count("pk")).values_list("status", "n"))
    failed = list(run.tenants.filter(status=RatingRunTenant.Status.FAILED).values_list("tenant__slug", flat=True))
    summary = {"period": f"{run.period_start:%Y-%m}", "rated": counts.get(RatingRunTenant.Status.DONE, 0),
               "failed": failed, "finalized": _run_finalized(run, finalize_due(now, ensure=False)),
               "seconds": round((now - run.started_at).total_seconds(), 3)}
    RatingRun.objects.filter(pk=run_id).update(summary=summary)
    audit.record("system:beat", "billing.rating_run", f"rating-run:{run_id}", None, **summary)
    log.info("rating run finished", extra={"run": run_id, **{k: v for k, v in summary.items() if k != "failed"},
                                           "failed": len(failed)})
    return summary


def _run_finalized(run: RatingRun, stragglers: list[str]) -> list[str]:
    """The invoice numbers the run finalized: by its tenants' tasks (month end fanned out), plus any
    draft `finalize_due` caught at the end (normally none)."""
    by_tasks = Invoice.objects.filter(tenant_id__in=run.tenants.values("tenant_id"), status=Invoice.Status.FINALIZED,
                                      finalized_at__gte=run.started_at, finalized_at__lte=run.finished_at)
    numbers = {n for n in by_tasks.values_list("number", flat=True) if n is not None}  # finalized: all numbered
    return sorted(numbers | set(stragglers))


def invoice_payload(invoice: Invoice) -> dict:
    return {
        "number": invoice.number, "tenant": invoice.tenant.slug, "status": invoice.status,
        "period_start": invoice.period_start.isoformat(), "period_end": invoice.period_end.isoformat(),
        "currency": invoice.currency, "total": str(invoice.total),
        "credit_notes": [{"number": cn.number, "total": str(cn.total)} for cn in invoice.credit_notes.order_by("pk")],
        "lines": [{"kind": li.kind, "tier": li.tier.key, "deployment": li.deployment_id,
                   "description": li.description, "quantity": str(li.quantity), "unit": li.unit,
                   "unit_price": str(li.unit_price), "amount": str(li.amount),
                   "usage_from": li.usage_from.isoformat(), "usage_to": li.usage_to.isoformat()}
                  for li in invoice.lines.select_related("tier").order_by("pk")],
    }


# --- credit notes ---------------------------------------------------------------------------------

def _next_credit_note_number(year: int) -> str:
    from marketplace.models import CreditNoteSequence

    seq, _ = CreditNoteSequence.objects.select_for_update().get_or_create(year=year)
    seq.last += 1
    seq.save(update_fields=["last"])
    return f"CN-{year}-{seq.last:06d}"


@retry_on_conflict
def issue_credit_note(principal, invoice: Invoice, *, reason: str, lines: list[tuple[int, Decimal]] | None = None,
                      recharge: list[dict] | None = None, now: datetime | None = None):
    """Operators correct a finalized invoice (which never changes) with a numbered, immutable credit
    note: `lines` [(invoice line id, amount credited)] (default: every line in full, less what earlier
    credit notes credited), and optionally the corrected charges `recharge` [{description, amount}],
    which the tenant's next invoice carries as `correction` lines. Emits credit_note.issued."""
    from marketplace.models import CreditNote, CreditNoteLine
    from marketplace.services import webhooks

    if not principal.can("operate"):
        raise Forbidden("only operators issue credit notes")
    if not reason or not reason.strip():
        raise ServiceError("say why the invoice is corrected", field="reason")
    now = now or timezone.now()
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice.pk)
        if invoice.status != Invoice.Status.FINALIZED:
            raise Conflict("only a finalized invoice is corrected by a credit note; re-rate the draft instead",
                           field="invoice")
        own = {li.pk: li for li in invoice.lines.all()}
        credited: dict[int, Decimal] = defaultdict(Decimal)
        for line_id, amount in CreditNoteLine.objects.filter(invoice_line__invoice=invoice).values_list(
                "invoice_line_id", "amount"):
            credited[line_id] += amount
        wanted = ([(pk, li.amount - credited[pk]) for pk, li in own.items() if li.amount > 0] if lines is None
                  else [(int(pk), Decimal(str(a))) for pk, a in lines])
        out = []
        for pk, amount in wanted:
            li = own.get(pk)
            if li is None:
                raise ServiceError(f"line {pk} is not a line of invoice {invoice.number}", field="lines")
            amount = money(amount)
            left = li.amount - credited[pk]
            if amount <= 0 or amount > left:
                if lines is None and amount <= 0:
                    continue
                raise ServiceError(f"line {pk}: credit between 0.01 and {left} (its amount less earlier credits)",
                                   field="lines")
            out.append((li, amount))
        items = []
        for item in recharge or []:
            try:
                amt = money(Decimal(str(item["amount"])))
                desc = str(item["description"]).strip()[:200]
            except (KeyError, ArithmeticError, ValueError) as exc:
                raise ServiceError(f"each corrected charge needs description and amount ({exc})", field="recharge"
                                   ) from None
            if amt <= 0 or not desc:
                raise ServiceError("a corrected charge has a description and a positive amount", field="recharge")
            items.append({"description": desc, "amount": str(amt)})
        if not out:
            raise ServiceError("nothing left to credit on this invoice", field="lines")
        cn = CreditNote.objects.create(
            tenant=invoice.tenant, invoice=invoice, number=_next_credit_note_number(now.year),
            currency=invoice.currency, total=sum((a for _, a in out), Decimal(0)), reason=reason.strip()[:500],
            recharge=items, issued_at=now, issued_by=audit.actor_of(principal)[0])
        CreditNoteLine.objects.bulk_create([CreditNoteLine(credit_note=cn, invoice_line=li, amount=a,
                                                           description=li.description) for li, a in out])
        audit.record(principal, "invoice.credit_note", f"credit_note:{cn.number}", invoice.tenant,
                     invoice=invoice.number, total=cn.total, currency=cn.currency, recharge=items)
        webhooks.emit(invoice.tenant, "credit_note.issued", f"credit_note:{cn.pk}", credit_note_payload(cn))
    log.info("credit note issued", extra={"credit_note": cn.number, "invoice": invoice.number, "total": str(cn.total)})
    return cn


def credit_note_payload(cn) -> dict:
    return {
        "number": cn.number, "invoice": cn.invoice.number, "tenant": cn.tenant.slug, "currency": cn.currency,
        "total": str(cn.total), "reason": cn.reason, "issued_at": cn.issued_at.isoformat(),
        "lines": [{"invoice_line": li.invoice_line_id, "description": li.description, "amount": str(li.amount)}
                  for li in cn.lines.order_by("pk")],
        "recharge": cn.recharge,
        "recharged_on": cn.recharged_on.number if cn.recharged_on_id else None,
    }


# --- spend limits -------------------------------------------------------------------------------

def spend_status(tenant: Tenant, now: datetime | None = None) -> dict:
    """Month-to-date spend against the limit. A read: the month is rated in memory (the invoice's
    currency), nothing is written. A month finalized early counts its final total."""
    now = now or timezone.now()
    period = month_of(now)
    invoice = Invoice.objects.filter(tenant=tenant, period_start=period).first()
    if invoice is not None and invoice.status == Invoice.Status.FINALIZED:
        spend, currency = invoice.total, invoice.currency
    else:
        currency = invoice.currency if invoice is not None else tenant.currency
        spend = rate(tenant, period, now, currency).total
    limit = tenant.monthly_spend_limit
    ratio = (spend / limit) if limit else None
    return {
        "spend": spend, "limit": limit, "currency": currency, "ratio": ratio,
        "warn": ratio is not None and ratio >= tenant.spend_warn_ratio,
        "blocked": ratio is not None and ratio >= tenant.spend_block_ratio,
        "period_start": period,
    }


def check_can_order(tenant: Tenant) -> None:
    s = spend_status(tenant)
    if s["blocked"]:
        raise SpendLimitReached(
            f"monthly spend limit reached: {s['spend']} of {s['limit']} {s['currency']}; new orders are blocked "
            f"until next month or a higher limit", field="tenant", code="spend_limit")


def evaluate_spend(tenant: Tenant, now: datetime | None = None) -> list[str]:
    """Record warn/block notices once per month and send the webhooks."""
    from marketplace.services import webhooks

    s = spend_status(tenant, now)
    fired: list[str] = []
    for level, hit, event in ((SpendNotice.Level.WARN, s["warn"], "spend_limit.warning"),
                              (SpendNotice.Level.BLOCK, s["blocked"], "spend_limit.reached")):
        if not hit:
            continue
        with transaction.atomic():
            notice, created = SpendNotice.objects.get_or_create(
                tenant=tenant, period_start=s["period_start"], level=level,
                defaults={"spend": s["spend"], "limit": s["limit"]})
            if created:
                webhooks.emit(tenant, event, f"spend:{tenant.pk}:{s['period_start']}:{level}", {
                    "tenant": tenant.slug, "level": level, "spend": str(s["spend"]), "limit": str(s["limit"]),
                    "currency": s["currency"], "period_start": s["period_start"].isoformat()})
                fired.append(level)
    return fired
