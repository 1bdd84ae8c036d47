"""The capacity planner's hourly rollups, kept by the downsampling job (telemetry.collector_tasks).

Each completed UTC hour is rolled up once it has ended (plus ``SETTLE``, so the 5-minute and hourly sample
rollups of the hour exist and the Triton scrape has moved on to the next hour): PlannerShapeHourly (the
per-shape sums), PlannerPowerHourly (least-squares sums per GPU model and sample resolution) and the marker
PlannerRollupHour; once all 24 hours of a UTC day are rolled up, PlannerDemandDaily (each tenant model's
busiest hour of the day) and the day's marker PlannerRollupDay. Rolling an hour again deletes its day's marker in
the same transaction, so a run stopped between its hours and its days (a time limit, a lost worker) leaves
those days unmarked — read from the usage rows — and the next run writes every whole day without a marker.
An hour is computed by the planner's own direct reads (selectors.planner_measures
``direct_*``) over that hour and replaced whole, so running the job again is harmless and a rolled hour holds
what the direct reads give.

The rows an hour is computed from can change after it was rolled up, and the job rolls such hours again:

* **recent hours**: the last ``RECENT`` rolled hours are rolled again on every run (late raw samples, a
  Triton scrape that ran late, events still on their way through the usage stream);
* **late usage**: usage events are accepted for any past hour; ingest stamps the hour's UsageHourly row with
  ``updated_at``, and every hour of the last ``late_days()`` days (TESSERA_PLANNER_LATE_DAYS, default 35)
  holding a usage row updated after its roll (less ``SKEW``, for ingest transactions that committed after the
  roll read) is rolled again. Usage arriving later than that after its hour is not in the rollup;
* **pruned samples**: retention deletes raw and 5-minute samples (downsample.prune); an hour before a
  resolution's retention cutoff that still has rolled sums of that resolution is rolled again, so that the
  rollup holds what remains, as the direct reads see it (once its samples are all gone it has no such row and
  is left alone, however long the job was stopped). The job runs this after pruning.

At most ``max_hours`` hours are rolled per run, oldest first; the rest stay due (not rolled yet, or stale) for
the next run.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, Max, Min, OuterRef
from django.db.models.functions import TruncDay
from django.utils import timezone

from marketplace.selectors import planner_measures as measures
from telemetry.models import (
    GpuSample,
    PlannerDemandDaily,
    PlannerPowerHourly,
    PlannerRollupDay,
    PlannerRollupHour,
    PlannerShapeHourly,
    Resolution,
    TritonServedHourly,
    UsageHourly,
)
from telemetry.rollups import DAY, HOUR, floor_day, floor_hour
from telemetry.services.downsample import retention_days

SETTLE = timedelta(minutes=10)  # an hour is rolled this long after it ends
RECENT = 3  # rolled hours rolled again on every run
SKEW = timedelta(minutes=5)  # usage updated this long before a roll still counts as after it
RESOLUTIONS = (Resolution.RAW, Resolution.FIVE_MIN, Resolution.HOUR)


def late_days() -> float:
    return settings.TESSERA_PLANNER_LATE_DAYS


def _first_data_hour() -> datetime | None:
    firsts = [model.objects.aggregate(m=Min(field))["m"]
              for model, field in ((UsageHourly, "hour"), (TritonServedHourly, "hour"), (GpuSample, "ts"))]
    firsts = [f for f in firsts if f is not None]
    return floor_hour(min(firsts)) if firsts else None


def roll_hour(hour: datetime, now: datetime | None = None) -> None:
    """Compute one hour's rollup rows from the usage, Triton and sample rows, and replace the hour's rows."""
    rolled_at = now or timezone.now()
    span = [(hour, hour + HOUR)]
    shapes = measures.direct_shapes(span)
    power = measures.direct_power(RESOLUTIONS, span)
    shape_rows = [PlannerShapeHourly(hour=hour, gpu_model_id=g, profile_id=p, **sums)
                  for (g, p), sums in shapes.items() if any(sums.values())]
    power_rows = [PlannerPowerHourly(hour=hour, resolution=res, gpu_model_id=model_id, **sums)
                  for (res, model_id), sums in power.items() if sums["n"]]
    with transaction.atomic():
        # the marker first: a second run rolling the same hour waits here for this one to commit, then replaces
        # its rows (sums must never be written twice)
        PlannerRollupHour.objects.update_or_create(hour=hour, defaults={"rolled_at": rolled_at})
        PlannerRollupDay.objects.filter(day=floor_day(hour)).delete()  # its day is written again from its hours
        PlannerShapeHourly.objects.filter(hour=hour).delete()
        PlannerPowerHourly.objects.filter(hour=hour).delete()
        PlannerShapeHourly.objects.bulk_create(shape_rows)
        PlannerPowerHourly.objects.bulk_create(power_rows)


def roll_day(day: datetime, now: datetime | None = None) -> bool:
    """Write one UTC day's busiest hours and its marker when its 24 hours are all rolled up; False (and
    nothing) if not."""
    if PlannerRollupHour.objects.filter(hour__gte=day, hour__lt=day + DAY).count() != 24:
        return False
    peaks = measures.direct_demand([(day, day + DAY)])
    rows = [PlannerDemandDaily(day=day, tenant_id=t, name=name, tokens=v) for (t, name), v in peaks.items() if v]
    with transaction.atomic():
        PlannerDemandDaily.objects.filter(day=day).delete()
        PlannerDemandDaily.objects.bulk_create(rows, batch_size=2000)
        PlannerRollupDay.objects.update_or_create(day=day, defaults={"rolled_at": now or timezone.now()})
    return True


def unmarked_days() -> set[datetime]:
    """UTC days whose 24 hours are rolled up but that have no day marker (an hour rolled again since, by a run
    that stopped before writing its days)."""
    whole = (PlannerRollupHour.objects.annotate(day=TruncDay("hour", tzinfo=UTC)).values("day")
             .annotate(n=Count("hour")).filter(n=24).order_by().values_list("day", flat=True))
    return set(whole) - set(PlannerRollupDay.objects.values_list("day", flat=True))


def stale_hours(now: datetime) -> set[datetime]:
    """Rolled hours whose rows changed since: usage updated after the roll (late events, within the last
    late_days()) and samples pruned since the roll (hours that straddled a retention cutoff when rolled)."""
    out: set[datetime] = set()
    rolled = PlannerRollupHour.objects.filter(hour=OuterRef("hour"), rolled_at__lt=OuterRef("updated_at") + SKEW)
    out |= set(UsageHourly.objects.filter(hour__gte=now - timedelta(days=late_days())).filter(Exists(rolled))
               .values_list("hour", flat=True).distinct())
    days = retention_days()
    for res in RESOLUTIONS:
        cutoff = now - timedelta(days=days[res])
        # hours rolled with samples that retention may have deleted since (the job prunes before it rolls: an
        # hour whose samples are all gone keeps no row of the resolution once rolled again)
        out |= set(PlannerPowerHourly.objects.filter(resolution=res, hour__lt=cutoff)
                   .values_list("hour", flat=True).distinct())
    return out


def roll(now: datetime | None = None, max_hours: int = 168) -> dict[str, int]:
    """Roll the hours not rolled up yet (oldest first, at most `max_hours` per run; the first run starts at the
    first hour with data), the last RECENT rolled hours and the stale ones (see the module's docstring), then
    the days whose hours changed. Returns the hours and days written."""
    now = now or timezone.now()
    last = floor_hour(now - SETTLE) - HOUR  # the newest hour that has ended and settled
    mark = PlannerRollupHour.objects.aggregate(m=Max("hour"))["m"]
    first = mark + HOUR if mark else _first_data_hour()
    hours: set[datetime] = set()
    if first is not None:
        h = first
        while h <= last and len(hours) < max_hours:
            hours.add(h)
            h += HOUR
    if mark is not None:
        hours |= {mark - k * HOUR for k in range(RECENT)}
        hours |= stale_hours(now)
    due = sorted(h for h in hours if h <= last)[:max_hours]  # oldest first; the rest stay due for the next run
    for h in due:
        roll_hour(h, now)  # rolled_at: the run's start, before any of the hours' rows are read
    days = {floor_day(h) for h in due} | unmarked_days()
    written = sum(roll_day(d, now) for d in sorted(days))
    return {"hours": len(due), "days": written}

