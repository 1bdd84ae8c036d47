"""What each role may do inside its own tenant (403 where the object is visible but not allowed)."""

from __future__ import annotations

import re

import pytest

from tenants.models import ApiKey, Invitation, Membership, Tenant
from tenants.roles import Role
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("role", "allowed"), [
    (Role.OWNER, True), (Role.ADMIN, True), (Role.MEMBER, False), (Role.BILLING, False), (Role.VIEWER, False),
])
def test_who_manages_keys_and_invitations(as_user, world, members_a, role, allowed):
    api = as_user(members_a[role])
    r = api.post("/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": ["read"]})
    assert r.status_code == (201 if allowed else 403), r.content
    r = api.post("/api/v1/invitations/", {"tenant": "alpha", "email": f"{role}-guest@x.example"})
    assert r.status_code == (201 if allowed else 403), r.content
    r = api.patch("/api/v1/tenants/alpha/", {"name": "Alpha Renamed"})
    assert r.status_code == (200 if allowed else 403), r.content


def test_quotas_are_operator_only(as_user, world, members_a, operator):
    r = as_user(members_a[Role.OWNER]).patch("/api/v1/tenants/alpha/", {"max_slices": 999})
    assert r.status_code == 403
    r = as_user(operator).patch("/api/v1/tenants/alpha/", {"max_slices": 40, "monthly_spend_limit": "5000.00"})
    assert r.status_code == 200 and r.json()["max_slices"] == 40
    assert str(Tenant.objects.get(slug="alpha").monthly_spend_limit) == "5000.00"


def test_admin_cannot_grant_owner_and_last_owner_stays(as_user, world, members_a):
    admin = as_user(members_a[Role.ADMIN])
    viewer_m = Membership.objects.get(user=members_a[Role.VIEWER])
    r = admin.patch(f"/api/v1/memberships/{viewer_m.pk}/", {"role": "owner"})
    assert r.status_code == 403
    owner_m = Membership.objects.get(user=members_a[Role.OWNER])
    owner = as_user(members_a[Role.OWNER])
    r = owner.patch(f"/api/v1/memberships/{owner_m.pk}/", {"role": "member"})
    assert r.status_code == 400 and "role" in r.json()
    assert owner.delete(f"/api/v1/memberships/{owner_m.pk}/").status_code == 400
    assert Membership.objects.get(pk=owner_m.pk).role == Role.OWNER


def test_member_can_leave_but_not_remove_others(as_user, world, members_a):
    me = Membership.objects.get(user=members_a[Role.MEMBER])
    other = Membership.objects.get(user=members_a[Role.VIEWER])
    api = as_user(members_a[Role.MEMBER])
    assert api.delete(f"/api/v1/memberships/{other.pk}/").status_code == 403
    assert api.delete(f"/api/v1/memberships/{me.pk}/").status_code == 204
    assert not Membership.objects.filter(pk=me.pk).exists()


