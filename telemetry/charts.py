"""Plotly figures, built in Python from stored data only: GPU samples (GpuSample/MigSample, any
resolution), slot occupancy (GpuSlot), the hourly usage rollups (UsageHourly; never raw usage
events) and, for money, the charts' copy of the invoices' rating (``billing.spread.spread_amounts``: a SECOND COPY
of ``billing.rating.rate_month``'s linear part, kept for speed and held equal to the invoices' own lines by the
property test tests/unit/test_spread_amounts.py). Every builder returns ``(figure, numbers)``: the plotly
figure, written as the JSON dict plotly builds (``telemetry.figures``: a SECOND COPY of plotly's own figure JSON,
kept for speed: no graph-object validation of a 1,000-row heatmap; a make_subplots grid built by plotly once per
distinct grid; tests/unit/test_telemetry.py holds the charts to plotly's JSON) and the plain numbers it shows
(what the JSON endpoint and the tests read).

Access: the fleet figures are for MSP operators only; ``tenant_usage`` is scoped through
``visible_to`` (capability "billing"), so a tenant user sees its own usage and spend only.
Params (all optional): ``start``/``end`` (ISO 8601, UTC; default the last 24 h), ``hours`` (instead
of start), ``resolution`` (raw|5m|1h; default by span), ``bucket`` (hour|day, tenant_usage),
``tenant`` (slug, tenant_usage), ``currency`` (the per-tier charts: default USD, only tenants billed in
it; tenant_usage: each tenant in its invoices' currency, or only the tenants billed in the one given).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db.models import Count, F, Max, Q, QuerySet, Sum
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from marketplace.formatting import plotly_unit_price_format
from marketplace.models import Allocation, Gpu, GpuSlot, InvoiceLine, Node, Tier
from marketplace.services.billing.spread import COMMITMENT, SLICES, TOKENS, spread_amounts
from telemetry import figures
from telemetry.models import GpuSample, NodeActivity, Resolution, UsageDaily, UsageHourly
from telemetry.rollups import ceil_day, floor_day
from telemetry.services import energy
from telemetry.sqlbuckets import bucket_sums, from_epoch
from tenants.errors import Forbidden, ServiceError
from tenants.models import Tenant
from tenants.scoping import Principal

MILLION = Decimal(1_000_000)
MARGIN = {"l": 60, "r": 20, "t": 60, "b": 50}
LAYOUT: dict[str, object] = {"template": "plotly_white", "margin": MARGIN}


L = InvoiceLine.Kind


class ChartNotFound(ServiceError):
    status_code = 404


@dataclass
class Period:
    start: datetime
    end: datetime
    resolution: str
    currency: str = "USD"

    @property
    def seconds(self) -> float:
        return max(1.0, (self.end - self.start).total_seconds())


def _dt(value, field: str) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, datetime):
        return value
    try:
        d = parse_datetime(str(value))  # ValueError: well formed but not a date (month 13)
        # in UTC now, so that comparing and subtracting cannot overflow later (year 1 with an offset)
        d = None if d is None else (d if d.tzinfo else d.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        d = None
    if d is None:
        raise ServiceError(f"not a date-time: {value!r}", field=field)
    return d


MAX_HOURS = 400 * 24
RAW_UP_TO = timedelta(hours=6)
FIVE_MIN_UP_TO = timedelta(days=3)
#: points per series at most (a time bucket widens to keep under it), and heatmap cells per axis
MAX_POINTS = 360
HEATMAP_COLUMNS = 120
HEATMAP_ROWS = 128
TOP_TENANTS = 12
#: a series' colour, its tokens bar and its spend line alike (plotly's default colorway)
SERIES_COLOURS = ("#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A", "#19d3f3", "#FF6692", "#B6E880",
                  "#FF97FF", "#FECB52")
NICE_STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800)
#: keyed by the stored resolution value (a Resolution is that str; a Period carries the plain str)
NATIVE_STEP: dict[str, int] = {Resolution.RAW: 60, Resolution.FIVE_MIN: 300, Resolution.HOUR: 3600}


def period(params: dict | None) -> Period:
    p = params or {}
    end = _dt(p.get("end"), "end") or timezone.now()
    start = _dt(p.get("start"), "start")
    if start is None:
        try:
            hours = float(p.get("hours") or 24)
        except ValueError:
            hours = float("nan")
        if not 0 < hours <= MAX_HOURS:  # also NaN
            raise ServiceError(f"hours: a number above 0 and at most {MAX_HOURS}", field="hours")
        try:
            start = end - timedelta(hours=hours)
        except OverflowError:
            raise ServiceError("hours reach back before the year 1", field="hours") from None
    if start >= end:
        raise ServiceError("start must be before end", field="start")
    res = p.get("resolution")
    if res not in (None, "", *Resolution.values):
        raise ServiceError("resolution must be raw, 5m or 1h", field="resolution")
    if not res:  # raw only for short ranges: the rollups (plus the raw tail after them) beyond
        span = end - start
        res = Resolution.RAW if span <= RAW_UP_TO else (
            Resolution.FIVE_MIN if span <= FIVE_MIN_UP_TO else Resolution.HOUR)
    return Period(start, end, res, (p.get("currency") or "USD").upper())


def bucket_step(per: Period, points: int = MAX_POINTS) -> int:
    """Seconds per time bucket: the resolution's own step, widened to a round step that keeps a series
    under `points` points."""
    want = max(NATIVE_STEP[per.resolution], per.seconds / points)
    return next((s for s in NICE_STEPS if s >= want), NICE_STEPS[-1])


def _sample_rows(per: Period, model: type[GpuSample] | type[NodeActivity] = GpuSample) -> QuerySet:
    """GpuSample (or NodeActivity) rows of the period at its resolution; for a rollup, the raw rows after the last
    rolled-up bucket too (the rollup job only writes complete buckets), so the newest minutes are never missing."""
    base = model.objects.filter(ts__gte=per.start, ts__lt=per.end)
    if per.resolution == Resolution.RAW:
        return base.filter(resolution=Resolution.RAW)
    mark = base.filter(resolution=per.resolution).aggregate(m=Max("ts"))["m"]
    tail = mark + timedelta(seconds=NATIVE_STEP[per.resolution]) if mark else per.start
    return base.filter(Q(resolution=per.resolution, ts__lt=tail) | Q(resolution=Resolution.RAW, ts__gte=tail))


def activity(per: Period, *keys: str, step: int | None = None, per_node: bool = False) -> list[dict]:
    """Average activity in percent per time bucket ("t", a datetime; none when step is 0: the whole
    period) and `keys` (GpuSample value paths; with per_node, NodeActivity's: the same sums per node, kept by
    the database), aggregated by the database: a rollup row weighs as many raw samples as it averages."""
    qs = _sample_rows(per, NodeActivity if per_node else GpuSample)
    group = list(keys)
    sums = {"w": Sum("activity_samples") if per_node else Sum(F("activity") * F("samples")), "n": Sum("samples")}
    if step:
        # per sample time first, then per bucket: the bucket's arithmetic runs once per group, not per sample
        # row (the 24 h heatmap at 1,000 GPUs: 36k groups of 286k rows); no ORDER BY: PostgreSQL hashes the groups
        # instead of sorting every sample row (a sort that spilled to disk); they are sorted here
        names = ["b", *keys, "w", "n"]
        rows = sorted(({**dict(zip(names, r, strict=True)), "w": float(r[-2] or 0), "n": int(r[-1] or 0)}
                       for r in bucket_sums(qs.values(*keys, "ts").annotate(**sums).order_by(), list(keys), "ts", step,
                                            ["w", "n"])),
                      key=lambda r: (r["b"], *(r[k] for k in keys)))
    elif group:
        rows = sorted(qs.values(*group).annotate(**sums).order_by(), key=lambda r: tuple(r[k] for k in group))
    else:
        rows = [qs.aggregate(w=Sum(F("activity") * F("samples")), n=Sum("samples"))]
    out = []
    for r in rows:
        if not r["n"]:
            continue
        row = {k: r[k] for k in keys}
        row["avg"] = 100.0 * r["w"] / r["n"]
        row["n"] = r["n"]
        if step:
            row["t"] = from_epoch(r["b"])
        out.append(row)
    return out


def _money(x: Decimal, places: str = "0.000001") -> Decimal:
    return x.quantize(Decimal(places), rounding=ROUND_HALF_UP)


# --- fleet figures ---------------------------------------------------------------------------------

def _when(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M")


def fleet_utilization(per: Period, principal: Principal):
    """Average GPU activity (percent) over time, fleet-wide and per GPU model (one GROUP BY query)."""
    step = bucket_step(per)
    fleet: dict[datetime, list[float]] = defaultdict(lambda: [0.0, 0])
    by_model: dict[str, dict[str, list]] = defaultdict(lambda: {"ts": [], "avg": []})
    for r in activity(per, "gpu__gpu_model__key", step=step):
        acc = fleet[r["t"]]
        acc[0] += r["avg"] * r["n"]
        acc[1] += r["n"]
        m = by_model[r["gpu__gpu_model__key"]]
        m["ts"].append(r["t"].isoformat())
        m["avg"].append(round(r["avg"], 4))
    ts = sorted(fleet)
    numbers = {"ts": [t.isoformat() for t in ts], "fleet": [round(fleet[t][0] / fleet[t][1], 4) for t in ts],
               "by_model": dict(by_model), "step_s": step, "range": _range(per)}
    traces = [{"type": "scatter", "x": numbers["ts"], "y": numbers["fleet"], "name": "fleet", "mode": "lines"}]
    traces += [{"type": "scatter", "x": v["ts"], "y": v["avg"], "name": model, "mode": "lines", "line": {"dash": "dot"}}
               for model, v in sorted(by_model.items())]
    fig = figures.figure(traces, {**LAYOUT, "title": figures.title("Fleet utilization"),
                                  "yaxis": {"range": [0, 100], "title": figures.title("GPU activity (%)")},
                                  "xaxis": {"title": figures.title(f"time (UTC), {_step_words(step)} averages"),
                                            "type": "date", "range": _range(per)}})
    return (fig if ts else figures.empty(fig)), numbers


def _range(per: Period) -> list[str]:
    """A time axis covers the range asked for, not the data's extent (one sample would give a 2 ms axis)."""
    return [per.start.isoformat(), per.end.isoformat()]


