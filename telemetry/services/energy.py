"""Energy: kWh per GPU from the stored cumulative energy counter, apportioned to slices and tenants,
and the power cost per 1K tokens per tier.

* kWh per GPU over [start, end]: the sum of counter increases between consecutive stored samples of
  one resolution (the finest one that reaches back to `start`; a rollup's counter is the last value
  in its bucket and stands at the bucket's end). A decrease means the driver reloaded and the
  counter restarted at zero: the new value is the increase.
* Apportioning is by **compute share**: each interval's energy goes to the slices present at the
  end of the interval (the MigSample rows of the same time), each getting compute_slices / 7 of it
  (a whole GPU: all). What no slice holds is ``unallocated`` (idle capacity: the MSP's overhead).
  Compute share rather than memory share because power follows the SMs in use, and it matches how
  the simulator and the collector weight slice activity. A slice's energy goes to its allocation's
  tenant.
* Price: TESSERA_ENERGY_PRICE_PER_KWH (default 0.12, the currency of the plans).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Max, Min, Q, QuerySet, Sum
from django.db.models.functions import TruncDay
from django.utils import timezone

from marketplace.formatting import significant
from marketplace.models import Allocation, Gpu, GpuModel, Tier
from marketplace.services.billing.units import MILLION
from telemetry.models import EnergyDaily, EnergyHourly, GpuSample, MigSample, Resolution, UsageHourly
from telemetry.rollups import DAY, HOUR, ceil_day, ceil_hour, covered_run, floor_day, floor_hour

J_PER_KWH = 3_600_000.0
# Keyed by the stored resolution value (a Resolution is that str): rows read back give plain strs.
STEP: dict[str, timedelta] = {Resolution.RAW: timedelta(0), Resolution.FIVE_MIN: timedelta(minutes=5),
                              Resolution.HOUR: timedelta(hours=1)}
LOOKBACK: dict[str, timedelta] = {Resolution.RAW: timedelta(hours=1), Resolution.FIVE_MIN: timedelta(minutes=10),
                                  Resolution.HOUR: timedelta(hours=2)}


def price_per_kwh() -> Decimal:
    return Decimal(str(getattr(settings, "TESSERA_ENERGY_PRICE_PER_KWH", "0.12")))


@dataclass
class EnergyReport:
    start: datetime
    end: datetime
    gpu_kwh: dict[int, float] = field(default_factory=dict)
    allocation_kwh: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    tenant_kwh: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    unallocated_kwh: float = 0.0
    gpu_unallocated_kwh: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    held_kwh: dict[tuple[int | None, int | None], float] = field(default_factory=lambda: defaultdict(float))

    def add(self, other: EnergyReport) -> None:
        """Sum another report (of an adjacent span) into this one."""
        for k, v in other.gpu_kwh.items():
            self.gpu_kwh[k] = self.gpu_kwh.get(k, 0.0) + v
        for mine, theirs in ((self.allocation_kwh, other.allocation_kwh), (self.tenant_kwh, other.tenant_kwh),
                             (self.gpu_unallocated_kwh, other.gpu_unallocated_kwh)):
            for k, v in theirs.items():
                mine[k] += v
        for held, v in other.held_kwh.items():
            self.held_kwh[held] += v
        self.unallocated_kwh += other.unallocated_kwh

    @property
    def total_kwh(self) -> float:
        return sum(self.gpu_kwh.values())


def gpu_kwh(gpu_id: int, start: datetime, end: datetime) -> float:
    return apportion(start, end, gpus=[gpu_id]).gpu_kwh.get(gpu_id, 0.0)


ORDER = (Resolution.RAW, Resolution.FIVE_MIN, Resolution.HOUR)


def _window(res: str, start: datetime, end: datetime) -> tuple[datetime, datetime, datetime]:
    """(lowest ts read, highest anchor ts, highest ts) of `res` rows: a row stands at ts + step."""
    step = STEP[res]
    return start - step - LOOKBACK[res], start - step, end - step


def choose_resolutions(start: datetime, end: datetime, gpus=None, coarsest: str = Resolution.RAW) -> dict[int, str]:
    """Each GPU's resolution: the first with a row at or before `start` (an anchor), from `coarsest` down to
    raw (a long range reads rollups: the counter is exact at their bucket ends); else the one (of all three)
    whose first row, standing at its bucket's end, is earliest. GPUs with no row in any window: absent."""
    ids = None if gpus is None else [getattr(g, "pk", g) for g in gpus]
    return choose_spans([(start, end)], ids, coarsest)[0][0]