def test_invitation_accept_flow(as_user, world, members_a, mailoutbox, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        r = as_user(members_a[Role.ADMIN]).post(
            "/api/v1/invitations/", {"tenant": "alpha", "email": "Carol@Example.com", "role": "billing"})
    assert r.status_code == 201
    token = re.search(r"/invitations/([\w-]+)/", mailoutbox[-1].body).group(1)
    assert not Invitation.objects.filter(token_hash=token).exists()  # only the hash is stored
    # a different person cannot use it
    assert as_user(UserFactory(email="mallory@example.com")).post(
        "/api/v1/invitations/accept/", {"token": token}).status_code == 400
    carol = UserFactory(email="carol@example.com")
    r = as_user(carol).post("/api/v1/invitations/accept/", {"token": token})
    assert r.status_code == 201 and r.json()["role"] == "billing"
    assert Membership.objects.get(user=carol).tenant.slug == "alpha"
    # used once only
    assert as_user(carol).post("/api/v1/invitations/accept/", {"token": token}).status_code == 400


def test_revoked_invitation_cannot_be_accepted(as_user, world, members_a):
    from tenants import services
    from tenants.scoping import principal_for_user

    inv, token = services.invite(principal_for_user(members_a[Role.OWNER]), tenant=world["a"],
                                 email="dave@example.com", send=False)
    assert as_user(members_a[Role.OWNER]).delete(f"/api/v1/invitations/{inv.pk}/").status_code == 204
    r = as_user(UserFactory(email="dave@example.com")).post("/api/v1/invitations/accept/", {"token": token})
    assert r.status_code == 400 and "revoked" in r.json()["token"][0]


def test_suspended_tenant_reads_but_cannot_write(as_user, as_key, world, members_a, operator):
    r = as_user(operator).post("/api/v1/tenants/alpha/suspend/", {"reason": "unpaid invoice"})
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    owner = as_user(members_a[Role.OWNER])
    assert owner.get("/api/v1/tenants/alpha/").status_code == 200
    r = owner.post("/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": ["read"]})
    assert r.status_code in (400, 403)
    assert ApiKey.objects.filter(tenant__slug="alpha").count() == 1
    assert as_key(world["secret_a"]).get("/api/v1/tenants/alpha/").status_code == 200
    assert as_user(operator).post("/api/v1/tenants/alpha/activate/").json()["status"] == "active"


def test_operator_only_actions(as_user, world, members_a):
    api = as_user(members_a[Role.OWNER])
    assert api.post("/api/v1/tenants/alpha/suspend/").status_code == 403
    assert api.post("/api/v1/tenants/", {"name": "X", "slug": "x", "billing_email": "x@x.example"}).status_code == 403
    assert Tenant.objects.get(slug="alpha").status == "active"


def test_pagination_and_filters(as_user, operator, db):
    from tests.factories import TenantFactory

    for i in range(7):
        TenantFactory(slug=f"t{i}", name=f"T{i}", currency="EUR" if i % 2 else "USD")
    api = as_user(operator)
    r = api.get("/api/v1/tenants/?page_size=3")
    body = r.json()
    assert body["count"] == 7 and len(body["results"]) == 3 and body["next"]
    assert api.get("/api/v1/tenants/?currency=EUR").json()["count"] == 3
    assert api.get("/api/v1/tenants/?search=T4").json()["count"] == 1
    assert [t["slug"] for t in api.get("/api/v1/tenants/?ordering=-slug&page_size=2").json()["results"]] == ["t6", "t5"]


def test_me_lists_roles(as_user, world, members_a):
    r = as_user(members_a[Role.BILLING]).get("/api/v1/me/")
    assert r.json()["memberships"] == [{"tenant": "alpha", "role": "billing", "tenant_status": "active"}]


@pytest.mark.parametrize("staff, active, superuser, via", [
    (True, True, False, "user"), (True, True, False, "group"), (True, True, False, None),
    (True, False, False, "user"), (False, True, False, "user"), (True, True, True, None), (True, False, True, None),
    (False, True, True, None),
])
def test_is_operator_is_what_the_permission_backend_answers(staff, active, superuser, via):
    """User.is_operator (one EXISTS query) says what has_perm('tenants.operate') through the auth backend says, for
    active staff: the permission on the user or one of its groups, or a superuser; never inactive or non-staff."""
    from django.contrib.auth.models import Group, Permission

    from tenants.models import User

    u = UserFactory(is_staff=staff, is_active=active, is_superuser=superuser)
    perm = Permission.objects.get(content_type__app_label="tenants", codename="operate")
    if via == "user":
        u.user_permissions.add(perm)
    elif via == "group":
        g = Group.objects.create(name="ops")
        g.permissions.add(perm)
        u.groups.add(g)
    u = User.objects.get(pk=u.pk)  # (no cached permissions)
    assert u.is_operator == bool(active and staff and User.objects.get(pk=u.pk).has_perm("tenants.operate"))
    assert u.is_operator == (active and staff and (superuser or via is not None))
