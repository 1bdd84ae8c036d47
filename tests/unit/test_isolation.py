"""Tenant isolation over every tenancy endpoint: foreign objects are 404 (not 403, not the data)."""

from __future__ import annotations

import pytest

from tenants.models import ApiKey, Invitation, Membership, Tenant
from tenants.roles import Role

pytestmark = pytest.mark.django_db

LISTS = ["/api/v1/tenants/", "/api/v1/memberships/", "/api/v1/invitations/", "/api/v1/api-keys/"]


def foreign_urls(world):
    b = world["b"]
    m_b = Membership.objects.filter(tenant=b).first()
    return {
        "tenant": f"/api/v1/tenants/{b.slug}/",
        "membership": f"/api/v1/memberships/{m_b.pk}/",
        "invitation": f"/api/v1/invitations/{world['inv_b'].pk}/",
        "api_key": f"/api/v1/api-keys/{world['key_b'].pk}/",
    }


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN, Role.MEMBER, Role.BILLING, Role.VIEWER])
def test_lists_show_only_own_tenant(as_user, world, members_a, role):
    api = as_user(members_a[role])
    for url in LISTS:
        r = api.get(url)
        if r.status_code == 403:  # the role may not list this kind at all (keys, invitations)
            continue
        assert r.status_code == 200, (url, r.content)
        body = r.content.decode()
        assert "bravo" not in body and world["key_b"].prefix not in body and "new@bravo" not in body, url


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN, Role.MEMBER, Role.BILLING, Role.VIEWER])
def test_fetching_or_changing_foreign_objects_is_404(as_user, world, members_a, role):
    api = as_user(members_a[role])
    for kind, url in foreign_urls(world).items():
        assert api.get(url).status_code == 404, (kind, role)
        assert api.patch(url, {"name": "x", "role": "viewer"}).status_code in (404, 405), (kind, role)
        assert api.delete(url).status_code in (404, 405), (kind, role)
    for action in ["suspend", "activate"]:
        assert api.post(f"/api/v1/tenants/bravo/{action}/").status_code in (403, 404)
    assert api.post(f"/api/v1/api-keys/{world['key_b'].pk}/revoke/").status_code == 404
    # nothing of B changed
    assert Tenant.objects.get(slug="bravo").name == "Bravo"
    assert ApiKey.objects.get(pk=world["key_b"].pk).revoked_at is None
    assert Invitation.objects.get(pk=world["inv_b"].pk).revoked_at is None
    assert Membership.objects.filter(tenant=world["b"]).count() == 1


def test_api_key_of_a_cannot_reach_b(as_key, world):
    api = as_key(world["secret_a"])
    for kind, url in foreign_urls(world).items():
        assert api.get(url).status_code in (403, 404), kind
    assert api.get(foreign_urls(world)["tenant"]).status_code == 404
    assert api.get(foreign_urls(world)["membership"]).status_code == 404
    r = api.get("/api/v1/memberships/")
    assert r.status_code == 200 and "bravo" not in r.content.decode()


def test_writes_naming_a_foreign_tenant_are_rejected_without_storing(as_user, world, members_a):
    api = as_user(members_a[Role.OWNER])
    before = (ApiKey.objects.count(), Invitation.objects.count())
    r = api.post("/api/v1/api-keys/", {"tenant": "bravo", "name": "k", "scopes": ["read"]})
    assert r.status_code == 400 and "tenant" in r.json()
    r = api.post("/api/v1/invitations/", {"tenant": "bravo", "email": "spy@x.example", "role": "owner"})
    assert r.status_code == 400 and "tenant" in r.json()
    assert (ApiKey.objects.count(), Invitation.objects.count()) == before


def test_operator_sees_every_tenant(as_user, world, operator):
    r = as_user(operator).get("/api/v1/tenants/")
    assert {t["slug"] for t in r.json()["results"]} == {"alpha", "bravo"}
    assert as_user(operator).get("/api/v1/api-keys/").json()["count"] == 2


def test_user_without_membership_sees_nothing(as_user, world):
    from tests.factories import UserFactory

    api = as_user(UserFactory())
    assert api.get("/api/v1/tenants/").status_code == 403
    assert api.get("/api/v1/tenants/alpha/").status_code in (403, 404)


def test_anonymous_gets_401_or_403(api, world):
    for url in LISTS:
        assert api.get(url).status_code in (401, 403)