def _step_words(step: int) -> str:
    return f"{step // 3600} h" if step % 3600 == 0 else f"{step // 60} min"


def gpu_heatmap(per: Period, principal: Principal):
    """Activity (percent) per GPU (rows; one row per node when the fleet has more GPUs than a page can
    show) and time bucket (columns, at most HEATMAP_COLUMNS): one GROUP BY query."""
    step = bucket_step(per, HEATMAP_COLUMNS)
    per_node = Gpu.objects.count() > HEATMAP_ROWS
    if per_node:
        rows = list(Node.objects.order_by("hostname").annotate(n=Count("gpus")).values_list("pk", "hostname", "n"))
        keys = {pk: i for i, (pk, _h, _n) in enumerate(rows)}
        labels = [f"{host} ({n} GPUs)" for _pk, host, n in rows]
        key = "node_id"
    else:
        gpus = list(Gpu.objects.order_by("node__hostname", "index").values_list("pk", "node__hostname", "index"))
        keys = {pk: i for i, (pk, _h, _i) in enumerate(gpus)}
        labels = [Gpu.label_for(host, index) for _pk, host, index in gpus]
        key = "gpu_id"
    cells = activity(per, key, step=step, per_node=per_node)
    ts = sorted({c["t"] for c in cells})
    col = {t: j for j, t in enumerate(ts)}
    z: list[list[float | None]] = [[None] * len(ts) for _ in labels]
    for c in cells:
        if c[key] in keys:
            z[keys[c[key]]][col[c["t"]]] = round(c["avg"], 1 if per_node else 4)
    iso = [t.isoformat() for t in ts]
    fig = figures.figure(
        [{"type": "heatmap", "x": iso, "y": labels, "z": z, "zmin": 0, "zmax": 100,
          "colorscale": figures.colorscale("Viridis"), "colorbar": {"title": figures.title("activity (%)")},
          "hoverongaps": False}],
        {**LAYOUT, "title": figures.title("GPU activity heatmap" + (" (per node)" if per_node else "")),
         "xaxis": {"title": figures.title(f"time (UTC), {_step_words(step)} averages"), "type": "date",
                   "range": _range(per)},
         "yaxis": {"title": figures.title("node" if per_node else "GPU")},
         "height": max(360, min(1400, 60 + 14 * len(labels)))})
    numbers = {"gpus": labels, "per_node": per_node, "step_s": step, "ts": iso, "z": z, "range": _range(per)}
    return (fig if ts else figures.empty(fig)), numbers


