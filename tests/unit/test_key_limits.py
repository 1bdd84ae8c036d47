"""Gateway limits through the REST API: a key's requests/tokens per minute (set at creation or PATCHed; a tenant's
admins within the ceiling its provider set, operators freely), and the tenant's ceilings and concurrency (operators
only); lowering a ceiling lowers the keys above it."""

from __future__ import annotations

import pytest

from tenants.models import ApiKey, AuditEvent, Tenant
from tenants.roles import Role

pytestmark = pytest.mark.django_db
KEYS = "/api/v1/api-keys/"


def _create(client, **extra):
    return client.post(KEYS, {"tenant": "alpha", "name": "team", "scopes": ["inference"], **extra}, format="json")


def test_a_tenant_admin_sets_key_limits_within_the_ceiling(world, members_a, as_user, settings):
    settings.TESSERA_GATEWAY_RPM, settings.TESSERA_GATEWAY_TPM = 600, 100_000
    Tenant.objects.filter(pk=world["a"].pk).update(max_key_requests_per_minute=120)
    admin = as_user(members_a[Role.ADMIN])
    r = _create(admin, requests_per_minute=100, tokens_per_minute=5_000)
    assert r.status_code == 201, r.content
    assert (r.json()["requests_per_minute"], r.json()["tokens_per_minute"]) == (100, 5_000)
    r = _create(admin, requests_per_minute=121)
    assert r.status_code == 400 and "at most 120" in str(r.json()), r.content
    # left empty while the ceiling is below the default: the key gets the ceiling, never the default
    r = _create(admin)
    assert r.status_code == 201 and r.json()["requests_per_minute"] == 120 and r.json()["tokens_per_minute"] is None
    key = r.json()["id"]
    r = admin.patch(f"{KEYS}{key}/", {"requests_per_minute": 60, "tokens_per_minute": 100_000}, format="json")
    assert r.status_code == 200 and (r.json()["requests_per_minute"], r.json()["tokens_per_minute"]) == (60, 100_000)
    assert ApiKey.objects.get(pk=key).requests_per_minute == 60
    assert AuditEvent.objects.filter(action="api_key.limits", tenant=world["a"]).exists()
    for body, field in (({"tokens_per_minute": 100_001}, "tokens_per_minute"), ({"requests_per_minute": 0},
                                                                                 "requests_per_minute"),
                        ({"name": "renamed"}, "name"), ({"scopes": ["read"]}, "scopes")):
        r = admin.patch(f"{KEYS}{key}/", body, format="json")
        assert r.status_code == 400 and field in r.json(), (body, r.content)
    assert ApiKey.objects.get(pk=key).requests_per_minute == 60 and ApiKey.objects.get(pk=key).name == "team"


def test_only_key_managers_of_the_tenant_change_its_keys(world, members_a, as_user):
    key = world["key_a"]
    r = as_user(members_a[Role.MEMBER]).patch(f"{KEYS}{key.pk}/", {"requests_per_minute": 5}, format="json")
    assert r.status_code in (403, 404)
    r = as_user(world["owner_b"]).patch(f"{KEYS}{key.pk}/", {"requests_per_minute": 5}, format="json")
    assert r.status_code == 404
    assert ApiKey.objects.get(pk=key.pk).requests_per_minute is None
    owner = as_user(members_a[Role.OWNER])
    assert owner.post(f"{KEYS}{key.pk}/revoke/").status_code == 200
    r = owner.patch(f"{KEYS}{key.pk}/", {"requests_per_minute": 5}, format="json")
    assert r.status_code == 409