def _apportion_sql(res: str, gpu_ids: list[int] | None, start: datetime, end: datetime) -> tuple[str, list]:
    """One statement over the GPUs at `res` (all of them when `gpu_ids` is None): each stored counter
    increase from the anchor (the last row standing at or before start) to end (a decrease, a driver
    reload, counts the new value), split by the compute share of the slices present at its end (each GPU's
    model joined before the slices, so that the planner never loops over the GPUs per slice sample). Rows:
    (0, gpu, None, joules, unallocated joules) per GPU and (1, allocation, tenant, joules, None)."""
    ops = connection.ops
    lo, anchor_hi, hi = (ops.adapt_datetimefield_value(x) for x in _window(res, start, end))
    t, m, gpu, gm = (GpuSample._meta.db_table, MigSample._meta.db_table, Gpu._meta.db_table,
                     GpuModel._meta.db_table)
    only, ids = "", []
    if gpu_ids is not None:
        only, ids = f"AND gpu_id IN ({', '.join(['%s'] * len(gpu_ids))})", list(gpu_ids)
    sql = f"""WITH a AS (
        SELECT gpu_id, MAX(ts) AS anchor FROM {t}
        WHERE resolution = %s {only} AND ts >= %s AND ts <= %s GROUP BY gpu_id),
      s AS (
        SELECT g.gpu_id, g.ts, g.energy_j,
               LAG(g.energy_j) OVER (PARTITION BY g.gpu_id ORDER BY g.ts) AS prev
        FROM {t} g LEFT JOIN a ON a.gpu_id = g.gpu_id
        WHERE g.resolution = %s {only.replace("gpu_id", "g.gpu_id")} AND g.ts >= %s AND g.ts <= %s
          AND g.ts >= COALESCE(a.anchor, %s)),
      inc AS (
        SELECT s.gpu_id, s.ts, CASE WHEN s.energy_j >= s.prev THEN s.energy_j - s.prev ELSE s.energy_j END AS j,
               COALESCE(NULLIF(gm.compute_slices, 0), 7) AS cs
        FROM s JOIN {gpu} gpu ON gpu.id = s.gpu_id JOIN {gm} gm ON gm.id = gpu.gpu_model_id
        WHERE s.prev IS NOT NULL),
      ms AS MATERIALIZED (
        SELECT gpu_id, ts, allocation_id, tenant_id, compute_slices FROM {m}
        WHERE resolution = %s {only} AND ts >= %s AND ts <= %s
          AND (allocation_id IS NOT NULL OR tenant_id IS NOT NULL)),
      sl AS (
        SELECT inc.gpu_id, inc.ts, inc.j, ms.allocation_id, ms.tenant_id,
               CASE WHEN ms.compute_slices >= inc.cs THEN 1.0 ELSE ms.compute_slices * 1.0 / inc.cs END AS share
        FROM inc JOIN ms ON ms.gpu_id = inc.gpu_id AND ms.ts = inc.ts),
      held AS (SELECT gpu_id, ts, SUM(share) AS s FROM sl GROUP BY gpu_id, ts)
    SELECT 0, inc.gpu_id, NULL, SUM(inc.j),
           SUM(inc.j * CASE WHEN COALESCE(h.s, 0) >= 1 THEN 0 ELSE 1 - COALESCE(h.s, 0) END)
    FROM inc LEFT JOIN held h ON h.gpu_id = inc.gpu_id AND h.ts = inc.ts GROUP BY inc.gpu_id
    UNION ALL
    SELECT 1, allocation_id, tenant_id, SUM(j * share), NULL FROM sl GROUP BY allocation_id, tenant_id"""
    return sql, [res, *ids, lo, anchor_hi, res, *ids, lo, hi, lo, res, *ids, lo, hi]


