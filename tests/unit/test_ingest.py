"""Usage ingest through POST /api/v1/usage/events/ (SQLite and PostgreSQL): idempotency per
(tenant, event id), rejection per item, whole-batch refusal of malformed input, hourly rollups, and
the tenant isolation of the hourly API."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone

from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning
from telemetry import selectors
from telemetry.models import UsageEvent, UsageHourly
from telemetry.services import ingest
from tenants.errors import Forbidden
from tenants.roles import Role
from tenants.scoping import principal_for_key, principal_for_user
from tests.factories import make_key

pytestmark = pytest.mark.django_db
URL = "/api/v1/usage/events/"


def _deployment(owner, tenant, tier, name="tiny-gen") -> ModelDeployment:
    p = principal_for_user(owner)
    alloc = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    provisioning.provision(alloc.pk)
    dep = deployments.deploy(p, Allocation.objects.get(pk=alloc.pk), name, template="tiny-gen")
    deployments.load(dep.pk)
    ModelDeployment.objects.filter(pk=dep.pk).update(created_at=timezone.now() - timedelta(days=30))
    return ModelDeployment.objects.get(pk=dep.pk)


@pytest.fixture
def deps(world, members_a, h100_node, tiers):
    """One ready tiny-gen deployment for tenant A and one for tenant B."""
    return {"a": _deployment(members_a[Role.OWNER], world["a"], tiers["1g"]),
            "b": _deployment(world["owner_b"], world["b"], tiers["1g"])}


HOUR0 = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=5)


def ev(n, dep, *, hour=0, minute=7, **kw):
    e = {"event_id": f"ev-{n}", "deployment": dep.pk if hasattr(dep, "pk") else dep,
         "ts": (HOUR0 + timedelta(hours=hour, minutes=minute)).isoformat(),
         "input_tokens": 10 + n, "output_tokens": 2 * n, "requests": 1}
    e.update(kw)
    return e


def totals(tenant):
    return UsageHourly.objects.filter(tenant=tenant).aggregate(
        i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests"), n=Sum("events"))


def post(api, events, **extra):
    return api.post(URL, {"events": events, **extra}, format="json")


class _Reporter:
    """An operator key with usage:write (an MSP-run gateway) reporting for one tenant."""

    def __init__(self, api, secret, slug):
        self.api, self.secret, self.slug = api, secret, slug

    def post(self, url, data, format=None):
        self.api.credentials(HTTP_AUTHORIZATION=f"Bearer {self.secret}")
        return self.api.post(url, {"tenant": self.slug, **data} if isinstance(data, dict) else data, format=format)


@pytest.fixture
def reporter(api, operator):
    from tenants.models import ApiKey

    key, secret = make_key(None, ["usage:write"], created_by=operator)
    assert ApiKey.objects.get(pk=key.pk).tenant is None
    return lambda slug: _Reporter(api, secret, slug)


def test_counts_new_duplicates_and_rejected(as_key, world, deps, reporter):
    api = reporter("alpha")
    r = post(api, [ev(1, deps["a"]), ev(2, deps["a"]), ev(3, deps["a"])])
    assert r.status_code == 200, r.content
    assert r.json() == {"new": 3, "duplicates": 0, "rejected": []}
    r = post(api, [ev(2, deps["a"]), ev(4, deps["a"]), ev(5, deps["b"]), ev(6, 999_999)])
    body = r.json()
    assert r.status_code == 200 and body["new"] == 1 and body["duplicates"] == 1
    assert [(x["index"], x["event_id"]) for x in body["rejected"]] == [(2, "ev-5"), (3, "ev-6")]
    assert all("no deployment" in x["reason"] for x in body["rejected"])
    assert UsageEvent.objects.filter(tenant=world["a"]).count() == 4
    assert totals(world["a"]) == {"i": 11 + 12 + 13 + 14, "o": 2 + 4 + 6 + 8, "r": 4, "n": 4}


def test_replaying_a_batch_three_times_leaves_totals_exact(as_key, world, deps, reporter):
    api = reporter("alpha")
    batch = [ev(n, deps["a"], hour=n % 3, minute=n % 60, requests=1 + n % 4) for n in range(300)]
    expected = {"i": sum(10 + n for n in range(300)), "o": sum(2 * n for n in range(300)),
                "r": sum(1 + n % 4 for n in range(300)), "n": 300}
    results = [post(api, batch).json() for _ in range(3)]
    assert results[0] == {"new": 300, "duplicates": 0, "rejected": []}
    assert results[1] == results[2] == {"new": 0, "duplicates": 300, "rejected": []}
    assert UsageEvent.objects.filter(tenant=world["a"]).count() == 300
    assert totals(world["a"]) == expected
    hours = UsageHourly.objects.filter(tenant=world["a"]).order_by("hour")
    assert [h.hour for h in hours] == [HOUR0 + timedelta(hours=k) for k in range(3)]
    assert [h.events for h in hours] == [100, 100, 100]


def test_duplicates_inside_one_batch_count_once_first_wins(as_key, world, deps, reporter):
    api = reporter("alpha")
    r = post(api, [ev(1, deps["a"]), ev(1, deps["a"], input_tokens=5000), ev(2, deps["a"]), ev(2, deps["a"])])
    assert r.json() == {"new": 2, "duplicates": 2, "rejected": []}
    assert totals(world["a"])["i"] == 11 + 12
    assert UsageEvent.objects.get(tenant=world["a"], event_id="ev-1").input_tokens == 11


def test_malformed_batch_is_refused_whole_naming_the_items(as_key, world, deps, reporter):
    api = reporter("alpha")
    good = ev(0, deps["a"])
    missing_ts = {k: v for k, v in ev(1, deps["a"]).items() if k != "ts"}
    naive = ev(3, deps["a"], ts="2025-01-01T10:00:00")
    string_tokens = ev(4, deps["a"], input_tokens="5")
    negative = ev(5, deps["a"], output_tokens=-1)
    bool_requests = ev(6, deps["a"], requests=True)
    long_id = ev(7, deps["a"], event_id="x" * 101)
    no_target = {k: v for k, v in ev(8, deps["a"]).items() if k != "deployment"}
    r = post(api, [good, missing_ts, good | {"event_id": "ok-2"}, naive, string_tokens, negative, bool_requests,
                   long_id, no_target, "not an object"])
    assert r.status_code == 400, r.content
    errors = r.json()["events"]
    assert set(errors) == {"1", "3", "4", "5", "6", "7", "8", "9"}
    assert errors["1"] == ["ts is required"]
    assert "timezone" in errors["3"][0] and "integer" in errors["4"][0] and "between" in errors["5"][0]
    assert not UsageEvent.objects.exists() and not UsageHourly.objects.exists()
    for bad in ({"events": "nope"}, {"events": []}, {"nothing": 1}, [1, 2]):
        assert api.post(URL, bad, format="json").status_code == 400
    assert not UsageEvent.objects.exists()


def test_batch_limit(as_key, world, deps, reporter):
    api = reporter("alpha")
    big = [ev(n, deps["a"], event_id=f"{n:0100d}") for n in range(10_001)]
    r = post(api, big)
    assert r.status_code == 400 and "at most 10000" in r.json()["events"][0]
    assert not UsageEvent.objects.exists()
    r = post(api, big[:10_000])  # the largest batch, with the longest ids (~2.3 MB of JSON)
    assert r.status_code == 200 and r.json()["new"] == 10_000
    assert totals(world["a"])["n"] == 10_000


def test_other_tenants_deployment_is_rejected_with_reason(as_key, world, deps, reporter):
    r = post(reporter("alpha"), [ev(1, deps["b"]), ev(2, deps["a"])])
    assert r.status_code == 200
    assert r.json()["rejected"] == [{"index": 0, "event_id": "ev-1",
                                     "reason": f"no deployment {deps['b'].pk} in this tenant"}]
    assert r.json()["new"] == 1
    assert not UsageEvent.objects.filter(deployment=deps["b"]).exists()
    assert not UsageHourly.objects.filter(tenant=world["b"]).exists()


def test_model_name_resolution(as_key, world, members_a, deps, tiers, reporter):
    api = reporter("alpha")
    by_name = {k: v for k, v in ev(1, deps["a"]).items() if k != "deployment"} | {"model": "tiny-gen"}
    unknown = by_name | {"event_id": "ev-2", "model": "nope"}
    mismatch = ev(3, deps["a"], model="other")
    r = post(api, [by_name, unknown, mismatch])
    body = r.json()
    assert body["new"] == 1 and [x["index"] for x in body["rejected"]] == [1, 2]
    assert "no live deployment named 'nope'" in body["rejected"][0]["reason"]
    assert UsageEvent.objects.get(event_id="ev-1").deployment_id == deps["a"].pk
    # A second live tiny-gen on another slice of the same tenant: the name is ambiguous.
    _deployment(members_a[Role.OWNER], world["a"], tiers["1g"])
    r = post(api, [by_name | {"event_id": "ev-9"}])
    assert r.json()["new"] == 0 and "ambiguous" in r.json()["rejected"][0]["reason"]
    # Tenant B's tiny-gen is never what A's name means.
    r = post(reporter("bravo"), [by_name | {"event_id": "b-1"}])
    assert r.json()["new"] == 1 and UsageEvent.objects.get(event_id="b-1").deployment_id == deps["b"].pk


def test_late_event_is_counted_in_its_old_hour(as_key, world, deps, reporter):
    api = reporter("alpha")
    old = datetime(2024, 3, 5, 14, 0, tzinfo=UTC)
    ModelDeployment.objects.filter(pk=deps["a"].pk).update(created_at=old - timedelta(days=1))
    UsageHourly.objects.create(tenant=world["a"], deployment=deps["a"], hour=old, input_tokens=100, output_tokens=10,
                               requests=1, events=1, billed_input_tokens=100, billed_output_tokens=10,
                               billed_requests=1)  # an hour an invoice already charged
    r = post(api, [ev(1, deps["a"], ts="2024-03-05T15:59:59+01:00", input_tokens=7, output_tokens=3)])
    assert r.json()["new"] == 1
    h = UsageHourly.objects.get(tenant=world["a"], hour=old)
    assert (h.input_tokens, h.output_tokens, h.requests, h.events) == (107, 13, 2, 2)
    assert (h.billed_input_tokens, h.billed_output_tokens) == (100, 10)  # billing sees the difference


def test_future_and_removed_deployment_events_are_rejected(as_key, world, members_a, deps, reporter):
    api = reporter("alpha")
    soon = (timezone.now() + timedelta(minutes=2)).isoformat()
    later = (timezone.now() + timedelta(minutes=30)).isoformat()
    r = post(api, [ev(1, deps["a"], ts=soon), ev(2, deps["a"], ts=later)])
    assert r.json()["new"] == 1 and r.json()["rejected"][0]["reason"].startswith("ts is more than 5 minutes")
    deployments.remove(principal_for_user(members_a[Role.OWNER]), deps["a"])
    deployments.unload(deps["a"].pk)
    removed_at = ModelDeployment.objects.get(pk=deps["a"].pk).updated_at
    before = (removed_at - timedelta(minutes=1)).isoformat()
    after = (removed_at + timedelta(seconds=30)).isoformat()
    r = post(api, [ev(3, deps["a"], ts=before), ev(4, deps["a"], ts=after)])
    assert r.json()["new"] == 1 and "was removed" in r.json()["rejected"][0]["reason"]


def test_who_may_post_usage(as_key, as_user, world, members_a, deps, reporter, operator):
    """Tessera bills what its gateway served: no tenant user or tenant key reports usage, whatever its role or
    scopes (a tenant key that still carries usage:write from before is refused too); operators and operator keys
    with usage:write (an MSP-run external gateway) may."""
    r = post(as_key(world["secret_b"]), [ev(1, deps["b"])])  # tenant B's key has scope read only
    assert r.status_code == 403
    _, billing_key = make_key(world["a"], ["read", "billing:read"])
    assert post(as_key(billing_key), [ev(1, deps["a"])]).status_code == 403
    assert post(as_key(world["secret_a"]), [ev(1, deps["a"])]).status_code == 403  # a legacy usage:write key
    for role in (Role.VIEWER, Role.BILLING, Role.MEMBER, Role.ADMIN, Role.OWNER):
        r = post(as_user(members_a[role]), [ev(10, deps["a"])], tenant="alpha")
        assert r.status_code == 403, (role, r.content)
    assert post(reporter("alpha"), [ev(10, deps["a"])]).status_code == 200
    assert post(as_user(operator), [ev(11, deps["a"])], tenant="alpha").status_code == 200
    assert post(reporter("nope"), [ev(12, deps["a"])]).status_code == 404
    assert UsageEvent.objects.count() == 2
    with pytest.raises(Forbidden):
        ingest.ingest_batch(principal_for_key(world["key_b"]), world["b"], [ev(1, deps["b"])])
    with pytest.raises(Forbidden):
        ingest.ingest_batch(principal_for_key(world["key_a"]), world["a"], [ev(1, deps["a"])])


def test_hourly_api_isolation(as_key, world, deps, django_assert_max_num_queries, reporter):
    post(reporter("alpha"), [ev(1, deps["a"]), ev(2, deps["a"], hour=1)])
    _, usage_b = make_key(world["b"], ["usage:write"])
    post(reporter("bravo"), [ev(1, deps["b"])])
    api_a = as_key(world["secret_a"])
    api_a.get("/api/v1/usage/hourly/")
    with django_assert_max_num_queries(5):  # key lookup (+ last-used touch), count, page: not per row
        r = api_a.get("/api/v1/usage/hourly/")
    assert r.status_code == 200 and r.json()["count"] == 2
    assert {row["tenant"] for row in r.json()["results"]} == {"alpha"}
    b = as_key(world["secret_b"])
    rows = b.get("/api/v1/usage/hourly/").json()
    assert rows["count"] == 1 and rows["results"][0]["tenant"] == "bravo"
    assert b.get("/api/v1/usage/hourly/?tenant=alpha").json()["count"] == 0
    assert b.get(f"/api/v1/usage/hourly/?deployment={deps['a'].pk}").json()["count"] == 0
    a_row = UsageHourly.objects.filter(tenant=world["a"]).first()
    assert b.get(f"/api/v1/usage/hourly/{a_row.pk}/").status_code == 404
    _, billing_only = make_key(world["a"], ["billing:read"])
    since = (HOUR0 + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    r = as_key(billing_only).get("/api/v1/usage/hourly/", {"hour_from": since})
    assert r.status_code == 200 and r.json()["count"] == 1
    assert as_key(usage_b).get("/api/v1/usage/hourly/").status_code == 403  # usage:write cannot read


def test_usage_summary_reads_rollups(as_key, world, deps, operator, django_assert_max_num_queries, reporter):
    post(reporter("alpha"), [ev(n, deps["a"], hour=n % 2) for n in range(10)])
    post(reporter("bravo"), [ev(1, deps["b"])])
    p = principal_for_key(world["key_a"])
    start, end = HOUR0 - timedelta(days=1), HOUR0 + timedelta(days=1)
    with django_assert_max_num_queries(3):
        rows = selectors.usage_summary(p, start, end, "deployment")
    assert len(rows) == 1 and rows[0]["tenant"] == "alpha" and rows[0]["events"] == 10
    assert rows[0]["model"] == "tiny-gen" and rows[0]["unbilled_requests"] == 10
    assert [r["events"] for r in selectors.usage_summary(p, start, end, "hour")] == [5, 5]
    assert selectors.usage_summary(p, start, end, "tier")[0]["tier"] == "h100-1g"
    assert len(selectors.usage_summary(p, start, end, "day")) in (1, 2)
    op = principal_for_user(operator)
    assert {r["tenant"] for r in selectors.usage_summary(op, start, end, "tenant")} == {"alpha", "bravo"}
    assert [r["tenant"] for r in selectors.usage_summary(op, start, end, "tenant", {"tenant": "bravo"})] == ["bravo"]
    assert selectors.usage_summary(p, start, end, "tenant", {"tenant": "bravo"}) == []
    with pytest.raises(ValueError):
        selectors.usage_summary(p, start, end, "model")


def test_events_before_the_deployment_existed_are_rejected_with_reason(as_key, world, deps, reporter):
    dep = deps["a"]
    created = timezone.now() - timedelta(hours=2)
    ModelDeployment.objects.filter(pk=dep.pk).update(created_at=created)
    too_early = {"event_id": "early", "deployment": dep.pk, "ts": (created - timedelta(hours=1)).isoformat(),
                 "input_tokens": 5, "output_tokens": 5}
    skewed = {"event_id": "skewed", "deployment": dep.pk, "ts": (created - timedelta(minutes=2)).isoformat(),
              "input_tokens": 5, "output_tokens": 5}  # within the allowed clock skew
    r = post(reporter("alpha"), [too_early, skewed])
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["new"] == 1
    assert [x["event_id"] for x in body["rejected"]] == ["early"]
    assert "was created at" in body["rejected"][0]["reason"]


def test_connection_lost_during_copy_is_a_json_503(as_key, world, deps, reporter):
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the COPY path is PostgreSQL's")
    import psycopg

    def lost(self, *a, **kw):
        raise psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly")

    from unittest import mock

    with mock.patch.object(psycopg.Cursor, "copy", lost):
        r = post(reporter("alpha"), [ev(900, deps["a"])])
    assert r.status_code == 503, r.content
    assert r["Content-Type"].startswith("application/json") and r["Retry-After"]
    assert "retry" in r.json()["detail"]
