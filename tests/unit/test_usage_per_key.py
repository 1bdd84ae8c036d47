"""Usage per API key: the gateway meters each request with the key it served it for, the hourly rollups keep the
keys apart, and the usage summary splits a tenant's usage per key; the splits add up to the tenant's total, and the
invoice (its lines per deployment and adapter) is the same whatever the keys."""

from __future__ import annotations

from datetime import timedelta

import openai
import pytest
from django.utils import timezone

from marketplace.gateway import metering
from telemetry.models import UsageDaily, UsageEvent, UsageHourly
from telemetry.selectors import usage_summary
from telemetry.services.ingest import store_rows
from tenants.models import ApiKey
from tenants.scoping import principal_for_user
from tests.factories import make_key

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_gateway_meters_each_key_and_the_splits_add_up(gateway_fleet, gateway_factory, operator):
    fleet = gateway_fleet
    team_b, secret_b = make_key(fleet["a"], ["inference"], name="team-b")  # before the gateway reads its keys
    gw = gateway_factory()
    first = ApiKey.objects.get(tenant=fleet["a"], name="test key")
    sent = {first.prefix: 0, team_b.prefix: 0}
    for n, (secret, prefix) in enumerate([(fleet["key_a"], first.prefix), (secret_b, team_b.prefix)] * 3):
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=secret, max_retries=0, timeout=30)
        resp = client.completions.create(model="tiny-gen", prompt="one two three"[: 3 + 4 * (n % 3)], max_tokens=2 + n)
        sent[prefix] += resp.usage.prompt_tokens + resp.usage.completion_tokens
    metering.consume(budget_s=10)
    assert {e.api_key for e in UsageEvent.objects.filter(tenant=fleet["a"])} == set(sent)
    assert set(UsageHourly.objects.filter(tenant=fleet["a"]).values_list("api_key", flat=True)) == set(sent)
    now = timezone.now()
    op = principal_for_user(operator)
    by_key = usage_summary(op, now - timedelta(hours=2), now + timedelta(hours=1), "key", {"tenant": fleet["a"]})
    assert {r["key"]: r["input_tokens"] + r["output_tokens"] for r in by_key} == sent
    assert {r["key"]: r["key_name"] for r in by_key} == {first.prefix: "test key", team_b.prefix: "team-b"}
    total = usage_summary(op, now - timedelta(hours=2), now + timedelta(hours=1), "tenant", {"tenant": fleet["a"]})
    for s in ("input_tokens", "output_tokens", "requests", "events"):
        assert sum(r[s] for r in by_key) == total[0][s], s
    # the day's copy is per deployment, whatever the keys
    day = UsageDaily.objects.get(tenant=fleet["a"], deployment=fleet["gen"])
    assert day.input_tokens + day.output_tokens == sum(sent.values()) and day.hours == 2


def test_ingest_keeps_keys_apart_in_one_hour_and_usage_without_a_key(gateway_fleet):
    a, dep = gateway_fleet["a"], gateway_fleet["gen"]
    t = timezone.now().replace(minute=5, second=0, microsecond=0)
    rows = [("e1", dep.pk, t, 10, 1, 1, None, "", "k1"), ("e2", dep.pk, t, 20, 2, 1, None, "", "k2"),
            ("e3", dep.pk, t, 40, 4, 1, None, "", "k1"), ("e4", dep.pk, t, 80, 8, 1)]
    assert store_rows(a.pk, rows) == 4
    assert store_rows(a.pk, rows) == 0  # replayed: nothing twice
    got = {r.api_key: (r.input_tokens, r.output_tokens, r.events) for r in UsageHourly.objects.filter(tenant=a)}
    assert got == {"k1": (50, 5, 2), "k2": (20, 2, 1), "": (80, 8, 1)}


def test_a_key_is_named_only_in_its_own_tenants_rows(gateway_fleet, operator):
    """Rows naming another tenant's key prefix (only an operator's reported usage could write one) show the prefix,
    never that key's name: a tenant's summary does not read another tenant's keys."""
    a, b, dep = gateway_fleet["a"], gateway_fleet["b"], gateway_fleet["gen"]
    theirs = ApiKey.objects.get(tenant=b)
    t = timezone.now().replace(minute=5, second=0, microsecond=0)
    store_rows(a.pk, [("x1", dep.pk, t, 10, 1, 1, None, "", theirs.prefix)])
    now = timezone.now()
    rows = usage_summary(principal_for_user(operator), now - timedelta(hours=2), now + timedelta(hours=1), "key",
                         {"tenant": a})
    assert [(r["key"], r["key_name"]) for r in rows] == [(theirs.prefix, None)]
