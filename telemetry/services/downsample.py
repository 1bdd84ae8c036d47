"""Downsampling and retention of GPU telemetry.

raw -> 5m and raw -> 1h: both rollups are computed from the raw samples (never from another rollup),
so an hourly average is exactly the average of the raw samples in that hour. A bucket is rolled up
once it is complete (its end is at least ``grace`` in the past) and is then never recomputed: rollups
are insert-only after a per-(GPU or slice) watermark, so running it again is a no-op and pruning raw
rows later can never change a rollup. Fields are plain averages over the bucket's raw rows
(``samples`` of them); ``utilization`` averages the non-null values (null if all were null, i.e. MIG);
``energy_j`` is the last cumulative counter value in the bucket.

Retention (TESSERA_TELEMETRY_RETENTION_DAYS, default raw 1, 5m 30, 1h 365): a raw row is deleted
only when older than its retention *and* both its 5m and 1h buckets exist; a 5m row only when its
hour has been rolled up too. Late raw rows that land behind the watermark are not rolled up.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from telemetry.models import GpuSample, MigSample, Resolution

STEP_S = {Resolution.FIVE_MIN: 300, Resolution.HOUR: 3600}
DEFAULT_RETENTION_DAYS = {Resolution.RAW: 1, Resolution.FIVE_MIN: 30, Resolution.HOUR: 365}
GPU_AVG = ("activity", "memory_used_mb", "memory_total_mb", "power_w", "temperature_c", "sm_clock_mhz")
MIG_AVG = ("activity", "memory_used_mb", "memory_total_mb")


def retention_days() -> dict[str, float]:
    conf = getattr(settings, "TESSERA_TELEMETRY_RETENTION_DAYS", None) or {}
    return {r: float(conf.get(r, d)) for r, d in DEFAULT_RETENTION_DAYS.items()}


def bucket(ts: datetime, step_s: int) -> datetime:
    epoch = int(ts.timestamp())
    return datetime.fromtimestamp(epoch - epoch % step_s, tz=UTC)


def _gpu_rollup(gpu_id: int, res: str, b: datetime, rows: list[GpuSample]) -> GpuSample:
    n = len(rows)
    utils = [r.utilization for r in rows if r.utilization is not None]
    last = max(rows, key=lambda r: r.ts)
    return GpuSample(
        gpu_id=gpu_id, resolution=res, ts=b, samples=n,
        utilization=sum(utils) / len(utils) if utils else None, utilization_samples=len(utils),
        energy_j=last.energy_j, mig=any(r.mig for r in rows),
        **{f: sum(getattr(r, f) for r in rows) / n for f in GPU_AVG},
    )


def _mig_rollup(key: tuple, res: str, b: datetime, rows: list[MigSample]) -> MigSample:
    n = len(rows)
    last = max(rows, key=lambda r: r.ts)
    return MigSample(
        gpu_id=key[0], mig_uuid=key[1], gi_id=last.gi_id, compute_slices=last.compute_slices,
        allocation_id=last.allocation_id, tenant_id=last.tenant_id, resolution=res, ts=b, samples=n,
        **{f: sum(getattr(r, f) for r in rows) / n for f in MIG_AVG},
    )


def _roll(model, key_fields: tuple[str, ...], build, res: Resolution, end: datetime) -> int:
    step = STEP_S[res]
    marks = {tuple(row[:-1]): row[-1] for row in model.objects.filter(resolution=res)
             .values(*key_fields).annotate(m=Max("ts")).values_list(*key_fields, "m")}
    raw = model.objects.filter(resolution=Resolution.RAW, ts__lt=end)
    raw_keys = set(raw.values_list(*key_fields).distinct())
    if marks and raw_keys <= set(marks):
        raw = raw.filter(ts__gte=min(marks.values()) + timedelta(seconds=step))
    groups: dict[tuple, dict[datetime, list]] = defaultdict(lambda: defaultdict(list))
    for r in raw.order_by("ts").iterator(chunk_size=2000):
        key = tuple(getattr(r, f if f != "gpu" else "gpu_id") for f in key_fields)
        mark = marks.get(key)
        if mark is not None and r.ts < mark + timedelta(seconds=step):
            continue
        groups[key][bucket(r.ts, step)].append(r)
    out = [build(key, res, b, rows) for key, buckets in groups.items() for b, rows in buckets.items()]
    model.objects.bulk_create(out, ignore_conflicts=True, batch_size=1000)
    return len(out)


def downsample(now: datetime | None = None, grace: timedelta = timedelta(minutes=2)) -> dict[str, int]:
    """Roll every complete bucket not yet rolled up. Returns rows created per resolution."""
    now = now or timezone.now()
    out: dict[str, int] = {}  # per resolution (Resolution values), then mig_<resolution>
    for res, step in STEP_S.items():
        end = bucket(now - grace, step)
        out[res] = _roll(GpuSample, ("gpu",), lambda k, r, b, rows: _gpu_rollup(k[0], r, b, rows), res, end)
        out[f"mig_{res}"] = _roll(MigSample, ("gpu", "mig_uuid"), _mig_rollup, res, end)
    return out


def _prune(model, key_fields: tuple[str, ...], res: Resolution, cutoff: datetime,
           needs: tuple[Resolution, ...]) -> int:
    """Delete rows of `res` older than `cutoff` whose buckets in every resolution of `needs` exist
    (rollups are contiguous up to their watermark, so 'before the watermark' means 'rolled up')."""
    if not needs:
        return model.objects.filter(resolution=res, ts__lt=cutoff).delete()[0]
    limits: dict[tuple, datetime] = {}
    for i, need in enumerate(needs):
        step = timedelta(seconds=STEP_S[need])
        marks = (model.objects.filter(resolution=need).values(*key_fields).annotate(m=Max("ts"))
                 .values_list(*key_fields, "m"))
        seen = {}
        for row in marks:
            key, mark = tuple(row[:-1]), row[-1] + step
            if i == 0 or key in limits:
                seen[key] = min(mark, limits.get(key, mark))
        limits = seen
    deleted = 0
    for key, limit in limits.items():
        flt = {("gpu_id" if f == "gpu" else f): v for f, v in zip(key_fields, key, strict=True)}
        deleted += model.objects.filter(resolution=res, ts__lt=min(cutoff, limit), **flt).delete()[0]
    return deleted


def prune(now: datetime | None = None) -> dict[str, int]:
    now = now or timezone.now()
    days = retention_days()
    out: dict[str, int] = {}  # per resolution (Resolution values), then mig_<resolution>
    plan = [(Resolution.RAW, (Resolution.FIVE_MIN, Resolution.HOUR)), (Resolution.FIVE_MIN, (Resolution.HOUR,)),
            (Resolution.HOUR, ())]
    for res, needs in plan:
        cutoff = now - timedelta(days=days[res])
        out[res] = _prune(GpuSample, ("gpu",), res, cutoff, needs)
        out[f"mig_{res}"] = _prune(MigSample, ("gpu", "mig_uuid"), res, cutoff, needs)
    return out
