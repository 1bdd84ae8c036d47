"""Prometheus text exposition (format 0.0.4) of fleet, tenant and GPU metrics, for an MSP's existing
Prometheus/Grafana. Plain text generation, no client library: every value is read from the
database at scrape time (gauges from the fleet and orders tables, counters from the hourly usage
rollups and the collector's error table, GPU readings from the latest raw sample of each GPU)."""

from __future__ import annotations

import hmac
from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone

from marketplace.gateway.signing import REASONS as REFUSAL_REASONS
from marketplace.models import Allocation, AllocationEvent, Gpu, GpuSlot
from marketplace.selectors import alarms
from marketplace.services.billing import spend as spend_rule
from marketplace.services.billing.units import month_of
from telemetry.models import (
    CollectorError,
    GpuSample,
    MigSample,
    Resolution,
    TritonCounter,
    UsageHourly,
    UsageRefusal,
)
from tenants.models import Tenant

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATEST_WITHIN = timedelta(minutes=15)
#: what the spend series read of billing.spend.figures' row
SPEND_ROW = ("slug", "currency", "invoice_currency", "spend", "monthly_spend_limit")


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{lab}}} {_num(value)}" if lab else f"{name} {_num(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _num(v) -> str:
    if v is None:
        return "NaN"
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    f = float(v)
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)


def render(now=None) -> str:
    now = now or timezone.now()
    out = Exposition()

    gpus = list(Gpu.objects.select_related("node", "gpu_model").order_by("node__hostname", "index"))
    per_model: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))
    for g in gpus:
        per_model[g.gpu_model.key][g.state] += 1
    out.family("tessera_gpus", "gauge", "GPUs in the fleet by model and state.",
               [({"model": m, "state": s}, n) for m, states in sorted(per_model.items())
                for s, n in sorted(states.items())])

    used = dict(GpuSlot.objects.values("gpu__gpu_model__key").annotate(n=Count("id"))
                .values_list("gpu__gpu_model__key", "n"))
    slot_rows = []
    for m in sorted(per_model):
        total = 8 * sum(per_model[m].values())
        slot_rows += [({"model": m, "status": "used"}, used.get(m, 0)),
                      ({"model": m, "status": "free"}, total - used.get(m, 0))]
    out.family("tessera_slots", "gauge", "Memory slices (8 per GPU) used and free by GPU model.", slot_rows)

    alloc = (Allocation.objects.values("state", "tier__key").annotate(n=Count("id")).order_by("state", "tier__key"))
    out.family("tessera_allocations", "gauge", "Allocations by state and tier.",
               [({"state": r["state"], "tier": r["tier__key"]}, r["n"]) for r in alloc])

    trans = AllocationEvent.objects.values("to_state").annotate(n=Count("id")).order_by("to_state")
    out.family("tessera_allocation_transitions_total", "counter",
               "Provisioning outcomes: allocation state transitions by target state (failed = failures).",
               [({"to_state": r["to_state"]}, r["n"]) for r in trans])

    usage = list(UsageHourly.objects.values("tenant__slug").annotate(
        i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests")).order_by("tenant__slug"))
    out.family("tessera_tenant_tokens_total", "counter", "Metered tokens per tenant (hourly rollups).",
               [({"tenant": u["tenant__slug"], "direction": d}, n or 0) for u in usage
                for d, n in (("input", u["i"]), ("output", u["o"]))])
    out.family("tessera_tenant_requests_total", "counter", "Metered inference requests per tenant.",
               [({"tenant": u["tenant__slug"]}, u["r"] or 0) for u in usage])

    latest: dict[int, GpuSample] = {}
    for s in (GpuSample.objects.filter(resolution=Resolution.RAW, ts__gte=now - LATEST_WITHIN)
              .order_by("gpu_id", "-ts")):
        latest.setdefault(s.gpu_id, s)
    gl = {g.pk: {"node": g.node.hostname, "gpu": str(g.index), "uuid": g.uuid, "model": g.gpu_model.key}
          for g in gpus}
    rows = [(gl[k], s) for k, s in sorted(latest.items()) if k in gl]
    for name, kind, help_, get in (
        ("tessera_gpu_power_watts", "gauge", "Latest power draw.", lambda s: s.power_w),
        ("tessera_gpu_activity_ratio", "gauge",
         "Latest activity 0..1 (NVML utilization, or the slices' metering-based estimate under MIG).",
         lambda s: s.activity),
        ("tessera_gpu_memory_used_bytes", "gauge", "Latest memory used.", lambda s: s.memory_used_mb * 1048576),
        ("tessera_gpu_temperature_celsius", "gauge", "Latest GPU temperature.", lambda s: s.temperature_c),
        ("tessera_gpu_sm_clock_mhz", "gauge", "Latest SM clock.", lambda s: s.sm_clock_mhz),
        ("tessera_gpu_energy_joules_total", "counter", "Energy counter since the driver loaded.",
         lambda s: s.energy_j),
    ):
        out.family(name, kind, help_, [(lab, get(s)) for lab, s in rows])
    out.family("tessera_gpu_utilization_percent", "gauge", "Latest NVML utilization (absent under MIG).",
               [(lab, s.utilization) for lab, s in rows if s.utilization is not None])

    errs = CollectorError.objects.select_related("gpu__node").order_by("gpu__node__hostname", "gpu__index", "kind")
    out.family("tessera_collector_errors_total", "counter", "Failed NVML telemetry reads per GPU and error.",
               [({"node": e.gpu.node.hostname, "gpu": str(e.gpu.index), "kind": e.kind}, e.count) for e in errs])

    refused = dict(UsageRefusal.objects.values_list("reason", "count"))
    out.family("tessera_usage_refused_total", "counter",
               "Usage stream/spool entries the consumer refused and did not bill, by reason (unsigned, malformed, "
               "unknown_key: signed with a key it does not hold, forged: the signature does not match).",
               [({"reason": r}, refused.get(r, 0)) for r in sorted(set(REFUSAL_REASONS) | set(refused))])

    _serving_and_billing(out, now, gl)

    # The operators' alarms (selectors.alarms, the same set services.alerting sends): docker/prometheus's rules.
    out.family("tessera_alarm", "gauge",
               "Tessera's alarms firing now (1 series per alarm; the value counts what it is about), labelled "
               "alertname, severity and node or tenant.",
               [(a.labels, a.count) for a in alarms.current(now)])
    out.family("tessera_node_heartbeat_age_seconds", "gauge",
               "Seconds since each ready or draining node last answered reconcile (never: since registration).",
               [({"node": h}, age) for h, age in alarms.heartbeat_ages(now)])
    return out.text()


def _serving_and_billing(out: Exposition, now, gl: dict[int, dict[str, str]]) -> None:
    """The series docker/grafana's dashboards read beyond the fleet's: slices, models per tenant, energy price,
    spend. Labels: node, gpu, gi (GPU instance id, at most 7 a GPU), tenant slug, model (a tenant's deployment)."""
    latest: dict[tuple[int, str], MigSample] = {}
    for m in (MigSample.objects.filter(resolution=Resolution.RAW, ts__gte=now - LATEST_WITHIN)
              .select_related("tenant").order_by("gpu_id", "mig_uuid", "-ts")):
        latest.setdefault((m.gpu_id, m.mig_uuid), m)
    slices = [({"node": gl[g]["node"], "gpu": gl[g]["gpu"], "gi": "" if m.gi_id is None else str(m.gi_id),
                "tenant": m.tenant.slug if m.tenant else ""}, m) for (g, _), m in sorted(latest.items()) if g in gl]
    out.family("tessera_slice_activity_ratio", "gauge",
               "Latest activity 0..1 of each slice (metering-based estimate under MIG).",
               [(lab, m.activity) for lab, m in slices])
    out.family("tessera_slice_memory_used_bytes", "gauge", "Latest memory used by each slice.",
               [(lab, m.memory_used_mb * 1048576) for lab, m in slices])

    per_model = list(UsageHourly.objects.values("tenant__slug", "deployment__name").annotate(
        i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests")).order_by("tenant__slug", "deployment__name"))
    out.family("tessera_model_requests_total", "counter", "Metered inference requests per tenant and model.",
               [({"tenant": u["tenant__slug"], "model": u["deployment__name"]}, u["r"] or 0) for u in per_model])
    out.family("tessera_model_tokens_total", "counter", "Metered tokens per tenant, model and direction.",
               [({"tenant": u["tenant__slug"], "model": u["deployment__name"], "direction": d}, n or 0)
                for u in per_model for d, n in (("input", u["i"]), ("output", u["o"]))])
    served = list(TritonCounter.objects.values("deployment__tenant__slug", "deployment__name").annotate(
        n=Sum("inference_count"), f=Sum("fail_count"), ns=Sum("execution_ns"))
        .order_by("deployment__tenant__slug", "deployment__name"))
    lab = [({"tenant": r["deployment__tenant__slug"], "model": r["deployment__name"]}, r) for r in served]
    out.family("tessera_model_inferences_total", "counter",
               "Inferences Triton served per tenant and model (its counters as last scraped; reset when a server "
               "restarts).", [(k, r["n"] or 0) for k, r in lab])
    out.family("tessera_model_inference_failures_total", "counter", "Inferences Triton failed per tenant and model.",
               [(k, r["f"] or 0) for k, r in lab])
    out.family("tessera_model_execution_seconds_total", "counter",
               "Triton's execution time per tenant and model (latency: its rate over the inferences' rate).",
               [(k, (r["ns"] or 0) / 1e9) for k, r in lab])

    out.family("tessera_energy_price_per_kwh", "gauge",
               "TESSERA_ENERGY_PRICE_PER_KWH, in TESSERA_ENERGY_CURRENCY (power cost per 1M tokens).",
               [({}, float(settings.TESSERA_ENERGY_PRICE_PER_KWH))])
    rows = spend_rule.figures(Tenant.objects.all(), month_of(now)).values(*SPEND_ROW)
    spend = [({"tenant": r["slug"], "currency": r["invoice_currency"] or r["currency"]}, r) for r in rows]
    out.family("tessera_tenant_spend", "gauge",
               "The tenant's spend this month (its invoice as last rated), in its invoice's currency.",
               [(k, r["spend"] or 0) for k, r in spend])
    out.family("tessera_tenant_spend_limit", "gauge", "The tenant's monthly spend limit (tenants with one).",
               [(k, r["monthly_spend_limit"]) for k, r in spend if r["monthly_spend_limit"] is not None])


def token_ok(header: str | None) -> bool:
    """True when the Authorization header carries TESSERA_METRICS_TOKEN (unset: never)."""
    expected = settings.TESSERA_METRICS_TOKEN
    if not expected or not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), str(expected).encode())