def _epoch_sql(sql: str) -> str:
    """Whole epoch seconds of a timestamp expression (rounded down), as EpochBucket(…, 1) computes them."""
    if connection.vendor == "sqlite":
        return f"CAST(strftime('%%s', {sql}) AS INTEGER)"
    return f"FLOOR(DATE_PART('epoch', {sql}))"


def _probe_sql(spans: list[tuple[datetime, datetime]], gpu_ids: list[int] | None, coarsest: str
               ) -> tuple[str, list]:
    """choose_resolutions' facts for every GPU and span in one statement of index probes (the first row of each
    resolution in its window, not every row of it): rows (span, gpu, then per ORDER level the first row's epoch
    seconds and whether it anchors). The levels other than `coarsest` are only probed for the GPUs that
    `coarsest` does not anchor (choose_resolutions picks `coarsest` for those whatever the others hold)."""
    ops = connection.ops
    t, gpu = GpuSample._meta.db_table, Gpu._meta.db_table
    only, ids = "", []
    if gpu_ids is not None:
        only, ids = f"WHERE {gpu}.id IN ({', '.join(['%s'] * len(gpu_ids))})", list(gpu_ids)
    probe = f"(SELECT MIN(ts) FROM {t} WHERE gpu_id = {{gpu}} AND resolution = %s AND ts >= %s AND ts <= %s)"
    others = [r for r in ORDER if r != coarsest]
    ctes: list[str] = []
    parts: list[str] = []
    cte_params: list = []
    params: list = []
    for i, (start, end) in enumerate(spans):
        win: dict[str, list] = {r: [ops.adapt_datetimefield_value(x) for x in _window(r, start, end)] for r in ORDER}
        lo, anchor_hi, hi = win[coarsest]
        inner = f"SELECT {gpu}.id AS id, {probe.format(gpu=f'{gpu}.id')} AS f0 FROM {gpu} {only}"
        params_inner = [coarsest, lo, hi, *ids]
        mid_cols = ", ".join(f"CASE WHEN c.f0 IS NOT NULL AND c.f0 <= %s THEN NULL ELSE {probe.format(gpu='c.id')} END "
                             f"AS f{k + 1}" for k in range(len(others)))
        params_mid = []
        for r in others:
            params_mid += [anchor_hi, r, win[r][0], win[r][2]]
        outer_cols = [f"{_epoch_sql('m.f0')}", "CASE WHEN m.f0 <= %s THEN 1 ELSE 0 END"]
        params_outer = [anchor_hi]
        for k, r in enumerate(others, start=1):
            outer_cols += [_epoch_sql(f"m.f{k}"), f"CASE WHEN m.f{k} <= %s THEN 1 ELSE 0 END"]
            params_outer.append(win[r][1])
        # MATERIALIZED: each probe runs once per GPU (inlined, PostgreSQL repeats a subquery per reference)
        ctes.append(f"c{i} AS MATERIALIZED ({inner}), m{i} AS MATERIALIZED (SELECT c.id, c.f0, {mid_cols} FROM c{i} c)")
        parts.append(f"SELECT %s, m.id, {', '.join(outer_cols)} FROM m{i} m")
        cte_params += [*params_inner, *params_mid]
        params += [i, *params_outer]
    return f"WITH {', '.join(ctes)} " + " UNION ALL ".join(parts), [*cte_params, *params]


def _choose(found: dict[str, tuple[float, bool]], coarsest: str) -> str | None:
    """choose_resolutions' rule for one GPU: found[level] = (first row's epoch + step, anchored)."""
    order = ORDER[:ORDER.index(coarsest) + 1][::-1]
    anchored = [r for r in order if r in found and found[r][1]]
    if anchored:
        return anchored[0]
    if not found:
        return None
    return min(found, key=lambda r: (found[r][0], ORDER.index(r)))