def mig_slot_map(per: Period, principal: Principal):
    """Every GPU's 8 memory slots and the tenant that holds each (empty: free). Its numbers are JSON-ready as
    built (the chart is registered plain: `figure_json` does not copy its 1,000 rows)."""
    gpus = Gpu.objects.order_by("node__hostname", "index").values_list("pk", "node__hostname", "index",
                                                                        "gpu_model__key", "mig_mode")
    held: dict[int, tuple[list, list]] = {}  # GPU -> its 8 slots' tenants, their 8 profiles
    used = 0
    for gpu_id, slot, tenant, profile in GpuSlot.objects.order_by().values_list(  # (no sort: rows go by GPU)
            "gpu_id", "slot", "instance__tenant__slug", "instance__placement__profile__name"):
        cells = held.get(gpu_id) or held.setdefault(gpu_id, ([None] * 8, [None] * 8))
        used += 1
        if 0 <= slot < 8:
            cells[0][slot], cells[1][slot] = tenant, profile or "whole GPU"
    tenants = sorted({t for slots, _p in held.values() for t in slots} - {None})
    code: dict[str | None, int] = {t: i + 1 for i, t in enumerate(tenants)}  # a free slot (None): 0
    rows, labels, z, text = [], [], [], []
    free_slots, free_z, free_text = [None] * 8, [0] * 8, ["free"] * 8  # (shared by every free GPU's row)
    cell_text: dict[tuple, str] = {}  # "tenant (profile)", once per pair
    for pk, host, index, model, mig in gpus:
        label = Gpu.label_for(host, index)
        labels.append(label)
        mine = held.get(pk)
        if mine is None:
            rows.append({"gpu": label, "model": model, "mig": mig, "slots": free_slots, "profiles": free_slots})
            z.append(free_z)
            text.append(free_text)
            continue
        slots, profiles = mine
        rows.append({"gpu": label, "model": model, "mig": mig, "slots": slots, "profiles": profiles})
        z.append([code.get(t, 0) for t in slots])
        text.append([(cell_text.get((t, p)) or cell_text.setdefault((t, p), f"{t} ({p})")) if t else "free"
                     for t, p in zip(slots, profiles, strict=True)])
    n = len(tenants)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    colors = ["#eeeeee"] + [palette[i % len(palette)] for i in range(n)]
    scale = []  # discrete: value i (0 = free, i = i-th tenant) gets its own band
    for i, c in enumerate(colors):
        scale += [[i / len(colors), c], [(i + 1) / len(colors), c]]
    fig = figures.figure(
        [{"type": "heatmap", "x": [f"slot {s}" for s in range(8)], "y": labels, "z": z, "text": text,
          "hoverinfo": "text+y", "texttemplate": "%{text}", "zmin": -0.5, "zmax": n + 0.5, "showscale": False,
          "colorscale": scale, "xgap": 2, "ygap": 2}],
        {**LAYOUT, "title": figures.title("MIG slot map (who holds which memory slices)")})
    return fig, {"gpus": rows, "tenants": tenants, "used": used, "free": 8 * len(rows) - used}


