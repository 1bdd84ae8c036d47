"""Rating: the rule that prices a tenant's month.

Rating turns what a tenant used in a calendar month into priced lines, with the plan that was in
force at the time of each use: slice-hours of its allocations while active (per second, split at
every price change) and input/output tokens of its deployments, each LoRA adapter on its own line, each token
at the plan in force when it was served: from the hourly rollups, except in the rare split hours (a plan starts
after the hour's start: `PlanBook.split_hours`), priced from their usage events (`token_groups`), so that the
tokens served in the hour a tier's first plan starts are priced from that instant, and none twice. `rate_month`
is the rule (no queries); `rate` loads one tenant-month for it, `rate_months_many` many tenants at once; the
charts' money is its second copy, kept for speed (billing.spread, named there and held equal by a property test).
Usage that arrives later for a finalized month goes onto the next invoice as adjustment lines.

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
The corrected charges of credit notes (billing.credit_notes) ride on the next invoice as `correction` lines.

Currency: an invoice is rated in its own `currency`, fixed when the invoice is created (the tenant's
billing currency then); an operator's change of the tenant's currency applies from the next period.
Usage or held capacity with no plan in the invoice's currency is never a silent 0: it is listed in
`Rated.unpriced`, raises a BillingAlert and blocks finalization until a plan covers it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.db.models import (
    Aggregate,
    BigIntegerField,
    BooleanField,
    Case,
    Count,
    F,
    Max,
    Min,
    Q,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.functions import TruncHour, TruncMonth
from django.utils import timezone

from marketplace.models import Allocation, CreditNote, Invoice, InvoiceLine, ModelDeployment, PricePlan, Tier
from telemetry.models import UsageEvent, UsageHourly
from telemetry.sqlbuckets import EpochBucket
from tenants.models import Tenant

from .plans import HOUR, PlanBook, hour_of
from .units import CENT, MILLION, QTY, bounds, money, month_of, seconds

log = logging.getLogger("tessera.billing")
L = InvoiceLine.Kind
USAGE_KINDS = (L.SLICE_HOURS, L.INPUT_TOKENS, L.OUTPUT_TOKENS)  # what counts toward a commitment


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
    keys: dict[str, int] = field(default_factory=dict)  # a token line's tokens per API key prefix (invoices)

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



def unit_hours(tier) -> str:
    """What an allocation-hour of the tier is called on invoices: a group-hour for a multi-GPU tier (its price is
    the whole group's), else a slice-hour."""
    return "group-hours" if tier.gpu_count > 1 else "slice-hours"

def piece_case(pieces: Pieces) -> Case:
    """SQL: the piece of an hourly row (see token_groups)."""
    step, lo, hi = pieces
    hour = timedelta(hours=1)
    minus = Value(-1, output_field=BigIntegerField())
    return Case(When(hour__lt=lo - hour, then=Value(-1)), When(hour__gte=hi + hour, then=Value(-2)),
                When(Q(hour__lt=lo) | Q(hour__gte=hi), then=EpochBucket("hour", 3600) * minus),  # -(its epoch)
                default=EpochBucket("hour", step), output_field=BigIntegerField())


TIER, PLAN_KIND = "deployment__allocation__tier_id", "deployment__allocation__order__plan_kind"


def in_hours(field: str, hours: list[datetime]) -> Q:
    """`field` (a time) inside any of the UTC `hours`."""
    q = Q()
    for h in hours:
        q |= Q(**{f"{field}__gte": h, f"{field}__lt": h + HOUR})
    return q


def token_groups(rows: QuerySet, book: PlanBook, month_start: datetime, pieces: Pieces | None = None, *,
                 events: QuerySet, by_tenant: bool = False, by_deployment: bool = True, by_key: bool = False):
    """UsageHourly `rows` summed by the database per (deployment, adapter, tier, plan kind, plan in force,
    late: before `month_start`, month[, piece]): the rating's token input, however many hours there are.
    pieces = (step, lo, hi): also per UTC time bucket of `step` seconds inside [lo, hi), each hour a period's
    edges cut (just outside [lo, hi)) its own piece (-its epoch), and the hours before and after in one
    piece each (-1, -2). Yields dicts with the sums, first/last hour and the number of hours (or events).
    by_deployment=False: only the token sums per tier, plan kind, plan in force[, tenant][, piece] (what
    spreading a month's lines over time needs; `rows` within one month). by_key: also per API key (`api_key`,
    the key's prefix: what an invoice's per-key breakdown needs).

    Split hours (`PlanBook.split_hours`: a plan starts inside the hour): the month's own rollups of those hours
    are left out and their UsageEvent `events` (the same tenants' usage in the same month, unfiltered by time)
    summed instead, each event at the plan in force at its `ts`; a late rollup of a split hour is priced at the
    plan in force at the hour's end (`PlanBook.rollup_case`)."""
    month_end = bounds(month_of(month_start))[1]
    split = [h for h in book.split_hours() if month_start <= h < month_end]  # this month's (events: this month's)
    own = Q(hour__gte=month_start) if by_deployment else Q()
    if split:
        rows = rows.exclude(own & Q(hour__in=split))
    yield from _token_groups(rows.annotate(plan_id=book.rollup_case(TIER, PLAN_KIND, month_start)), month_start,
                             pieces, by_tenant=by_tenant, by_deployment=by_deployment, by_key=by_key)
    if split:
        ev = events.filter(in_hours("ts", split)).annotate(hour=TruncHour("ts", tzinfo=UTC),
                                                           plan_id=book.case(TIER, PLAN_KIND, "ts"))
        yield from _token_groups(ev, month_start, pieces, by_tenant=by_tenant, by_deployment=by_deployment,
                                 by_key=by_key, billed=False)


def _token_groups(qs: QuerySet, month_start: datetime, pieces: Pieces | None, *, by_tenant: bool,
                  by_deployment: bool, by_key: bool = False, billed: bool = True):
    """token_groups of rollups (`billed`) or of one month's usage events (not `billed`: annotated with their
    `hour`; none billed, never late), `qs` annotated with `plan_id`."""
    keys = [TIER, PLAN_KIND, "plan_id"] + (["tenant_id"] if by_tenant else []) + (["api_key"] if by_key else [])
    sums: dict[str, Aggregate] = {"input_tokens": Sum("input_tokens"), "output_tokens": Sum("output_tokens")}
    if by_deployment:  # what an invoice needs besides: the line keys, late usage, what was billed before
        at = "hour" if billed else "ts"
        qs = qs.annotate(
            late=Case(When(hour__lt=month_start, then=Value(True)), default=Value(False), output_field=BooleanField()),
            month=TruncMonth(at, tzinfo=UTC))
        keys = ["deployment_id", "adapter", *keys, "late", "month"]
        sums.update(requests=Sum("requests"), first=Min(at), last=Max(at), hours=Count("pk"))
        if billed:
            sums.update(billed_input_tokens=Sum("billed_input_tokens"),
                        billed_output_tokens=Sum("billed_output_tokens"))
    if pieces:
        qs = qs.annotate(piece=piece_case(pieces))
        keys.append("piece")
    for g in qs.values(*keys).annotate(**sums).order_by(*keys):
        g["tier_id"], g["plan_kind"] = g.pop(TIER), g.pop(PLAN_KIND)
        if by_deployment and not billed:
            g["billed_input_tokens"] = g["billed_output_tokens"] = 0
            g["first"], g["last"] = hour_of(g["first"]), hour_of(g["last"])
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


def active_allocations(start: datetime, end: datetime, now: datetime) -> QuerySet:
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
    allocs = [h for _, h in _held(active_allocations(start, end, now).filter(tenant=tenant))]
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
    events = UsageEvent.objects.filter(tenant=tenant, ts__gte=start, ts__lt=end)
    groups = list(token_groups(rows, book, start, pieces, events=events, by_key=True))
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
    each plan span at its own price; tokens at the plan in force when served (`token_groups`: at their hour, or
    their event's time in a split hour; late usage of finalized months as adjustments); reserved commitments
    topped up. Returns the month's drafts, what had no price, and late usage at reserved plans per (month, plan)
    for the commitment credits.

    Its linear part has a SECOND COPY kept for speed, the charts' money (billing.spread.spread_amounts: the same
    prices over a range and its buckets without a line per deployment), held equal to this rule's lines by the
    property test tests/unit/test_spread_amounts.py."""
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
                L.SLICE_HOURS, tier, span_plan,
                f"{tier.name}: {unit_hours(tier)} at {span_plan.price_per_slice_hour}/h "
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
            if "api_key" in g:
                d.keys[g["api_key"]] = d.keys.get(g["api_key"], 0) + tokens
    out = list(drafts.values())
    out += commitment_topups(book, held, out, start, end)
    return out, list(unpriced), late_reserved


def books_of_month(tenants: list[Tenant], period_start: date) -> tuple[dict[int, str], dict[str, PlanBook]]:
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
    usage rows it matches are rated (default: all). month_books: `books_of_month` of the month, when already read."""
    start, end = bounds(period_start)
    ids = [t.pk for t in tenants]
    currency, books = month_books or books_of_month(tenants, period_start)
    allocs: dict[int, list[Held]] = defaultdict(list)
    for tenant_id, h in _held(active_allocations(start, end, now).filter(tenant_id__in=ids)):
        allocs[tenant_id].append(h)
    groups: dict[int, list[dict]] = defaultdict(list)
    for cur, book in books.items():
        mine = [t for t in ids if currency[t] == cur]
        rows = UsageHourly.objects.filter(tenant_id__in=mine, hour__gte=start, hour__lt=end)
        events = UsageEvent.objects.filter(tenant_id__in=mine, ts__gte=start, ts__lt=end)
        if tokens is not None:
            rows, events = rows.filter(tokens), events.filter(tokens)
        for g in token_groups(rows, book, start, pieces, events=events, by_tenant=True):
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
