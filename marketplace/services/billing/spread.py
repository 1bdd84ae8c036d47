"""The charts' money: rating spread over a time range and its buckets, fast.

`spread_amounts` is a SECOND COPY, kept for speed, of the linear part of the rating rule (`rating.rate_month`,
whose docstring names this copy): what the month's own invoice lines (`rate_month` per deployment line) charge
inside [start, end) or per UTC bucket, computed without building a line per deployment or token group. It is held
equal to the invoices' lines spread with `amount_between` / `amount_by_bucket` by the property test
tests/unit/test_spread_amounts.py and by tests/unit/test_one_rating.py (the reference they compare with,
`rated_lines_many`, lives in tests/billing_reference.py: product code never needs it).

`_raw_rows` is a second copy of Django's row reading for one query shape (integer and numeric sums): it skips
the per-value converters; tests/unit/test_spread_amounts.py holds its rows equal to the queryset's own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import lru_cache

from django.db import connections
from django.db.models import Case, Count, DateTimeField, Expression, F, Q, QuerySet, Sum, Value, When
from django.db.models.functions import Coalesce, Greatest, Least, TruncHour
from django.utils import timezone

from marketplace.models import Allocation, PricePlan
from telemetry.models import UsageDaily, UsageEvent, UsageHourly
from telemetry.rollups import ceil_day, floor_day
from telemetry.sqlbuckets import EpochBucket
from tenants.models import Tenant

from .plans import PlanBook
from .rating import (
    PLAN_KIND,
    TIER,
    Draft,
    L,
    active_allocations,
    books_of_month,
    in_hours,
    piece_case,
    rate_months_many,
)
from .units import bounds, months, seconds

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
      plan's prices, an edge hour in proportion to its time in [start, end)), from the hourly rollups (whole days
      from the daily ones) except in split hours (a plan starts inside the hour: `PlanBook.split_hours`), which
      are priced from their usage events at each event's time, as the rating prices them (`token_groups`);
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
    piece_step = step or 86400 * 10**5  # None: one piece (a multiple of a day: see _daily_spans)
    bucket_td = timedelta(seconds=step) if step else None
    for m in months(start, min(end, now)):
        m_start, m_end = bounds(m)
        m_now = min(now, m_end)
        currency_of, books = books_of_month(tenants, m)
        for t in ids:
            out.currency.setdefault(t, currency_of[t])
        # the month's allocations, each clipped to the range (`rate_month`'s clip, then [start, end)) by the
        # database, and counted per tenant, tier, plan kind and clipped span (the same span: one row)
        held = _held_spans(active_allocations(m_start, m_end, m_now).filter(tenant_id__in=ids),
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
            mine = [t for t in ids if currency_of[t] == cur]
            rows = UsageHourly.objects.filter(tenant_id__in=mine, hour__gte=max(m_start, lo - hour),
                                              hour__lt=min(m_end, hi + hour))
            # whole days of the range on which no price of this currency changes: read from the daily rollups
            # (a day's hours all fall in one bucket and are all priced at the plan in force at the day's start)
            days = _daily_spans(book, max(m_start, lo), min(m_end, hi), step)
            if days:
                rows = rows.exclude(_any_span("hour", days))
            # split hours (a plan starts inside the hour): priced from their usage events, at each event's time
            split = [h for h in book.split_hours() if max(m_start, lo - hour) <= h < min(m_end, hi + hour)]
            if split:
                rows = rows.exclude(hour__in=split)
            qs, divisor = token_sums(rows, book, piece_case((piece_step, lo, hi)), by_tier)
            queries = [qs]
            if split:
                events = (UsageEvent.objects.filter(in_hours("ts", split), tenant_id__in=mine)
                          .annotate(hour=TruncHour("ts", tzinfo=UTC)))
                queries.append(token_sums(events, book, piece_case((piece_step, lo, hi)), by_tier, at="ts")[0])
            if days:
                daily = UsageDaily.objects.filter(_any_span("day", days), tenant_id__in=mine)
                queries.append(token_sums(daily, book, EpochBucket("day", piece_step), by_tier, at="day")[0])
            acc, used = out.money, out.used
            of_piece: dict[int, tuple[datetime | None, bool, Decimal | None]] = {}
            for row in (r for q in queries for r in _raw_rows(q)):
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


def token_sums(rows: QuerySet, book: PlanBook, piece: Expression, by_tier: bool, at: str = "hour"
               ) -> tuple[QuerySet, Decimal]:
    """The database prices the tokens of the rollup `rows` (hourly; daily with at="day"; usage events annotated
    with their `hour`, at="ts") at the plan in force at each row's time `at` and sums them per tenant[, tier] and
    `piece` (`rating.piece_case` of the hour, or a day's bucket): one row per bucket, whatever the plans,
    deployments and hours. Rows (read with `_raw_rows`): tenant id[, tier id], piece, input tokens, output tokens,
    requests, money x the divisor returned (null: no price in force)."""
    priced, divisor = book.token_money(TIER, PLAN_KIND, at)
    keys = ["tenant_id", TIER] if by_tier else ["tenant_id"]
    qs = (rows.annotate(piece=piece).values_list(*keys, "piece")
          .annotate(i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests"), m=Sum(priced)).order_by())
    return qs, divisor


#: the fewest whole days worth reading from the daily rollups (below it, the hourly rows are as cheap)
DAILY_FROM_DAYS = 2


def _daily_spans(book: PlanBook, lo: datetime, hi: datetime, step: int | None) -> list[tuple[datetime, datetime]]:
    """[from, to) runs of whole UTC days inside [lo, hi) whose usage the daily rollups (UsageDaily) can stand for:
    only when buckets are whole days (step None or a multiple of a day: epoch-aligned, so a day's hours share
    one), and never a day in which a plan of `book` starts after midnight (its hours are priced at two plans).
    Empty when fewer than DAILY_FROM_DAYS days qualify."""
    if step is not None and step % 86400:
        return []
    first, last = ceil_day(lo), floor_day(hi)  # the whole days inside
    if (last - first).days < DAILY_FROM_DAYS:
        return []
    cuts = sorted({p.effective_from for p in book.by_pk.values() if first < p.effective_from < last})
    spans, a = [], first
    for t in cuts:
        day = t.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        if day == t:  # a plan starting at midnight prices the whole day: no cut
            continue
        if a < day:
            spans.append((a, day))
        a = max(a, day + timedelta(days=1))
    if a < last:
        spans.append((a, last))
    return spans if sum((b - a).days for a, b in spans) >= DAILY_FROM_DAYS else []


def _any_span(field: str, spans: list[tuple[datetime, datetime]]) -> Q:
    """`field` in any of the [from, to) spans."""
    q = Q()
    for a, b in spans:
        q |= Q(**{f"{field}__gte": a, f"{field}__lt": b})
    return q


def _raw_rows(qs: QuerySet) -> list[tuple]:
    """A values_list queryset's rows as the database driver returns them (no per-value converters: sums of
    integers and numerics only)."""
    sql, params = qs.query.get_compiler(using=qs.db).as_sql()
    with connections[qs.db].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


@lru_cache(maxsize=4096)
def _piece_span(piece: int, step: int, lo: datetime, hi: datetime) -> tuple[datetime, datetime]:
    """The time a piece of `rating.piece_case` covers: an edge hour's hour; an inner bucket's part of [lo, hi)."""
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