def _tenants_used(per: Period, tenant_ids=None) -> list[Tenant]:
    """Tenants with usage or an allocation active in the period (the ones there is anything to rate)."""
    first, last = ceil_day(per.start), floor_day(per.end)  # the whole days inside
    if last > first:  # the whole days from the daily rollups, the hours around them from the hourly ones
        hourly = Q(hour__gte=per.start, hour__lt=first) | Q(hour__gte=last, hour__lt=per.end)
        used = set(UsageDaily.objects.filter(day__gte=first, day__lt=last).order_by()
                   .values_list("tenant_id", flat=True).distinct())
    else:
        hourly, used = Q(hour__gte=per.start, hour__lt=per.end), set()
    used |= set(UsageHourly.objects.filter(hourly).order_by().values_list("tenant_id", flat=True).distinct())
    used |= set(Allocation.objects.filter(activated_at__isnull=False, activated_at__lt=per.end)
                .filter(Q(released_at__isnull=True) | Q(released_at__gt=per.start)).order_by()
                .values_list("tenant_id", flat=True).distinct())
    if tenant_ids is not None:
        used &= set(tenant_ids)
    return list(Tenant.objects.filter(pk__in=used).order_by("pk"))


#: a part of the money in `tier_spend`
PART_KEY: dict[str, str] = {TOKENS: "token_amount", SLICES: "slice_amount", COMMITMENT: "commitment_amount"}


def tier_spend(per: Period) -> dict[int, dict]:
    """tier id -> requests, tokens, token/slice-hour/commitment/total amounts over the period: the
    invoices' rating as the charts' copy prices it (spread_amounts: the plan in force at each hour,
    slice-hours per second, reserved commitments) of the tenants billed in `per.currency` (amounts in other
    currencies are not added up); requests and tokens of the hours in the period of the tenants billed in it for
    that month."""
    out: dict[int, dict] = defaultdict(lambda: {"requests": 0, "tokens": 0, "token_amount": Decimal(0),
                                                 "slice_amount": Decimal(0), "commitment_amount": Decimal(0)})
    spread = spread_amounts(_tenants_used(per), per.start, per.end)
    for (_tid, currency, tier_id, part, _b), x in spread.money.items():
        if currency == per.currency:
            out[tier_id][PART_KEY[part]] += x
    for (_tid, currency, tier_id, _b), (tokens, requests) in spread.used.items():
        if currency == per.currency:
            out[tier_id]["tokens"] += tokens
            out[tier_id]["requests"] += requests
    for row in out.values():
        row["amount"] = _money(row["token_amount"] + row["slice_amount"] + row["commitment_amount"])
        for k in ("token_amount", "slice_amount", "commitment_amount"):
            row[k] = _money(row[k])
        row["cost_per_inference"] = (_money(row["amount"] / row["requests"], "0.00000001") if row["requests"]
                                     else None)
        row["cost_per_1k_tokens"] = (_money(row["amount"] * 1000 / row["tokens"], "0.00000001") if row["tokens"]
                                     else None)
        row["cost_per_1m_tokens"] = _money(row["amount"] * MILLION / row["tokens"], "0.0001") if row["tokens"] else None
    return out


