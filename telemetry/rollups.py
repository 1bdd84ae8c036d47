"""What the rollup tables share (energy: telemetry.services.energy; the planner: marketplace.selectors.
planner_measures): UTC hour and day boundaries, and the gap-free run of rolled-up markers inside a range
that a read may take from a rollup instead of the rows themselves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db.models import Count, Max, Min, QuerySet

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)


def floor_hour(t: datetime) -> datetime:
    """The UTC hour `t` falls in (an aware datetime in any zone)."""
    return t.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def ceil_hour(t: datetime) -> datetime:
    f = floor_hour(t)
    return f if f == t else f + HOUR


def floor_day(t: datetime) -> datetime:
    """The UTC day `t` falls in."""
    return t.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def ceil_day(t: datetime) -> datetime:
    f = floor_day(t)
    return f if f == t else f + DAY


def covered_run(rows: QuerySet, field: str, lo: datetime, hi: datetime, step: timedelta
                ) -> tuple[datetime, datetime] | None:
    """The span [first, last + step) of the rollup markers `rows` in [lo, hi) when they have no gap; else None
    (one query)."""
    if hi <= lo:
        return None
    got = rows.filter(**{f"{field}__gte": lo, f"{field}__lt": hi}).aggregate(
        n=Count(field, distinct=True), first=Min(field), last=Max(field))
    if got["first"] is None or got["n"] != (got["last"] - got["first"]) / step + 1:
        return None
    return got["first"], got["last"] + step