def choose_spans(spans: list[tuple[datetime, datetime]], ids: list[int] | None, coarsest: str
                 ) -> tuple[list[dict[int, str]], list[list[int]]]:
    """choose_resolutions for each span (one statement): per span, {GPU: resolution} and every GPU asked about."""
    chosen: list[dict[int, str]] = [{} for _ in spans]
    every: list[list[int]] = [[] for _ in spans]
    if not spans or (ids is not None and not ids):
        return chosen, every
    others = [r for r in ORDER if r != coarsest]
    sql, params = _probe_sql(spans, ids, coarsest)
    with connection.cursor() as cur:
        cur.execute(sql, params)
        rows = cur.fetchall()
    for span, gpu_id, *facts in rows:
        every[int(span)].append(gpu_id)
        found = {}
        for r, (first, anchored) in zip([coarsest, *others], zip(facts[::2], facts[1::2], strict=True), strict=True):
            if first is not None:
                found[r] = (float(first) + STEP[r].total_seconds(), bool(anchored))
        res = _choose(found, coarsest)
        if res is not None:
            chosen[int(span)][gpu_id] = res
    return chosen, every


def apportion_spans(spans: list[tuple[datetime, datetime]], gpus=None, coarsest: str = Resolution.RAW
                    ) -> list[EnergyReport]:
    """`apportion` of each span, in two statements whatever the number of spans and GPUs: one that chooses each
    GPU's resolution per span (index probes), one that apportions every span (the union of their _apportion_sql
    statements)."""
    reports = [EnergyReport(start, end) for start, end in spans]
    if not spans:
        return reports
    ids = None if gpus is None else [getattr(g, "pk", g) for g in gpus]
    if ids is not None and not ids:
        return reports
    for report in reports:  # every GPU asked about has a figure, 0 when it has no samples
        report.gpu_kwh.update(dict.fromkeys(ids or (), 0.0))
    chosen, every = choose_spans(spans, ids, coarsest)
    for report, gpu_ids in zip(reports, every, strict=True):
        report.gpu_kwh.update(dict.fromkeys(gpu_ids, 0.0))
    statements, params = [], []
    for span, (start, end) in enumerate(spans):
        in_use = set(chosen[span].values())
        for res in ORDER:
            if res not in in_use:
                continue
            group = (None if ids is None and len(in_use) == 1
                     else sorted(g for g, r in chosen[span].items() if r == res))
            part, part_params = _apportion_sql(res, group, start, end)
            statements.append(f"SELECT %s AS span, q.* FROM ({part}) q")
            params += [span, *part_params]
    if not statements:
        return reports
    with connection.cursor() as cur:
        cur.execute(" UNION ALL ".join(statements), params)
        rows = cur.fetchall()
    for span, kind, key, tenant, joules, unheld in rows:
        report = reports[int(span)]
        kwh = float(joules or 0) / J_PER_KWH
        if kind == 0:
            report.gpu_kwh[key] = kwh
            report.gpu_unallocated_kwh[key] = float(unheld or 0) / J_PER_KWH
            report.unallocated_kwh += float(unheld or 0) / J_PER_KWH
            continue
        report.held_kwh[(key, tenant)] += kwh
        if key is not None:
            report.allocation_kwh[key] += kwh
        if tenant is not None:
            report.tenant_kwh[tenant] += kwh
    return reports


def apportion(start: datetime, end: datetime, gpus=None, coarsest: str = Resolution.RAW) -> EnergyReport:
    """kWh per GPU, per allocation, per tenant and unallocated over [start, end]: the counter increases
    and their compute-share split are summed by the database (two statements, whatever the fleet's size:
    apportion_spans). `gpus`: GPU ids (or a queryset of GPUs); all by default. `coarsest`: the coarsest
    resolution to read (see choose_resolutions); raw by default."""
    return apportion_spans([(start, end)], gpus, coarsest)[0]


#: ranges at least this long read the hourly energy rollup for their whole hours
ROLLUP_FROM = timedelta(hours=6)


