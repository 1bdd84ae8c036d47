"""The demo's traffic makes the fleet charts show something a person can see: the seeded demo fleet (four
8-GPU nodes, the demo tenants' slices, a model on each), the demo's metered traffic up to an afternoon hour,
one collection per node at its end (which drives the simulated NVML from that metering), then the numbers of
the fleet-utilization chart and the GPUs' power."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.demo import traffic
from marketplace.demo.seed import seed_fleet
from marketplace.demo.tenants import seed_demo
from marketplace.hardware.geometry import geometry
from marketplace.models import Allocation, ModelDeployment, Node
from marketplace.services import nodes, provisioning
from telemetry import charts
from telemetry.models import GpuSample, Resolution
from telemetry.services import collector
from tenants.scoping import Principal

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo_fleet(sim_dir, catalog):
    seed_demo("op-pass-1", "user-pass-1")
    seed_fleet()
    for pk in Allocation.objects.filter(state=Allocation.State.PLACED).values_list("pk", flat=True):
        assert provisioning.provision(pk) == "activated"
    for a in Allocation.objects.filter(state=Allocation.State.ACTIVE).select_related("tenant"):
        ModelDeployment.objects.create(allocation=a, tenant=a.tenant, name="tiny-gen", backend="python", spec={},
                                       memory_mb=2000, state=ModelDeployment.State.READY)
    assert ModelDeployment.objects.count() == 9  # the demo orders
    return list(traffic._deployments())


def _energy_mj() -> list[int]:
    out = []
    for node in Node.objects.order_by("pk"):
        with nodes.nvml_client(node) as client:
            nv = client.nv
            out += [nv.nvmlDeviceGetTotalEnergyConsumption(nv.nvmlDeviceGetHandleByIndex(i)) for i in range(8)]
    return out


def test_demo_traffic_makes_utilization_and_power_visible(demo_fleet, monkeypatch):
    # each tenant's requests carry its share of the slice's modelled throughput, less at night
    dep = next(d for d in demo_fleet if d.tenant.slug == "cobalt-health")  # a whole H200 (7g.141gb)
    noon = timezone.now().replace(hour=12, minute=0, second=0, microsecond=0)
    full = 3000 * 4.8  # the modelled throughput of an H200, tokens/s
    assert traffic.tokens_per_s(dep, noon) == pytest.approx(traffic.LOAD["cobalt-health"] * full)
    assert traffic.tokens_per_s(dep, noon.replace(hour=2)) == pytest.approx(
        traffic.LOAD["cobalt-health"] * full * traffic.NIGHT)
    mean = traffic.LOAD["cobalt-health"] * full * 60 / traffic.MEAN_TOKENS
    n = traffic.requests_in(dep, noon, 60, random.Random(1))
    assert 0.7 * mean - 1 <= n <= 1.3 * mean + 1
    assert traffic.INPUT_WORDS[0] < len(traffic.prompt(random.Random(2)).split()) <= traffic.INPUT_WORDS[1] + 10
    # a tick sends those requests through the gateway (recorded here instead of sent over HTTP)
    sent = []
    monkeypatch.setattr(traffic, "_post", lambda url, body, token: sent.append(body) or {})
    assert traffic.gateway_tick(dep.allocation.node_id) == len(sent) >= 3
    assert {b["model"] for b in sent} == {"tiny-gen"}
    assert all(traffic.OUTPUT_TOKENS[0] <= b["max_tokens"] <= traffic.OUTPUT_TOKENS[1] <= 1024 for b in sent)
    real_now = timezone.now()
    # the end of an afternoon hour whose traffic is all in the past (ingest refuses future events)
    end = real_now.replace(hour=14, minute=59, second=0, microsecond=0)
    if end > real_now - timedelta(minutes=1):
        end -= timedelta(days=1)
    traffic.backfill(days=1 if end.date() == real_now.date() else 2)  # what the gateway metered, hour by hour

    before = _energy_mj()
    for node in Node.objects.all():
        assert collector.collect_node(node.pk, now=end)["errors"] == 0

    per = charts.Period(end - timedelta(minutes=5), end + timedelta(minutes=1), "raw")
    _fig, numbers = charts.fleet_utilization(per, Principal(is_operator=True))
    # percent of the whole fleet, its 23 idle GPUs included (today: 0.03-0.08 %)
    assert numbers["fleet"] and min(numbers["fleet"]) > 2.5
    assert set(numbers["by_model"]) == {"h100-sxm-80gb", "h200-sxm-141gb"}
    assert all(min(v["avg"]) > 2.0 for v in numbers["by_model"].values())

    serving = set(Allocation.objects.filter(state=Allocation.State.ACTIVE).values_list("instance__gpu_id", flat=True))
    samples = list(GpuSample.objects.filter(resolution=Resolution.RAW, ts=end).select_related("gpu__gpu_model"))
    assert len(samples) == 32 and len(serving) >= 6
    for s in samples:
        geo = geometry(s.gpu.gpu_model.key)
        assert 0.0 <= s.activity <= 1.0 and 0 < s.power_w <= geo.tdp_watts  # within NVML's ranges
        if s.gpu_id in serving:
            # a GPU serving demo traffic is visibly busy and draws clearly more than at idle
            assert s.activity > 0.02 and s.power_w > geo.sim.idle_watts + 10, s.gpu
        else:
            assert s.activity == 0.0 and s.power_w < geo.sim.idle_watts + 5
    busiest = max(samples, key=lambda s: s.activity)
    assert busiest.activity > 0.3 and busiest.power_w > 250  # a whole GPU at tens of percent
    # the energy counters (mJ) only grow
    assert all(b >= a for a, b in zip(before, _energy_mj(), strict=True))


def test_the_demo_history_reaches_a_past_month_that_is_finalized_and_credited(demo_fleet):
    """The demo seeds history back to the first of the previous month (coarse steps before the last days), so its
    operator has a month to finalize and credit: metered and served agree per hour, and the month's invoices rate
    slice-hours and tokens, finalize and take a full credit."""
    from decimal import Decimal

    from django.db.models import Sum

    from marketplace.models import Invoice
    from marketplace.services import billing
    from telemetry.models import TritonServedHourly, UsageHourly

    now = timezone.now()
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    since = (first - timedelta(days=1)).replace(day=1)
    held = Allocation.objects.filter(state=Allocation.State.ACTIVE)
    held.update(activated_at=since, created_at=since)  # as the demo command does before it backfills
    assert traffic.backfill(days=1, since=since) > 0

    def per_hour(model):
        return dict(model.objects.order_by().values("hour").annotate(n=Sum("requests")).values_list("hour", "n"))

    metered, served = per_hour(UsageHourly), per_hour(TritonServedHourly)
    assert metered == served  # what the gateway metered is what Triton counted, hour by hour
    assert min(metered) == since and max(metered) >= now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    assert any(h.day == 15 and h.month == since.month for h in metered)  # the middle of the past month is there

    billing.ensure_invoices(now, since=since)
    assert billing.finalize_due(now)  # the month-end run finalizes the past month
    past = Invoice.objects.filter(period_start=since.date())
    assert past.count() == 4 and all(i.status == Invoice.Status.FINALIZED for i in past)
    inv = past.get(tenant__slug="acme-ai")
    kinds = set(inv.lines.values_list("unit", flat=True))
    assert inv.total > Decimal(100) and len(kinds) >= 2, kinds  # slice-hours and tokens
    operator = Principal(is_operator=True)
    billing.issue_credit_note(operator, inv, reason="demo: service credit")
    assert billing.left_to_credit(inv) == 0
