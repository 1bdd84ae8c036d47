"""The capacity planner's measuring sums over a window, read from the hourly planner rollups where the
downsampling job has rolled the hours up (marketplace.services.planner_rollup) and from the usage, Triton and
sample rows themselves for the rest (the hours before the first rolled hour, after the last, and the partial
hours at the window's edges). The direct reads (``direct_*``) are the reference: a rolled hour holds exactly what
they give for that hour, so a window's figures are the same either way.

Usage and Triton rows are keyed by the hour they start (a window holds the hours h with since <= h < until);
GPU samples by their time (since <= ts < until): a rolled hour h stands for the samples in [h, h + 1 h), so
only hours that end by ``until`` are read rolled up.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Exists, F, FloatField, Max, OuterRef, Q, Sum

from telemetry.models import (
    GpuSample,
    PlannerDemandDaily,
    PlannerPowerHourly,
    PlannerRollupDay,
    PlannerRollupHour,
    PlannerShapeHourly,
    TritonServedHourly,
    UsageHourly,
)
from telemetry.rollups import DAY, HOUR, ceil_day, ceil_hour, covered_run, floor_day, floor_hour
from telemetry.sqlbuckets import max_per_group

G, P = "deployment__allocation__tier__gpu_model_id", "deployment__allocation__tier__profile_id"
SHAPE_SUMS = ("tokens", "requests", "execution_ns", "served_requests", "input_tokens", "output_tokens")
POWER_SUMS = ("n", "sx", "sy", "sxx", "sxy")

Ranges = list[tuple[datetime, datetime]]


def _within(field: str, ranges: Ranges) -> Q | None:
    """field in any of the half-open ranges; None when they are all empty."""
    q = None
    for lo, hi in ranges:
        if lo < hi:
            part = Q(**{f"{field}__gte": lo, f"{field}__lt": hi})
            q = part if q is None else q | part
    return q


def new_shape() -> dict[str, int]:
    return {**dict.fromkeys(SHAPE_SUMS, 0), "peak_tokens": 0}


def add_shape(into: dict[str, int], other: dict[str, int]) -> None:
    for k in SHAPE_SUMS:
        into[k] += other[k]
    into["peak_tokens"] = max(into["peak_tokens"], other["peak_tokens"])


def direct_shapes(ranges: Ranges) -> dict[tuple, dict[str, int]]:
    """(GPU model id, profile id) -> the shape's sums over the usage and Triton hours in `ranges` (four grouped
    queries, none when the ranges are empty)."""
    out: dict[tuple, dict[str, int]] = defaultdict(new_shape)
    where = _within("hour", ranges)
    if where is None:
        return out
    usage = UsageHourly.objects.filter(where)
    # the ranges again inside each subquery (implied by the hour's equality): without them, a planner with stale
    # statistics may semi-join every usage row of all time before filtering by hour
    served = TritonServedHourly.objects.filter(where, deployment=OuterRef("deployment"), hour=OuterRef("hour"),
                                               execution_ns__gt=0)
    metered = UsageHourly.objects.filter(where, tenant=OuterRef("tenant"), deployment=OuterRef("deployment"),
                                         hour=OuterRef("hour"))
    for row in (usage.filter(Exists(served)).values(G, P)
                .annotate(t=Sum(F("input_tokens") + F("output_tokens")), r=Sum("requests")).order_by()):
        f = out[(row[G], row[P])]
        f["tokens"], f["requests"] = int(row["t"] or 0), int(row["r"] or 0)
    for row in (TritonServedHourly.objects.filter(where, execution_ns__gt=0).filter(Exists(metered)).values(G, P)
                .annotate(ns=Sum("execution_ns"), r=Sum("requests")).order_by()):
        f = out[(row[G], row[P])]
        f["execution_ns"], f["served_requests"] = int(row["ns"] or 0), int(row["r"] or 0)
    for row in usage.values(G, P).annotate(i=Sum("input_tokens"), o=Sum("output_tokens")).order_by():
        f = out[(row[G], row[P])]
        f["input_tokens"], f["output_tokens"] = int(row["i"] or 0), int(row["o"] or 0)
    # the busiest slice-hour: tokens per (allocation, hour), then the maximum per shape
    per_hour = (usage.values("deployment__allocation_id", "hour", G, P)
                .annotate(t=Sum(F("input_tokens") + F("output_tokens"))).order_by())
    for model_id, profile_id, t in max_per_group(per_hour, [G, P], "t"):
        out[(model_id, profile_id)]["peak_tokens"] = int(t or 0)
    return out


def direct_power(resolutions: tuple[str, ...], ranges: Ranges) -> dict[tuple[str, int], dict[str, float]]:
    """(resolution, GPU model id) -> n, Σactivity, Σpower, Σactivity², Σactivity·power over the samples of
    those resolutions with a time in `ranges` (one grouped query)."""
    where = _within("ts", ranges)
    if where is None or not resolutions:
        return {}
    rows = (GpuSample.objects.filter(where, resolution__in=resolutions)
            .values("resolution", "gpu__gpu_model_id")
            .annotate(n=Count("id"), sx=Sum("activity"), sy=Sum("power_w"),
                      sxx=Sum(F("activity") * F("activity"), output_field=FloatField()),
                      sxy=Sum(F("activity") * F("power_w"), output_field=FloatField()))
            .order_by().values_list("resolution", "gpu__gpu_model_id", *POWER_SUMS))
    return {(res, model_id): dict(zip(POWER_SUMS, (v or 0 for v in sums), strict=True))
            for res, model_id, *sums in rows}


def direct_demand(ranges: Ranges) -> dict[tuple[int, str], int]:
    """(tenant id, deployment name) -> tokens in its busiest usage hour in `ranges` (one query)."""
    where = _within("hour", ranges)
    if where is None:
        return {}
    per_hour = (UsageHourly.objects.filter(where).values("tenant_id", "deployment__name", "hour")
                .annotate(t=Sum(F("input_tokens") + F("output_tokens"))).order_by())
    peaks = max_per_group(per_hour, ["tenant_id", "deployment__name"], "t")
    return {(tenant, name): int(t or 0) for tenant, name, t in peaks}


@dataclass(frozen=True)
class Split:
    """A window split into its rolled-up hours [rolled_lo, rolled_hi) and the ranges read directly."""

    since: datetime
    until: datetime
    rolled_lo: datetime | None = None
    rolled_hi: datetime | None = None

    @property
    def rolled(self) -> bool:
        return self.rolled_lo is not None

    @property
    def direct(self) -> Ranges:
        if self.rolled_lo is None or self.rolled_hi is None:
            return [(self.since, self.until)]
        return [(self.since, self.rolled_lo), (self.rolled_hi, self.until)]


def split(since: datetime, until: datetime) -> Split:
    """The rolled-up hours of [since, until): the run of hours that start and end inside it and are all rolled
    up (one query). Gaps in the run (never made by the job) mean no rollup is read."""
    run = covered_run(PlannerRollupHour.objects.all(), "hour", ceil_hour(since), floor_hour(until), HOUR)
    return Split(since, until) if run is None else Split(since, until, *run)


def shapes(since: datetime, until: datetime, where: Split | None = None) -> dict[tuple, dict[str, int]]:
    """(GPU model id, profile id) -> the shape's sums over [since, until)."""
    where = where or split(since, until)
    out = direct_shapes(where.direct)
    if where.rolled:
        fields = (*SHAPE_SUMS, "peak_tokens")
        rolled = (PlannerShapeHourly.objects.filter(hour__gte=where.rolled_lo, hour__lt=where.rolled_hi)
                  .values("gpu_model_id", "profile_id")
                  .annotate(**{k: Sum(k) for k in SHAPE_SUMS}, peak_tokens=Max("peak_tokens")).order_by()
                  .values_list("gpu_model_id", "profile_id", *fields))
        for model_id, profile_id, *sums in rolled:
            add_shape(out[(model_id, profile_id)], {k: int(v or 0) for k, v in zip(fields, sums, strict=True)})
    return out