def _f(x):
    return None if x is None else float(x)


def cost_per_tier(per: Period, principal: Principal):
    """What a customer pays per inference and per 1K tokens on each tier (token charges plus
    slice-hours, over the requests and tokens served in the period)."""
    spend = tier_spend(per)
    tiers = {t.pk: t for t in Tier.objects.filter(pk__in=list(spend))}
    numbers = {tiers[k].key: {**v, "gpu_model": tiers[k].gpu_model_id} for k, v in spend.items()}
    keys = sorted(numbers)
    grid = figures.subplots(1, 2, horizontal_spacing=0.15,
                            subplot_titles=("per inference", "per 1M tokens"))
    traces = [
        grid.trace({"type": "bar", "x": keys, "y": [_f(numbers[k]["cost_per_inference"]) for k in keys],
                    "name": "per inference"}, 1, 1),
        grid.trace({"type": "bar", "x": keys, "y": [_f(numbers[k]["cost_per_1m_tokens"]) for k in keys],
                    "name": "per 1M tokens",
                    "hovertemplate": f"%{{x}}<br>%{{y:,.4~r}} {per.currency} per 1M tokens<extra></extra>"}, 1, 2)]
    fig = figures.figure(traces, {**grid.layout, **LAYOUT, "showlegend": False,
                                  "title": figures.title(f"What a customer pays, by tier ({per.currency})")})
    _money_axes(fig, per.currency, "tier")
    return (fig if keys else figures.empty(fig)), {"tiers": numbers, "currency": per.currency}


def _money_axes(fig: dict, currency: str, x_title: str) -> None:
    """Money on every y axis with the currency's digits and never an SI prefix ("20µ"); every x axis titled (as
    ``fig.update_yaxes`` / ``update_xaxes`` do)."""
    figures.update_axes(fig["layout"], "y", {"title": figures.title(currency), "exponentformat": "none",
                                             "tickformat": plotly_unit_price_format(currency)})
    figures.update_axes(fig["layout"], "x", {"title": figures.title(x_title)})


def power_cost(per: Period, principal: Principal):
    """Energy cost per 1M tokens by tier: apportioned kWh (compute share) x price per kWh, in the energy price's
    currency (TESSERA_ENERGY_CURRENCY), to 4 significant digits (from the unrounded cost, not from per 1K)."""
    report = energy.apportion_range(per.start, per.end, coarsest=per.resolution)
    rows = energy.power_cost_per_tier(per.start, per.end, report)
    keys = sorted(rows)
    cur, price = settings.TESSERA_ENERGY_CURRENCY, energy.price_per_kwh()
    fig = figures.figure(
        [{"type": "bar", "x": keys, "y": [_f(rows[k]["cost_per_1m_tokens"]) for k in keys],
          "text": [f"{rows[k]['kwh']:,.3f} kWh" for k in keys], "textposition": "none",
          "hovertemplate": f"%{{x}}<br>%{{y:,.4~r}} {cur} per 1M tokens<br>%{{text}}<extra></extra>"}],
        {**LAYOUT, "title": figures.title(f"Power cost per 1M tokens by tier (energy at {price} {cur} per kWh)")})
    figures.update_axes(fig["layout"], "y", {"title": figures.title(f"{cur} per 1M tokens"),
                                             "exponentformat": "none", "tickformat": ",.3~r", "rangemode": "tozero"})
    figures.update_axes(fig["layout"], "x", {"title": figures.title("tier")})
    if not any(rows[k]["cost_per_1m_tokens"] is not None for k in keys):  # no tier served a token in the range
        figures.empty(fig)
    return fig, {"tiers": rows, "price_per_kwh": price, "currency": cur, "total_kwh": report.total_kwh,
                 "unallocated_kwh": report.unallocated_kwh,
                 "gpu_kwh": {str(k): v for k, v in report.gpu_kwh.items()}}


