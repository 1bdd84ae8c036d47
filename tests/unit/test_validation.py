"""Bad input to every tenancy endpoint: 400 with field errors, and nothing stored or changed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tenants.models import ApiKey, Invitation, Membership, Tenant
from tenants.roles import Role

pytestmark = pytest.mark.django_db


def snapshot():
    return (
        list(Tenant.objects.order_by("pk").values()),
        list(Membership.objects.order_by("pk").values()),
        list(Invitation.objects.order_by("pk").values()),
        list(ApiKey.objects.order_by("pk").values()),
    )


GOOD_TENANT = {"name": "New", "slug": "new-co", "billing_email": "b@new.example"}

OPERATOR_CASES = [
    ("post", "/api/v1/tenants/", {}, {"name", "slug", "billing_email"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "slug": "Bad Slug!"}, {"slug"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "billing_email": "nope"}, {"billing_email"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "currency": "XXX"}, {"currency"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "max_slices": -1}, {"max_slices"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "max_slices": 2, "max_slices_per_tier": 5}, {"max_slices_per_tier"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "monthly_spend_limit": "-5"}, {"monthly_spend_limit"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "monthly_spend_limit": "abc"}, {"monthly_spend_limit"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "spend_warn_ratio": "0.9", "spend_block_ratio": "0.5"},
     {"spend_warn_ratio"}),
    ("post", "/api/v1/tenants/", {**GOOD_TENANT, "owner_email": "not-an-email"}, {"owner_email"}),
    ("patch", "/api/v1/tenants/alpha/", {"currency": "ZZZ"}, {"currency"}),
    ("patch", "/api/v1/tenants/alpha/", {"max_memory_gb": "lots"}, {"max_memory_gb"}),
    ("patch", "/api/v1/tenants/alpha/", {"max_slices_per_tier": 10_000}, {"max_slices_per_tier"}),
    ("post", "/api/v1/tenants/alpha/suspend/", {"reason": "x" * 501}, {"reason"}),
    ("post", "/api/v1/api-keys/", {"name": "k", "scopes": ["root"]}, {"scopes"}),
]

OWNER_CASES = [
    ("patch", "/api/v1/tenants/alpha/", {"name": ""}, {"name"}),
    ("patch", "/api/v1/tenants/alpha/", {"billing_email": "x"}, {"billing_email"}),
    ("patch", "/api/v1/memberships/{member}/", {"role": "emperor"}, {"role"}),
    ("post", "/api/v1/invitations/", {"tenant": "alpha", "email": "bad"}, {"email"}),
    ("post", "/api/v1/invitations/", {"tenant": "alpha", "email": "ok@x.example", "role": "god"}, {"role"}),
    ("post", "/api/v1/invitations/", {"email": "ok@x.example"}, {"tenant"}),
    ("post", "/api/v1/invitations/", {"tenant": "nope", "email": "ok@x.example"}, {"tenant"}),
    ("post", "/api/v1/invitations/accept/", {}, {"token"}),
    ("post", "/api/v1/invitations/accept/", {"token": "bogus"}, {"token"}),
    ("post", "/api/v1/api-keys/", {}, {"name", "scopes"}),
    ("post", "/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": []}, {"scopes"}),
    ("post", "/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": ["read", "admin:all"]}, {"scopes"}),
    ("post", "/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": "read"}, {"scopes"}),
    ("post", "/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": ["read"], "expires_at": "yesterday"},
     {"expires_at"}),
    ("post", "/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": ["read"],
                                    "expires_at": (timezone.now() - timedelta(days=1)).isoformat()}, {"expires_at"}),
    ("post", "/api/v1/api-keys/", {"tenant": "alpha", "name": "x" * 101, "scopes": ["read"]}, {"name"}),
]


def _check(api, method, url, body, fields):
    before = snapshot()
    r = getattr(api, method)(url, body, format="json")
    assert r.status_code == 400, (url, body, r.status_code, r.content)
    errors = r.json()
    assert fields <= set(errors), (url, body, errors)
    for f in fields:
        err = errors[f]  # a list of messages, or {item index: messages} for a list field
        messages = err if isinstance(err, list) else [m for ms in err.values() for m in ms]
        assert messages and all(isinstance(m, str) and m for m in messages), (f, err)
    assert snapshot() == before, (url, body)


@pytest.mark.parametrize(("method", "url", "body", "fields"), OPERATOR_CASES)
def test_operator_bad_input(as_user, world, operator, method, url, body, fields):
    _check(as_user(operator), method, url, body, fields)


@pytest.mark.parametrize(("method", "url", "body", "fields"), OWNER_CASES)
def test_owner_bad_input(as_user, world, members_a, method, url, body, fields):
    member = Membership.objects.get(user=members_a[Role.MEMBER])
    _check(as_user(members_a[Role.OWNER]), method, url.format(member=member.pk), body, fields)


def test_malformed_json_is_400(as_user, world, members_a):
    api = as_user(members_a[Role.OWNER])
    before = snapshot()
    r = api.post("/api/v1/api-keys/", data="{not json", content_type="application/json")
    assert r.status_code == 400
    assert snapshot() == before


def test_duplicate_slug_is_a_conflict_and_stores_nothing(as_user, world, operator):
    before = snapshot()
    r = as_user(operator).post("/api/v1/tenants/", {**GOOD_TENANT, "slug": "alpha"})
    assert r.status_code == 409 and "slug" in r.json()
    assert snapshot() == before


def test_good_tenant_with_owner_invites_owner(as_user, world, operator, mailoutbox,
                                             django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        r = as_user(operator).post("/api/v1/tenants/", {**GOOD_TENANT, "owner_email": "Boss@New.example"})
    assert r.status_code == 201, r.content
    inv = Invitation.objects.get(tenant__slug="new-co")
    assert inv.email == "boss@new.example" and inv.role == Role.OWNER
    assert len(mailoutbox) == 1 and "boss@new.example" in mailoutbox[0].to


def test_nul_bytes_are_a_400_not_a_500(as_user, world, members_a):
    api = as_user(members_a[Role.OWNER])
    before = snapshot()
    r = api.post("/api/v1/api-keys/", {"tenant": "al\x00pha", "name": "k", "scopes": ["read"]})
    assert r.status_code == 400 and "tenant" in r.json()
    r = api.get("/api/v1/memberships/", {"tenant": "al\x00pha"})
    assert r.status_code in (200, 400)
    assert snapshot() == before