def power(resolutions: tuple[str, ...], since: datetime, until: datetime,
          where: Split | None = None) -> dict[tuple[str, int], dict[str, float]]:
    """(resolution, GPU model id) -> the least-squares sums over the samples of [since, until)."""
    where = where or split(since, until)
    out = direct_power(resolutions, where.direct)
    if where.rolled and resolutions:
        for res, model_id, *sums in (
                PlannerPowerHourly.objects.filter(resolution__in=resolutions, hour__gte=where.rolled_lo,
                                                  hour__lt=where.rolled_hi)
                .values("resolution", "gpu_model_id").annotate(**{k: Sum(k) for k in POWER_SUMS}).order_by()
                .values_list("resolution", "gpu_model_id", *POWER_SUMS)):
            mine = out.setdefault((res, model_id), dict.fromkeys(POWER_SUMS, 0.0))
            for k, v in zip(POWER_SUMS, sums, strict=True):
                mine[k] += v or 0
    return out


def demand(since: datetime, until: datetime, where: Split | None = None) -> dict[tuple[int, str], int]:
    """(tenant id, deployment name) -> tokens in its busiest usage hour of [since, until): the daily rollup for
    the run of rolled-up days (PlannerRollupDay) among the rolled-up hours, the usage rows for the hours around
    them."""
    where = where or split(since, until)
    if where.rolled_lo is None or where.rolled_hi is None:
        return direct_demand(where.direct)
    days = covered_run(PlannerRollupDay.objects.all(), "day", ceil_day(where.rolled_lo), floor_day(where.rolled_hi),
                       DAY)
    if days is None:
        return direct_demand([(since, until)])
    d_lo, d_hi = days
    out = direct_demand([(since, d_lo), (d_hi, until)])
    for tenant, name, t in (PlannerDemandDaily.objects.filter(day__gte=d_lo, day__lt=d_hi)
                            .values("tenant_id", "name").annotate(t=Max("tokens")).order_by()
                            .values_list("tenant_id", "name", "t")):
        out[(tenant, name)] = max(out.get((tenant, name), 0), int(t or 0))
    return out