def h100_vs_h200(per: Period, principal: Principal):
    """Per GPU model side by side: tokens/s per GPU, cost per 1K tokens, average utilization."""
    gpus: dict[str, int] = dict(Gpu.objects.values("gpu_model__key").order_by().annotate(n=Count("pk"))
                                .values_list("gpu_model__key", "n"))
    spend = tier_spend(per)
    model_of = dict(Tier.objects.filter(pk__in=list(spend)).values_list("pk", "gpu_model__key"))
    tokens: defaultdict[str, int] = defaultdict(int)
    amount: defaultdict[str, Decimal] = defaultdict(Decimal)
    for tier_id, d in spend.items():
        tokens[model_of[tier_id]] += d["tokens"]
        amount[model_of[tier_id]] += d["amount"]
    # one average over the whole range: hourly rollups (and the raw minutes after them) beyond a few hours
    coarse = per if per.end - per.start <= RAW_UP_TO else replace(per, resolution=Resolution.HOUR)
    util = {r["gpu__gpu_model__key"]: r["avg"] for r in activity(coarse, "gpu__gpu_model__key")}
    models = sorted(set(gpus) | set(tokens))
    numbers = {m: {
        "gpus": gpus.get(m, 0),
        "tokens": tokens.get(m, 0),
        "tokens_per_s_per_gpu": round(tokens.get(m, 0) / per.seconds / gpus[m], 6) if gpus.get(m) else None,
        "cost_per_1k_tokens": _money(amount[m] * 1000 / tokens[m], "0.00000001") if tokens.get(m) else None,
        "cost_per_1m_tokens": _money(amount[m] * MILLION / tokens[m], "0.0001") if tokens.get(m) else None,
        "utilization": round(util[m], 4) if m in util else None,
    } for m in models}
    grid = figures.subplots(1, 3, horizontal_spacing=0.12,
                            subplot_titles=("tokens/s per GPU", "cost per 1M tokens", "utilization"))
    traces = [grid.trace({"type": "bar", "x": models, "y": [_f(numbers[m][field]) for m in models], "name": field},
                         1, col)
              for col, field in enumerate(("tokens_per_s_per_gpu", "cost_per_1m_tokens", "utilization"), start=1)]
    grid.layout.update(LAYOUT, title=figures.title(f"H100 vs H200 (money in {per.currency})"), showlegend=False)
    figures.update_axes(grid.layout, "x", {"title": figures.title("GPU model")})
    grid.update(1, 1, y={"title": figures.title("tokens/s"), "tickformat": ",.1f", "exponentformat": "none"})
    grid.update(1, 2, y={"title": figures.title(per.currency), "exponentformat": "none",
                         "tickformat": plotly_unit_price_format(per.currency)})
    grid.update(1, 3, y={"title": figures.title("%"), "range": [0, 100]})
    return figures.figure(traces, grid.layout), {"models": numbers}


# --- tenant figure ---------------------------------------------------------------------------------

