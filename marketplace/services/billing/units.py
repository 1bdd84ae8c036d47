"""The units billing counts in: calendar months (UTC), money rounded to the cent, exact durations."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

CENT = Decimal("0.01")
MILLION = Decimal(1_000_000)
QTY = Decimal("0.000001")


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


def months(a: datetime, b: datetime) -> list[date]:
    """The calendar months [a, b) touches."""
    out: list[date] = []
    m = month_of(a)
    while True:
        lo, _ = bounds(m)
        if lo >= b:
            return out
        out.append(m)
        m = next_month(m)
