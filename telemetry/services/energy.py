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
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db.models import F, Sum

from marketplace.models import Allocation, Gpu, Tier
from telemetry.models import GpuSample, MigSample, Resolution, UsageHourly

J_PER_KWH = 3_600_000.0
STEP = {Resolution.RAW: timedelta(0), Resolution.FIVE_MIN: timedelta(minutes=5), Resolution.HOUR: timedelta(hours=1)}
LOOKBACK = {Resolution.RAW: timedelta(hours=1), Resolution.FIVE_MIN: timedelta(minutes=10),
            Resolution.HOUR: timedelta(hours=2)}


def price_per_kwh() -> Decimal:
    return Decimal(str(getattr(settings, "TESSERA_ENERGY_PRICE_PER_KWH", "0.12")))


def _series(gpu_id: int, start: datetime, end: datetime) -> tuple[str, list[tuple[datetime, float, datetime]]]:
    """(resolution, [(effective time, counter J, row ts)]) from one anchor at/before start to end."""
    best: tuple[str, list] | None = None
    for res in (Resolution.RAW, Resolution.FIVE_MIN, Resolution.HOUR):
        step = STEP[res]
        rows = [(ts + step, e, ts) for ts, e in GpuSample.objects.filter(
            gpu_id=gpu_id, resolution=res, ts__gte=start - step - LOOKBACK[res], ts__lte=end - step)
            .order_by("ts").values_list("ts", "energy_j")]
        anchor = [i for i, r in enumerate(rows) if r[0] <= start]
        rows = rows[anchor[-1]:] if anchor else rows
        rows = [r for r in rows if r[0] <= end]
        if not rows:
            continue
        if anchor:
            return res, rows
        if best is None or rows[0][0] < best[1][0][0]:
            best = (res, rows)
    return best if best else (Resolution.RAW, [])


def _increase(prev: float, cur: float) -> float:
    return cur - prev if cur >= prev else cur


@dataclass
class EnergyReport:
    start: datetime
    end: datetime
    gpu_kwh: dict[int, float] = field(default_factory=dict)
    allocation_kwh: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    tenant_kwh: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    unallocated_kwh: float = 0.0

    @property
    def total_kwh(self) -> float:
        return sum(self.gpu_kwh.values())


def gpu_kwh(gpu_id: int, start: datetime, end: datetime) -> float:
    _res, rows = _series(gpu_id, start, end)
    return sum(_increase(a[1], b[1]) for a, b in zip(rows, rows[1:], strict=False)) / J_PER_KWH


def apportion(start: datetime, end: datetime, gpus=None) -> EnergyReport:
    """kWh per GPU, per allocation, per tenant and unallocated over [start, end]."""
    report = EnergyReport(start, end)
    qs = Gpu.objects.select_related("gpu_model") if gpus is None else gpus
    for gpu in qs:
        res, rows = _series(gpu.pk, start, end)
        if len(rows) < 2:
            report.gpu_kwh[gpu.pk] = 0.0
            continue
        slices = defaultdict(list)
        for ts, cs, alloc, tenant in MigSample.objects.filter(
                gpu_id=gpu.pk, resolution=res, ts__gte=rows[1][2], ts__lte=rows[-1][2]).values_list(
                "ts", "compute_slices", "allocation_id", "tenant_id"):
            slices[ts].append((cs, alloc, tenant))
        total_cs = gpu.gpu_model.compute_slices or 7
        kwh_total = 0.0
        for prev, cur in zip(rows, rows[1:], strict=False):
            kwh = _increase(prev[1], cur[1]) / J_PER_KWH
            kwh_total += kwh
            held = 0.0
            for cs, alloc, tenant in slices.get(cur[2], ()):
                share = min(1.0, cs / total_cs)
                if alloc is None and tenant is None:
                    continue
                held += share
                if alloc is not None:
                    report.allocation_kwh[alloc] += kwh * share
                if tenant is not None:
                    report.tenant_kwh[tenant] += kwh * share
            report.unallocated_kwh += kwh * max(0.0, 1.0 - held)
        report.gpu_kwh[gpu.pk] = kwh_total
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
        }
    return out
