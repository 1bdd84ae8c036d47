"""API keys: shown once, stored as a hash, authenticate only while usable and only for their scopes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tenants.models import ApiKey
from tenants.roles import Role
from tests.factories import make_key

pytestmark = pytest.mark.django_db


def test_create_returns_secret_once_and_stores_only_hash(as_user, members_a, tenant_a):
    api = as_user(members_a[Role.ADMIN])
    r = api.post("/api/v1/api-keys/", {"tenant": "alpha", "name": "gateway", "scopes": ["usage:write"]})
    assert r.status_code == 400 and "operator keys only" in r.json()["scopes"][0]  # Tessera meters, tenants don't
    r = api.post("/api/v1/api-keys/", {"tenant": "alpha", "name": "gateway", "scopes": ["inference"]})
    assert r.status_code == 201, r.content
    secret = r.json()["key"]
    assert secret.startswith("tsk_") and len(secret) > 40
    key = ApiKey.objects.get(pk=r.json()["id"])
    assert key.hashed_key != secret
    assert secret not in {str(v) for v in ApiKey.objects.filter(pk=key.pk).values().first().values()}
    assert secret.split("_")[1] == key.prefix
    # never shown again: neither on detail nor on list
    detail = api.get(f"/api/v1/api-keys/{key.pk}/").json()
    assert "key" not in detail and detail["prefix"] == key.prefix
    assert all("key" not in row for row in api.get("/api/v1/api-keys/").json()["results"])


def test_active_key_authenticates_and_records_last_use(as_key, tenant_a):
    key, secret = make_key(tenant_a, ["read"])
    assert key.last_used_at is None
    r = as_key(secret).get("/api/v1/me/")
    assert r.status_code == 200
    assert r.json()["api_key"]["prefix"] == key.prefix
    key.refresh_from_db()
    assert key.last_used_at is not None


@pytest.mark.parametrize("state", ["revoked", "expired", "wrong-secret", "unknown", "malformed"])
def test_unusable_key_is_rejected(as_key, tenant_a, state):
    key, secret = make_key(tenant_a, ["read"])
    if state == "revoked":
        ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())
    elif state == "expired":
        ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    elif state == "wrong-secret":
        secret = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    elif state == "unknown":
        secret = "tsk_000000000000_" + "x" * 43
    else:
        secret = "not-a-key"
    r = as_key(secret).get("/api/v1/tenants/")
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_key_with_future_expiry_works_until_then(as_key, tenant_a):
    key, secret = make_key(tenant_a, ["read"], expires_at=timezone.now() + timedelta(hours=1))
    assert as_key(secret).get("/api/v1/tenants/").status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    assert as_key(secret).get("/api/v1/tenants/").status_code == 401


def test_revoked_through_api_stops_working(as_user, as_key, members_a, tenant_a, api):
    key, secret = make_key(tenant_a, ["read"])
    assert as_key(secret).get("/api/v1/tenants/").status_code == 200
    api.credentials()
    r = as_user(members_a[Role.OWNER]).post(f"/api/v1/api-keys/{key.pk}/revoke/")
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    assert as_key(secret).get("/api/v1/tenants/").status_code == 401
    # revoking twice is a conflict, not a silent success
    api.credentials()
    assert as_user(members_a[Role.OWNER]).post(f"/api/v1/api-keys/{key.pk}/revoke/").status_code == 409


def test_key_acts_only_within_its_scopes(as_key, tenant_a):
    _, usage_only = make_key(tenant_a, ["usage:write"])
    assert as_key(usage_only).get("/api/v1/tenants/").status_code == 403
    assert as_key(usage_only).get("/api/v1/memberships/").status_code == 403
    _, reader = make_key(tenant_a, ["read"])
    r = as_key(reader).get("/api/v1/tenants/")
    assert r.status_code == 200 and [t["slug"] for t in r.json()["results"]] == ["alpha"]
    # no scope lets a key manage keys, members or the tenant
    _, everything = make_key(tenant_a, ["read", "usage:write", "billing:read", "deployments:write"])
    client = as_key(everything)
    assert client.post("/api/v1/api-keys/", {"tenant": "alpha", "name": "x", "scopes": ["read"]}).status_code == 403
    assert client.get("/api/v1/api-keys/").status_code == 403
    assert client.post("/api/v1/invitations/", {"tenant": "alpha", "email": "a@b.example"}).status_code == 403
    assert client.patch("/api/v1/tenants/alpha/", {"name": "Hacked"}).status_code == 403


def test_operator_key_sees_all_tenants_within_scope(as_key, operator, tenant_a, tenant_b):
    _, secret = make_key(None, ["read"], created_by=operator)
    r = as_key(secret).get("/api/v1/tenants/")
    assert r.status_code == 200
    assert {t["slug"] for t in r.json()["results"]} == {"alpha", "bravo"}
    # an operator key still cannot do operator writes (no scope grants them)
    assert as_key(secret).post("/api/v1/tenants/alpha/suspend/").status_code == 403


def test_tenantless_key_from_non_operator_sees_nothing(as_key, tenant_a, members_a):
    _, secret = make_key(None, ["read"], created_by=members_a[Role.OWNER])
    assert as_key(secret).get("/api/v1/tenants/").status_code == 403


def test_only_operators_create_operator_keys(as_user, operator, members_a):
    r = as_user(members_a[Role.OWNER]).post("/api/v1/api-keys/", {"name": "msp", "scopes": ["read"]})
    assert r.status_code == 403
    r = as_user(operator).post("/api/v1/api-keys/", {"name": "msp billing", "scopes": ["billing:read", "read"]})
    assert r.status_code == 201 and r.json()["tenant"] is None