def rollup_hours(now: datetime | None = None, max_hours: int = 72, grace: timedelta = timedelta(minutes=10)) -> int:
    """Apportion each completed UTC hour after the newest one stored (at most `max_hours` per run, oldest
    first; the first run starts `max_hours` back, and never before the first sample) into EnergyHourly.
    An hour is apportioned from the samples as a short chart would (5-minute rollups, else raw, else
    hourly) and replaced whole, so running it again is harmless. Returns the hours written."""
    now = now or timezone.now()
    last = floor_hour(now - grace) - HOUR  # the newest hour that has ended (with grace for late samples)
    mark = EnergyHourly.objects.aggregate(m=Max("hour"))["m"]
    first_sample = GpuSample.objects.aggregate(m=Min("ts"))["m"]
    if first_sample is None:
        return 0
    h = mark + HOUR if mark else max(last - (max_hours - 1) * HOUR, floor_hour(first_sample))
    done = 0
    while h <= last and done < max_hours:
        rep = apportion(h, h + HOUR, coarsest=Resolution.FIVE_MIN)
        rows = [EnergyHourly(hour=h, gpu_id=g, kwh=k, unallocated_kwh=rep.gpu_unallocated_kwh.get(g, 0.0))
                for g, k in rep.gpu_kwh.items() if k]
        rows += [EnergyHourly(hour=h, allocation_id=a, tenant_id=t, kwh=k) for (a, t), k in rep.held_kwh.items() if k]
        rows.append(EnergyHourly(hour=h))  # the hour is rolled up (even when nothing was drawn): charts count these
        with transaction.atomic():
            EnergyHourly.objects.filter(hour=h).delete()
            EnergyHourly.objects.bulk_create(rows, batch_size=2000)
        h += HOUR
        done += 1
    return done


#: the row of a rollup (hourly or daily) that marks its hour or day as rolled up
MARKER = Q(gpu__isnull=True, allocation__isnull=True, tenant__isnull=True)


def rollup_days() -> int:
    """Sum each UTC day whose 24 hours are all in EnergyHourly (and that is not rolled up yet) into
    EnergyDaily, with a marker row; a day is replaced whole, so running it again is harmless. Returns
    the days written."""
    mark = EnergyDaily.objects.aggregate(m=Max("day"))["m"]
    hours = EnergyHourly.objects.filter(MARKER)
    if mark is not None:
        hours = hours.filter(hour__gte=mark + DAY)
    days = [d for d, n in (hours.annotate(d=TruncDay("hour", tzinfo=UTC)).values("d").order_by("d")
                           .annotate(n=Count("hour", distinct=True)).values_list("d", "n")) if n == 24]
    for day in days:
        rolled = EnergyHourly.objects.filter(hour__gte=day, hour__lt=day + DAY).exclude(MARKER)
        rows = [EnergyDaily(day=day, gpu_id=g, kwh=k or 0.0, unallocated_kwh=u or 0.0) for g, k, u in (
            rolled.filter(gpu__isnull=False).values("gpu_id").order_by()
            .annotate(k=Sum("kwh"), u=Sum("unallocated_kwh")).values_list("gpu_id", "k", "u"))]
        rows += [EnergyDaily(day=day, allocation_id=a, tenant_id=t, kwh=k or 0.0) for a, t, k in (
            rolled.filter(gpu__isnull=True).values("allocation_id", "tenant_id").order_by()
            .annotate(k=Sum("kwh")).values_list("allocation_id", "tenant_id", "k"))]
        rows.append(EnergyDaily(day=day))  # the marker: the day is rolled up
        with transaction.atomic():
            EnergyDaily.objects.filter(day=day).delete()
            EnergyDaily.objects.bulk_create(rows, batch_size=2000)
    return len(days)


def _add_rolled(report: EnergyReport, rolled: QuerySet) -> None:
    """Sum rollup rows (EnergyHourly or EnergyDaily) into `report`: one grouped query (a GPU's rows name no
    allocation or tenant, a held share's rows no GPU, so one GROUP BY gives both)."""
    for gpu_id, alloc, tenant, kwh, unheld in (
            rolled.exclude(MARKER).values("gpu_id", "allocation_id", "tenant_id").order_by()
            .annotate(k=Sum("kwh"), u=Sum("unallocated_kwh"))
            .values_list("gpu_id", "allocation_id", "tenant_id", "k", "u")):
        if gpu_id is not None:
            report.gpu_kwh[gpu_id] = report.gpu_kwh.get(gpu_id, 0.0) + (kwh or 0.0)
            report.gpu_unallocated_kwh[gpu_id] += unheld or 0.0
            report.unallocated_kwh += unheld or 0.0
            continue
        report.held_kwh[(alloc, tenant)] += kwh or 0.0
        if alloc is not None:
            report.allocation_kwh[alloc] += kwh or 0.0
        if tenant is not None:
            report.tenant_kwh[tenant] += kwh or 0.0