def tenant_usage(per: Period, principal: Principal, params: dict | None = None):
    """Tokens and spend (token charges + slice-hours) per tenant over time, for the tenants the
    principal may see billing of."""
    params = params or {}
    bucket = params.get("bucket") or ("hour" if per.end - per.start <= timedelta(days=2) else "day")
    if bucket not in ("hour", "day"):
        raise ServiceError("bucket must be hour or day", field="bucket")
    ids = principal.tenant_ids("billing")
    if ids is not None and not ids:
        raise Forbidden("Your role or API-key scopes do not allow seeing usage and spend.")
    tenants = Tenant.objects.all() if ids is None else Tenant.objects.filter(pk__in=ids)
    if params.get("tenant"):
        tenants = tenants.filter(slug=params["tenant"])
        if not tenants.exists():
            raise ChartNotFound("No such tenant.")
    slug, own_currency = {}, {}
    for pk, s, cur in tenants.values_list("pk", "slug", "currency"):
        slug[pk], own_currency[pk] = s, cur
    tok: defaultdict[int, defaultdict[datetime, int]] = defaultdict(lambda: defaultdict(int))
    spend: defaultdict[int, defaultdict[datetime, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    step = timedelta(days=1) if bucket == "day" else timedelta(hours=1)
    wanted = (params.get("currency") or "").upper() or None  # given: only the tenants billed in it
    # the invoices' own rating, in each invoice's currency, cut at the buckets (tokens: the rollups' hours)
    spread = spread_amounts(_tenants_used(per, slug), per.start, per.end, step=int(step.total_seconds()),
                            by_tier=False)
    currency: dict[int, str] = spread.currency
    for (tid, _cur, _tier, _part, b), part in spread.money.items():
        if part:
            spend[tid][b] += part
    for (tid, _cur, _tier, b), (n, _requests) in spread.used.items():
        if n:
            tok[tid][b] += n
    if wanted:
        slug = {tid: s for tid, s in slug.items() if currency.get(tid, own_currency[tid]) == wanted}
    cur_of = {tid: currency.get(tid) or own_currency[tid] for tid in slug}
    currencies = (sorted({cur_of[tid] for tid in slug if spend[tid] or tok[tid]})
                  or [wanted or min(cur_of.values(), default=per.currency)])  # nothing spent: one empty panel
    numbers = {}
    # one spend panel per currency (amounts in different currencies never share an axis), under the tokens
    grid = figures.subplots(1 + len(currencies), 1, shared_xaxes=True,
                            vertical_spacing=0.08 if currencies[1:] else 0.12,
                            subplot_titles=("tokens", *(f"spend ({c})" for c in currencies)))
    row_of = {c: 2 + i for i, c in enumerate(currencies)}
    iso_of: dict[datetime, str] = {}  # (the same few bucket starts for every tenant)
    cent, no_cents = Decimal("0.01"), Decimal("0.00")
    spent: dict[int, Decimal] = {}
    for tid in sorted(slug, key=lambda t: slug[t]):
        tokens, money = tok[tid], spend[tid]
        times = sorted(tokens.keys() | money.keys())
        spent[tid] = sum(money.values(), Decimal(0))
        numbers[slug[tid]] = {"ts": [iso_of.get(t) or iso_of.setdefault(t, t.isoformat()) for t in times],
                              "tokens": [tokens.get(t, 0) for t in times],
                              "spend": [money[t].quantize(cent, rounding=ROUND_HALF_UP) if t in money else no_cents
                                        for t in times],
                              "total": _money(spent[tid], "0.01"),
                              "currency": cur_of[tid]}
    # the chart draws the tenants that spent most and sums the rest as one series per currency (the numbers keep
    # them all)
    ranked = sorted((t for t in slug if tok[t] or spend[t]),
                    key=lambda t: (-spent[t], -sum(tok[t].values()), slug[t]))
    shown, rest = ranked[:TOP_TENANTS], ranked[TOP_TENANTS:]
    series = [(slug[t], cur_of[t], tok[t], spend[t]) for t in sorted(shown, key=lambda t: slug[t])]
    for cur in currencies:
        others = [t for t in rest if cur_of[t] == cur]
        if not others:
            continue
        other_tok: defaultdict[datetime, int] = defaultdict(int)
        other_spend: defaultdict[datetime, Decimal] = defaultdict(Decimal)
        for t in others:
            for b, n in tok[t].items():
                other_tok[b] += n
            for b, part in spend[t].items():
                other_spend[b] += part
        name = f"{len(others)} other tenants" + (f" ({cur})" if currencies[1:] else "")
        series.append((name, cur, other_tok, other_spend))
    traces = []  # each series' tokens bar (top), then its spend line in its currency's panel, in the bar's colour
    for i, (name, cur, tokens, money) in enumerate(series):
        times = sorted(set(tokens) | set(money))
        iso = [iso_of.get(t) or iso_of.setdefault(t, t.isoformat()) for t in times]
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        traces += [grid.trace({"type": "bar", "x": iso, "y": [tokens.get(t, 0) for t in times], "name": name,
                               "legendgroup": name, "marker": {"color": colour},
                               "hovertemplate": f"{name}<br>%{{x}}<br>%{{y:,d}} tokens<extra></extra>"}, 1, 1),
                   grid.trace({"type": "scatter", "x": iso, "name": name, "legendgroup": name, "showlegend": False,
                               "y": [float(_money(money.get(t, Decimal(0)), "0.01")) for t in times],
                               "mode": "lines+markers", "line": {"color": colour}, "marker": {"color": colour},
                               "hovertemplate": f"{name}<br>%{{x}}<br>%{{y:,.2f}} {cur}<extra></extra>"},
                              row_of[cur], 1)]
    grid.layout.update(LAYOUT, title=figures.title("Usage and spend per tenant"), barmode="stack")
    grid.update(1, 1, y={"title": figures.title("tokens"), "tickformat": ",d"})
    for cur, row in row_of.items():
        grid.update(row, 1, y={"title": figures.title(cur), "tickformat": ",.2f", "exponentformat": "none",
                               "rangemode": "tozero"})
    grid.update(1 + len(currencies), 1, x={"title": figures.title(f"time (UTC), per {bucket}")})
    figures.update_axes(grid.layout, "x", {"range": _range(per)})
    fig = figures.figure(traces, grid.layout)
    if not series:
        figures.empty(fig)
    return fig, {"bucket": bucket, "currency": currencies[0] if len(currencies) == 1 else None,
                 "currencies": currencies, "range": _range(per), "tenants": numbers}


# --- capacity planner ------------------------------------------------------------------------------

def capacity_plan(report) -> dict:
    """The planner's answer (marketplace.selectors.capacity_planning.PlanReport) as plotly's JSON figure: cost per
    1M tokens of each scenario, split into GPU-hours and power, with the GPUs each needs; and the
    optimum's GPUs by layout. (The numbers are the report's own: selectors.capacity_planning.report_dict.)"""
    import plotly.graph_objects as go  # the planner's small figure only: the charts write their JSON themselves
    from plotly.subplots import make_subplots

    cur = report.request.currency
    feasible = [s for s in report.scenarios if s.result.feasible]
    best = report.best.result
    rows = [(f"{u.gpu_model.split('-')[0].upper()}: {u.layout}", u) for u in best.layouts]
    fig = make_subplots(rows=2, cols=1, row_heights=[0.55, 0.45], vertical_spacing=0.2,
                        subplot_titles=(f"cost per 1M tokens ({cur}) by fleet", "optimal fleet: GPUs by MIG layout"))
    labels = [s.label for s in feasible]

    def per_1m(s, part):
        r = s.result
        return part / (r.tokens_per_s * 3600) * 1_000_000 if r.tokens_per_s else None

    gpus_text = [", ".join(f"{n}× {k.split('-')[0].upper()}" for k, n in sorted(s.result.gpus.items()))
                 for s in feasible]
    fig.add_trace(go.Bar(x=labels, y=[per_1m(s, s.result.gpu_cost_per_hour) for s in feasible], name="GPU-hours",
                         marker_color="#1f77b4", hovertext=gpus_text), 1, 1)
    fig.add_trace(go.Bar(x=labels, y=[per_1m(s, s.result.power_cost_per_hour) for s in feasible], name="power",
                         marker_color="#ff7f0e", text=gpus_text, textposition="outside", cliponaxis=False), 1, 1)
    colors = {m: c for m, c in zip(sorted({u.gpu_model for _l, u in rows}), ("#2ca02c", "#9467bd", "#8c564b"),
                                   strict=False)}
    for model in sorted(colors):
        mine = [(label, u) for label, u in rows if u.gpu_model == model]
        fig.add_trace(go.Bar(y=[label for label, _u in mine], x=[u.gpus for _l, u in mine], orientation="h",
                             name=f"{model} GPUs", marker_color=colors[model], text=[u.gpus for _l, u in mine],
                             textposition="auto"), 2, 1)
    longest = max((len(label) for label, _u in rows), default=10)
    fig.update_layout(**{**LAYOUT, "margin": {**MARGIN, "l": min(420, 40 + 6 * longest)}},
                      barmode="stack", title="Capacity plan: lowest cost per 1M tokens",
                      legend={"orientation": "h", "y": -0.12})
    fig.update_yaxes(title_text=cur, tickformat=",.3~r", exponentformat="none", row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_xaxes(title_text="GPUs", dtick=1 if sum(u.gpus for _l, u in rows) <= 10 else None, row=2, col=1)
    return json.loads(fig.to_json())


# --- registry --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chart:
    name: str
    title: str
    build: Callable
    operators_only: bool = True
    takes_params: bool = False
    #: its numbers hold only JSON types already (str, int, float, bool, None, lists, str-keyed dicts): not copied
    plain: bool = False


CHARTS: dict[str, Chart] = {c.name: c for c in (
    Chart("fleet-utilization", "Fleet utilization over time", fleet_utilization),
    Chart("gpu-heatmap", "Per-GPU activity heatmap", gpu_heatmap),
    Chart("mig-slots", "MIG slot map", mig_slot_map, plain=True),
    Chart("cost-per-tier", "Cost per inference and per 1M tokens by tier", cost_per_tier),
    Chart("power-cost", "Power cost per 1M tokens by tier", power_cost),
    Chart("h100-vs-h200", "H100 vs H200", h100_vs_h200),
    Chart("tenant-usage", "Usage and spend per tenant", tenant_usage, operators_only=False, takes_params=True),
)}


def chart(name: str) -> Chart:
    c = CHARTS.get(name)
    if c is None:
        raise ChartNotFound(f"No chart named {name!r}.")
    return c


def check_access(c: Chart, principal: Principal) -> None:
    if c.operators_only and not principal.is_operator:
        raise Forbidden("This chart is for MSP operators.")


def build(name: str, principal: Principal, params: dict | None = None):
    """(Chart, figure (plotly's JSON dict), numbers) after the access check."""
    c = chart(name)
    check_access(c, principal)
    per = period(params)
    fig, numbers = c.build(per, principal, params) if c.takes_params else c.build(per, principal)
    numbers = {"start": per.start.isoformat(), "end": per.end.isoformat(), "resolution": str(per.resolution),
               **numbers}
    return c, fig, numbers


#: JSON-ready as they are (exact types: a subclass takes the general path below)
_AS_IS = frozenset({str, int, float, bool, type(None)})


def _plain(value):
    """The numbers with Decimals as strings, datetimes in ISO 8601 and keys as strings. Lists of plain values (a
    heatmap's 1,000 rows) are copied without a call per element."""
    kind = type(value)
    if kind in _AS_IS:
        return value
    if kind is list or kind is tuple:
        return [v if type(v) in _AS_IS else _plain(v) for v in value]
    if kind is dict:
        return {k if type(k) is str else str(k): v if type(v) in _AS_IS else _plain(v) for k, v in value.items()}
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def figure_json(name: str, principal: Principal, params: dict | None = None) -> dict:
    """{"name", "title", "figure" (plotly's JSON dict), "data" (the numbers, Decimals as strings)}."""
    c, fig, numbers = build(name, principal, params)
    # every chart builds its figure as plotly's JSON already (telemetry.figures)
    return {"name": c.name, "title": c.title, "figure": fig, "data": numbers if c.plain else _plain(numbers)}
