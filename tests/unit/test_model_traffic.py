"""Per-model requests, tokens, errors and latency on the tenant's model pages, aggregated in SQL in a
fixed number of queries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from marketplace.models import Allocation, ModelDeployment, Order
from marketplace.selectors.model_traffic import deployment_windows, traffic_by_deployment
from telemetry.models import TritonServedHourly, UsageEvent, UsageHourly
from tenants.roles import Role

pytestmark = pytest.mark.django_db


def _dep(tenant, tier, name):
    order = Order.objects.create(tenant=tenant, tier=tier)
    alloc = Allocation.objects.create(order=order, tenant=tenant, tier=tier, state="active")
    return ModelDeployment.objects.create(allocation=alloc, tenant=tenant, name=name, backend="python", spec={},
                                          memory_mb=10, state="ready")


def _traffic(dep, hours_ago, requests, failures=0, latencies=()):
    now = timezone.now()
    hour = (now - timedelta(hours=hours_ago)).replace(minute=0, second=0, microsecond=0)
    UsageHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=hour, requests=requests,
                               input_tokens=requests * 10, output_tokens=requests * 30, events=requests)
    if failures:
        TritonServedHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=hour, requests=requests,
                                          failures=failures)
    for i, ms in enumerate(latencies):
        UsageEvent.objects.create(tenant=dep.tenant, deployment=dep, event_id=f"{dep.pk}-{hours_ago}-{i}",
                                  ts=now - timedelta(hours=hours_ago), input_tokens=10, output_tokens=30,
                                  latency_ms=ms)


def test_windows_sum_what_each_source_says(tiers, tenant_a):
    dep = _dep(tenant_a, tiers["1g"], "llm")
    _traffic(dep, 0, 5, failures=1, latencies=[100, 300])
    _traffic(dep, 5, 20, latencies=[200])
    _traffic(dep, 72, 1000, failures=10)
    _traffic(dep, 24 * 9, 7)  # outside every window
    rows = {r["window"]: r for r in deployment_windows(dep, timezone.now())}
    assert (rows["1 h"]["requests"], rows["1 h"]["errors"], rows["1 h"]["latency_avg_ms"]) == (5, 1, 200)
    assert rows["24 h"]["requests"] == 25 and rows["24 h"]["input_tokens"] == 250
    assert rows["24 h"]["output_tokens"] == 750 and rows["24 h"]["latency_avg_ms"] == 200
    assert rows["7 d"]["requests"] == 1025 and rows["7 d"]["errors"] == 11


def test_traffic_by_deployment_is_three_queries(tiers, tenant_a, django_assert_num_queries):
    deps = [_dep(tenant_a, tiers["1g"], f"m{i}") for i in range(6)]
    for i, d in enumerate(deps):
        _traffic(d, 1, i + 1, failures=i, latencies=[50 * (i + 1)])
    with django_assert_num_queries(3):
        out = traffic_by_deployment([d.pk for d in deps], timezone.now() - timedelta(hours=24))
    assert [out[d.pk]["requests"] for d in deps] == [1, 2, 3, 4, 5, 6]
    assert [out[d.pk]["errors"] for d in deps] == [0, 1, 2, 3, 4, 5]
    assert out[deps[2].pk]["latency_avg_ms"] == 150


def test_model_pages_show_the_figures_in_constant_queries(client, members_a, tiers, tenant_a, tenant_b,
                                                           django_assert_max_num_queries):
    client.force_login(members_a[Role.OWNER])
    d1 = _dep(tenant_a, tiers["1g"], "alpha-llm")
    _traffic(d1, 1, 1234, failures=3, latencies=[120])
    other = _dep(tenant_b, tiers["1g"], "bravo-llm")
    _traffic(other, 1, 99999)
    url = reverse("portal:deployments")
    client.get(url)
    with django_assert_max_num_queries(60) as few:
        r = client.get(url)
    html = r.content.decode()
    assert "1,234" in html and "99,999" not in html and "120 ms" in html
    for i in range(8):
        _traffic(_dep(tenant_a, tiers["1g"], f"more-{i}"), 1, 7, failures=1, latencies=[80])
    with django_assert_max_num_queries(len(few.captured_queries)):
        client.get(url)

    r = client.get(reverse("portal:deployment", args=[d1.pk]))
    html = r.content.decode()
    assert 'id="model-traffic"' in html and 'data-window="24 h"' in html and "1,234" in html