def apportion_range(start: datetime, end: datetime, coarsest: str = Resolution.RAW) -> EnergyReport:
    """`apportion` for a chart: a long range sums the energy rollups for its whole hours that are rolled up
    (from its first whole hour on, without a gap): the daily rollup for its whole days that have one, the
    hourly rollup for the other hours; only the rest (the partial hour at its start, the hours since the
    last rollup) is apportioned from the samples. A short one, or one whose start the hourly rollup does
    not cover, reads the samples throughout."""
    lo, hi = ceil_hour(start), floor_hour(end)
    if hi - lo < ROLLUP_FROM:
        return apportion(start, end, coarsest=coarsest)
    hourly = covered_run(EnergyHourly.objects.filter(MARKER), "hour", lo, hi, HOUR)
    if hourly is None or hourly[0] != lo:
        return apportion(start, end, coarsest=coarsest)
    hi = hourly[1]  # rolled up to here; the samples cover the rest
    report = EnergyReport(start, end)
    # the partial hour at the start and the hours since the last rollup: both in the same two statements
    edges = apportion_spans([span for span in ((start, lo), (hi, end)) if span[0] < span[1]],
                            coarsest=Resolution.FIVE_MIN)
    for gpu_id in (Gpu.objects.values_list("pk", flat=True) if not edges else edges[0].gpu_kwh):
        report.gpu_kwh[gpu_id] = 0.0
    d_lo = ceil_day(lo)
    daily = (covered_run(EnergyDaily.objects.filter(MARKER), "day", d_lo, floor_day(hi), DAY)
             if floor_day(hi) - d_lo >= DAY else None)
    if daily is None:
        _add_rolled(report, EnergyHourly.objects.filter(hour__gte=lo, hour__lt=hi))
    else:
        _add_rolled(report, EnergyDaily.objects.filter(day__gte=daily[0], day__lt=daily[1]))
        _add_rolled(report, EnergyHourly.objects.filter(Q(hour__gte=lo, hour__lt=daily[0])
                                                        | Q(hour__gte=daily[1], hour__lt=hi)))
    for edge in edges:
        report.add(edge)
    return report


def _q(x: Decimal, places: str = "0.000001") -> Decimal:
    return x.quantize(Decimal(places), rounding=ROUND_HALF_UP)


def power_cost_per_tier(start: datetime, end: datetime, report: EnergyReport | None = None) -> dict[str, dict]:
    """tier key -> kWh, power cost, tokens and power cost per 1K tokens over [start, end). Tokens
    are the hourly rollups of hours starting in [start, end)."""
    report = report or apportion(start, end)
    price = price_per_kwh()
    tier_of = dict(Allocation.objects.filter(pk__in=list(report.allocation_kwh)).values_list("pk", "tier_id"))
    kwh_by_tier: dict[int, float] = defaultdict(float)
    for alloc, kwh in report.allocation_kwh.items():
        kwh_by_tier[tier_of[alloc]] += kwh
    tokens = dict(UsageHourly.objects.filter(hour__gte=start, hour__lt=end)
                  .values("deployment__allocation__tier_id")
                  .annotate(t=Sum(F("input_tokens") + F("output_tokens")))
                  .values_list("deployment__allocation__tier_id", "t"))
    out = {}
    for tier in Tier.objects.filter(pk__in=set(kwh_by_tier) | set(tokens)).select_related("gpu_model"):
        kwh = kwh_by_tier.get(tier.pk, 0.0)
        cost = Decimal(str(round(kwh, 9))) * price
        t = int(tokens.get(tier.pk) or 0)
        out[tier.key] = {
            "tier": tier.key, "gpu_model": tier.gpu_model.key, "kwh": kwh, "cost": _q(cost), "tokens": t,
            "cost_per_1k_tokens": _q(cost * 1000 / t, "0.00000001") if t else None,
            # from the unrounded cost, to the digits people read (the chart's bars: 4 significant digits)
            "cost_per_1m_tokens": significant(cost * MILLION / t, 4) if t else None,
        }
    return out