def test_operators_set_ceilings_and_concurrency_and_keys_follow(world, members_a, operator, as_user, settings):
    settings.TESSERA_GATEWAY_RPM, settings.TESSERA_GATEWAY_TPM = 600, 100_000
    high = ApiKey.objects.filter(pk=world["key_a"].pk)
    high.update(requests_per_minute=500, tokens_per_minute=50_000)
    low, _ = (ApiKey.objects.create(tenant=world["a"], name="low", prefix="lowkey01", hashed_key="x" * 64,
                                    scopes=["inference"], requests_per_minute=10), None)
    other = ApiKey.objects.filter(pk=world["key_b"].pk)
    op = as_user(operator)
    r = op.patch("/api/v1/tenants/alpha/", {"max_key_requests_per_minute": 100, "max_key_tokens_per_minute": 200_000,
                                            "max_concurrent_requests": 8}, format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert (body["max_key_requests_per_minute"], body["max_key_tokens_per_minute"],
            body["max_concurrent_requests"]) == (100, 200_000, 8)
    # above the new ceiling: lowered to it; below it: kept; a ceiling above the default leaves empty keys empty
    assert (high.get().requests_per_minute, high.get().tokens_per_minute) == (100, 50_000)
    assert ApiKey.objects.get(pk=low.pk).requests_per_minute == 10
    assert other.get().requests_per_minute is None  # another tenant's key
    # an operator may give a key more than the tenant's ceiling
    r = op.patch(f"{KEYS}{world['key_a'].pk}/", {"requests_per_minute": 1_000}, format="json")
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 1_000
    # tenants cannot raise their own ceilings or concurrency
    owner = as_user(members_a[Role.OWNER])
    for field in ("max_key_requests_per_minute", "max_concurrent_requests"):
        assert owner.patch("/api/v1/tenants/alpha/", {field: 10_000}, format="json").status_code == 403
    for value in (0, -1, None):
        r = as_user(operator).patch("/api/v1/tenants/alpha/", {"max_concurrent_requests": value}, format="json")
        assert r.status_code == 400, (value, r.content)
    assert Tenant.objects.get(pk=world["a"].pk).max_concurrent_requests == 8


def test_the_portal_and_the_console_set_the_same_limits(world, members_a, operator, client, settings):
    from django.urls import reverse

    from tests.unit.test_web_console import _quota_data

    settings.TESSERA_GATEWAY_RPM = 600
    client.force_login(operator)
    r = client.post(reverse("console:tenant_detail", args=[world["a"].pk]),
                    _quota_data(world["a"], max_concurrent_requests=16, max_key_requests_per_minute=50))
    assert r.status_code == 302, r.content.decode()[:2000]
    a = Tenant.objects.get(pk=world["a"].pk)
    assert (a.max_concurrent_requests, a.max_key_requests_per_minute, a.max_key_tokens_per_minute) == (16, 50, None)
    client.force_login(members_a[Role.ADMIN])
    page = client.get(reverse("portal:keys")).content.decode()
    assert 'name="requests_per_minute" min="1" max="50"' in page
    r = client.post(reverse("portal:key_create"), {"name": "team", "scopes": ["inference"],
                                                   "requests_per_minute": "51"})
    assert r.status_code == 400 and "at most 50" in r.content.decode()
    r = client.post(reverse("portal:key_create"), {"name": "team", "scopes": ["inference"], "tokens_per_minute": "900"})
    assert r.status_code == 200
    key = ApiKey.objects.get(tenant=world["a"], name="team")
    assert (key.requests_per_minute, key.tokens_per_minute) == (50, 900)  # empty: the ceiling, below the default
    r = client.post(reverse("portal:key_limits", args=[key.pk]), {"requests_per_minute": "20", "tokens_per_minute": ""})
    assert r.status_code == 302
    key.refresh_from_db()
    assert (key.requests_per_minute, key.tokens_per_minute) == (20, None)
    r = client.post(reverse("portal:key_limits", args=[key.pk]), {"requests_per_minute": "500"}, follow=True)
    assert "at most 50" in r.content.decode() and ApiKey.objects.get(pk=key.pk).requests_per_minute == 20
    client.force_login(world["owner_b"])
    assert client.post(reverse("portal:key_limits", args=[key.pk]), {"requests_per_minute": "5"}).status_code == 404


def test_a_key_gets_a_monthly_token_allowance_through_the_api_and_the_portal(world, members_a, as_user, client,
                                                                              tiers):
    """The allowance is the tenant's own budget for a key: no ceiling of the provider's (it only refuses more);
    whole numbers of at least 1, empty for none. The keys page shows each key's tokens this month against it."""
    from datetime import timedelta

    from django.urls import reverse
    from django.utils import timezone

    from tests.factories import DeploymentFactory, UsageHourlyFactory

    admin = as_user(members_a[Role.ADMIN])
    r = _create(admin, monthly_token_allowance=2_000_000)
    assert r.status_code == 201 and r.json()["monthly_token_allowance"] == 2_000_000, r.content
    key = r.json()["id"]
    r = admin.patch(f"{KEYS}{key}/", {"monthly_token_allowance": 5_000}, format="json")
    assert r.status_code == 200 and r.json()["monthly_token_allowance"] == 5_000
    assert AuditEvent.objects.filter(action="api_key.limits", tenant=world["a"]).latest("at").detail[
        "monthly_token_allowance"] == 5_000
    for bad in (0, -5, "many", 1.5):
        r = admin.patch(f"{KEYS}{key}/", {"monthly_token_allowance": bad}, format="json")
        assert r.status_code == 400 and "monthly_token_allowance" in r.json(), (bad, r.content)
    assert ApiKey.objects.get(pk=key).monthly_token_allowance == 5_000
    r = as_user(members_a[Role.MEMBER]).patch(f"{KEYS}{key}/", {"monthly_token_allowance": None}, format="json")
    assert r.status_code in (403, 404) and ApiKey.objects.get(pk=key).monthly_token_allowance == 5_000

    obj = ApiKey.objects.get(pk=key)
    dep = DeploymentFactory(allocation__order__tenant=world["a"], allocation__order__tier=tiers["1g"])
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    UsageHourlyFactory(tenant=world["a"], deployment=dep, hour=hour, api_key=obj.prefix, input_tokens=4_000,
                       output_tokens=1_500)
    UsageHourlyFactory(tenant=world["a"], deployment=dep, hour=hour - timedelta(days=40), api_key=obj.prefix,
                       input_tokens=9_999)  # another month's: not counted
    client.force_login(members_a[Role.ADMIN])
    page = client.get(reverse("portal:keys")).content.decode()
    assert "5,500" in page and "allowance used" in page and 'name="monthly_token_allowance"' in page
    r = client.post(reverse("portal:key_limits", args=[key]), {"monthly_token_allowance": ""})
    assert r.status_code == 302 and ApiKey.objects.get(pk=key).monthly_token_allowance is None
    assert "allowance used" not in client.get(reverse("portal:keys")).content.decode()
    r = client.post(reverse("portal:key_create"), {"name": "capped", "scopes": ["inference"],
                                                   "monthly_token_allowance": "777"})
    assert r.status_code == 200 and ApiKey.objects.get(name="capped").monthly_token_allowance == 777


def test_an_operator_sets_any_keys_limits_on_the_consoles_tenant_page(world, members_a, operator, client):
    from django.urls import reverse

    Tenant.objects.filter(pk=world["a"].pk).update(max_key_requests_per_minute=10)
    key = world["key_a"]
    client.force_login(operator)
    page = client.get(reverse("console:tenant_detail", args=[world["a"].pk])).content.decode()
    assert 'id="tenant-keys"' in page and key.prefix in page
    r = client.post(reverse("console:tenant_key_limits", args=[key.pk]),
                    {"requests_per_minute": "500", "monthly_token_allowance": "1000000"})
    assert r.status_code == 302 and r["Location"] == reverse("console:tenant_detail", args=[world["a"].pk])
    key.refresh_from_db()  # above the tenant's ceiling: operators are not bound by it
    assert (key.requests_per_minute, key.tokens_per_minute, key.monthly_token_allowance) == (500, None, 1_000_000)
    r = client.post(reverse("console:tenant_key_limits", args=[key.pk]), {"requests_per_minute": "0"}, follow=True)
    assert "were not changed" in r.content.decode() and ApiKey.objects.get(pk=key.pk).requests_per_minute == 500
    client.force_login(members_a[Role.OWNER])
    r = client.post(reverse("console:tenant_key_limits", args=[key.pk]), {"requests_per_minute": "5"})
    assert r.status_code in (302, 403) and ApiKey.objects.get(pk=key.pk).requests_per_minute == 500
