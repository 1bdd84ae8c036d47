"""The tenant portal (server-rendered pages): every page for a member, tenancy (another tenant's
ids are 404), order errors shown with nothing stored, API keys shown once, read-only roles, and
query counts that do not grow with the rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from marketplace.models import Allocation, Invoice, ModelDeployment, Order
from marketplace.services import billing, orders
from tenants.models import ApiKey, Invitation, Membership
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db

PAGES = ["home", "catalog", "slices", "deployments", "usage", "invoices", "keys", "members", "repositories",
         "find_tier"]


def make_alloc(tenant, tier, state="active", **kw):
    o = Order.objects.create(tenant=tenant, tier=tier)
    return Allocation.objects.create(order=o, tenant=tenant, tier=tier, state=state, **kw)


def make_dep(alloc, name="m", state="ready"):
    return ModelDeployment.objects.create(allocation=alloc, tenant_id=alloc.tenant_id, name=name,
                                          backend="python", spec={}, memory_mb=100, state=state)


@pytest.fixture
def owner_client(client, members_a):
    client.force_login(members_a[Role.OWNER])
    return client


@pytest.fixture
def b_objects(world, tiers):
    b = world["b"]
    alloc = make_alloc(b, tiers["1g"])
    return {"slice": alloc, "dep": make_dep(alloc), "invoice": billing.current_invoice(b), "key": world["key_b"],
            "invitation": world["inv_b"]}


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN, Role.MEMBER, Role.BILLING, Role.VIEWER])
def test_every_page_renders_for_every_role(client, world, tiers, role):
    user = UserFactory()
    MembershipFactory(user=user, tenant=world["a"], role=role)
    client.force_login(user)
    for name in PAGES:
        r = client.get(reverse(f"portal:{name}"))
        assert r.status_code == 200, (name, r.status_code)
        assert b"Alpha" in r.content


def test_anonymous_is_sent_to_login_and_operator_to_console(client, operator):
    r = client.get(reverse("portal:home"))
    assert r.status_code == 302 and "/login/" in r["Location"]
    client.force_login(operator)
    r = client.get(reverse("portal:slices"))
    assert r.status_code == 302 and r["Location"] == reverse("console:overview")


def test_other_tenants_objects_are_404(owner_client, b_objects):
    o = b_objects
    gets = [("portal:slice", o["slice"]), ("portal:slice_status", o["slice"]), ("portal:invoice", o["invoice"]),
            ("portal:invoice_csv", o["invoice"]), ("portal:deployment", o["dep"]),
            ("portal:deployment_status", o["dep"])]
    for name, obj in gets:
        assert owner_client.get(reverse(name, args=[obj.pk])).status_code == 404, name
    posts = [("portal:key_revoke", o["key"]), ("portal:slice_release", o["slice"]),
             ("portal:deployment_remove", o["dep"]), ("portal:invitation_revoke", o["invitation"])]
    for name, obj in posts:
        assert owner_client.post(reverse(name, args=[obj.pk])).status_code == 404, name
    o["key"].refresh_from_db()
    o["invitation"].refresh_from_db()
    o["slice"].refresh_from_db()
    assert o["key"].revoked_at is None and o["invitation"].revoked_at is None and o["slice"].state == "active"
    # and nothing of B shows in A's lists
    assert o["key"].prefix not in owner_client.get(reverse("portal:keys")).content.decode()
    assert "new@bravo.example" not in owner_client.get(reverse("portal:members")).content.decode()


def test_own_objects_open(owner_client, world, tiers):
    a = make_alloc(world["a"], tiers["1g"])
    dep = make_dep(a)
    inv = billing.current_invoice(world["a"])
    for name, obj in [("portal:slice", a), ("portal:slice_status", a), ("portal:deployment", dep),
                      ("portal:deployment_status", dep), ("portal:invoice", inv)]:
        assert owner_client.get(reverse(name, args=[obj.pk])).status_code == 200, name
    r = owner_client.get(reverse("portal:invoice_csv", args=[inv.pk]))
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    assert r.content.decode().startswith("invoice,draft,tenant,alpha")


def test_catalog_shows_price_and_live_availability(owner_client, h100_node, tiers):
    r = owner_client.get(reverse("portal:catalog"))
    body = r.content.decode()
    assert "h100-3g" in body and "1.00 USD" in body  # one formatting rule: a unit price, at least the cents
    free = {row["tier"].key: row["free"] for row in r.context["rows"]}
    # 8 GPUs: one 7g each; seven 1g starts each (56) is shown only up to the cap (a fleet figure)
    assert free["h100-1g"] == "10+" and free["h100-7g"] == 8


def test_order_success_redirects_to_slice(owner_client, h100_node, tiers, world):
    r = owner_client.post(reverse("portal:order", args=[tiers["3g"].pk]), {"quantity": "1"})
    a = Allocation.objects.get(tenant=world["a"])
    assert r.status_code == 302 and r["Location"] == reverse("portal:slice", args=[a.pk])
    page = owner_client.get(r["Location"]).content.decode()
    assert "placed" in page and 'hx-trigger="every 1s"' in page


def test_order_no_capacity_is_shown_and_nothing_stored(owner_client, tiers, world):
    r = owner_client.post(reverse("portal:order", args=[tiers["3g"].pk]), {"quantity": "1"})
    assert r.status_code == 400
    assert "Not ordered" in r.content.decode() and 'class="msg error"' in r.content.decode()
    assert not Order.objects.exists() and not Allocation.objects.exists()


def test_order_quota_is_shown_and_nothing_stored(owner_client, h100_node, tiers, world):
    world["a"].max_slices_per_tier = 1
    world["a"].save()
    r = owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "2"})
    assert r.status_code == 400 and "quota" in r.content.decode()
    assert not Order.objects.exists() and not Allocation.objects.exists()


def test_order_spend_limit_is_shown(owner_client, h100_node, tiers, world):
    t = world["a"]
    now = timezone.now()
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    make_alloc(t, tiers["7g"], activated_at=max(month, now - timedelta(hours=3)))
    t.monthly_spend_limit = "0.01"
    t.save()
    r = owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "1"})
    assert r.status_code == 400 and "spend limit" in r.content.decode()
    assert Order.objects.count() == 1
    home = owner_client.get(reverse("portal:home")).content.decode()
    assert "Spend limit reached" in home


def test_viewer_sees_no_forms_and_posts_are_403(client, members_a, world, tiers, h100_node):
    client.force_login(members_a[Role.VIEWER])
    for name, marker in [("catalog", "order-form"), ("keys", "key-form"), ("members", "invite-form"),
                         ("deployments", "deploy-form")]:
        body = client.get(reverse(f"portal:{name}")).content.decode()
        assert marker not in body, name
    a = make_alloc(world["a"], tiers["1g"])
    dep = make_dep(a)
    key, _ = make_key(world["a"])
    inv = Invitation.objects.get(tenant=world["a"])
    for url, data in [(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": 1}),
                      (reverse("portal:key_create"), {"name": "k", "scopes": ["read"]}),
                      (reverse("portal:key_revoke", args=[key.pk]), {}),
                      (reverse("portal:member_invite"), {"email": "z@x.example", "role": "member"}),
                      (reverse("portal:invitation_revoke", args=[inv.pk]), {}),
                      (reverse("portal:slice_release", args=[a.pk]), {}),
                      (reverse("portal:deployment_create"), {"allocation": a.pk, "name": "x"}),
                      (reverse("portal:deployment_remove", args=[dep.pk]), {})]:
        r = client.post(url, data)
        assert r.status_code in (403, 404), (url, r.status_code)
        assert r.status_code == 403 or "revoke" in url, url
    assert Order.objects.count() == 1 and ApiKey.objects.filter(name="k").count() == 0
    key.refresh_from_db()
    assert key.revoked_at is None


def test_posts_need_csrf(members_a, world):
    from django.test import Client

    c = Client(enforce_csrf_checks=True)
    c.force_login(members_a[Role.OWNER])
    r = c.post(reverse("portal:key_create"), {"name": "k", "scopes": ["read"]})
    assert r.status_code == 403 and not ApiKey.objects.filter(name="k").exists()
    assert c.get(reverse("portal:key_create")).status_code == 405


def test_key_create_shows_secret_once_and_stores_hash(owner_client, world):
    r = owner_client.post(reverse("portal:key_create"), {"name": "ci", "scopes": ["read", "inference"]})
    assert r.status_code == 200
    secret = r.context["secret"]
    body = r.content.decode()
    assert f'class="secret" id="key-secret">{secret}<' in body
    key = ApiKey.objects.get(name="ci")
    assert key.hashed_key != secret and secret not in key.hashed_key and key.scopes == ["inference", "read"]
    assert secret not in owner_client.get(reverse("portal:keys")).content.decode()
    r = owner_client.post(reverse("portal:key_revoke", args=[key.pk]))
    assert r.status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_key_create_errors_rerender(owner_client, world):
    r = owner_client.post(reverse("portal:key_create"), {"name": "ci"})
    assert r.status_code == 400 and "name at least one scope" in r.content.decode()
    assert not ApiKey.objects.filter(name="ci").exists()


def test_invite_and_revoke(owner_client, world):
    r = owner_client.post(reverse("portal:member_invite"), {"email": "Pat@Alpha.example", "role": "viewer"})
    assert r.status_code == 302
    inv = Invitation.objects.get(email="pat@alpha.example")
    assert "pat@alpha.example" in owner_client.get(reverse("portal:members")).content.decode()
    r = owner_client.post(reverse("portal:member_invite"), {"email": "owner@alpha.example", "role": "viewer"})
    assert r.status_code == 400 and "already a member" in r.content.decode()
    owner_client.post(reverse("portal:invitation_revoke", args=[inv.pk]))
    inv.refresh_from_db()
    assert inv.revoked_at is not None


def test_deploy_form_and_remove(owner_client, world, tiers, sim_dir):
    a = make_alloc(world["a"], tiers["3g"])
    form = {"allocation": a.pk, "name": "tg", "template": "tiny-gen"}
    r = owner_client.post(reverse("portal:deployment_create"), form)
    dep = ModelDeployment.objects.get(name="tg")
    assert r.status_code == 302 and r["Location"] == reverse("portal:deployment", args=[dep.pk])
    assert 'hx-trigger="every 1s"' in owner_client.get(r["Location"]).content.decode()  # pending: refreshes
    r = owner_client.post(reverse("portal:deployment_create"), form)
    assert r.status_code == 400 and "already deployed" in r.content.decode()
    owner_client.post(reverse("portal:deployment_remove", args=[dep.pk]))
    dep.refresh_from_db()
    assert dep.state == "unloading"


def test_slice_status_fragment_stops_polling_when_active(owner_client, world, tiers):
    a = make_alloc(world["a"], tiers["1g"], state="provisioning")
    assert 'hx-trigger="every 1s"' in owner_client.get(reverse("portal:slice_status", args=[a.pk])).content.decode()
    Allocation.objects.filter(pk=a.pk).update(state="active")
    r = owner_client.get(reverse("portal:slice_status", args=[a.pk]), HTTP_HX_REQUEST="true")
    assert 'hx-trigger' not in r.content.decode() and r["HX-Refresh"] == "true"


def test_tenant_switch(client, world, members_a):
    user = members_a[Role.OWNER]
    MembershipFactory(user=user, tenant=world["b"], role=Role.VIEWER)
    client.force_login(user)
    assert "Alpha" in client.get(reverse("portal:home")).context["tenant"].name
    assert client.get(reverse("portal:home") + "?tenant=bravo").context["tenant"].slug == "bravo"
    assert client.get(reverse("portal:keys")).context["tenant"].slug == "bravo"  # remembered in the session
    assert client.get(reverse("portal:home") + "?tenant=nope").context["tenant"].slug == "bravo"


def test_usage_page_with_rows(owner_client, world, tiers):
    from telemetry.models import UsageHourly

    a = make_alloc(world["a"], tiers["1g"])
    dep = make_dep(a)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    UsageHourly.objects.create(tenant=world["a"], deployment=dep, hour=hour, input_tokens=1234, output_tokens=55,
                               requests=7, events=7)
    r = owner_client.get(reverse("portal:usage"))
    assert r.status_code == 200 and r.context["chart"]["figure"]["data"]
    assert "1,234" in r.content.decode() and "plotly.min.js" in r.content.decode()


def _fill(kind, tenant, tiers, n, start):
    for i in range(start, start + n):
        if kind == "slices":
            make_dep(make_alloc(tenant, tiers["1g"]), name=f"m{i}")
        elif kind == "invoices":
            Invoice.objects.create(tenant=tenant, period_start=f"{2000 + i}-01-01", period_end=f"{2000 + i}-02-01",
                                   currency="USD")
        elif kind == "keys":
            make_key(tenant, name=f"k{i}")
        elif kind == "members":
            MembershipFactory(tenant=tenant, role=Role.MEMBER)
        elif kind == "deployments":
            make_dep(make_alloc(tenant, tiers["1g"]), name=f"d{i}")


@pytest.mark.parametrize("kind", ["slices", "invoices", "keys", "members", "deployments"])
def test_list_query_count_does_not_grow(owner_client, world, tiers, kind):
    url = reverse(f"portal:{kind}")
    _fill(kind, world["a"], tiers, 2, 0)
    owner_client.get(url)  # warm the session
    with CaptureQueriesContext(connection) as few:
        assert owner_client.get(url).status_code == 200
    _fill(kind, world["a"], tiers, 10, 2)
    with CaptureQueriesContext(connection) as many:
        r = owner_client.get(url)
    assert r.context["table"].total >= 12
    assert len(many) == len(few), [q["sql"] for q in many.captured_queries]


def test_release_from_slice_page(owner_client, world, tiers, h100_node):
    p = principal_for_user(Membership.objects.get(tenant=world["a"], role=Role.OWNER).user)
    a = orders.create_order(p, tenant=world["a"], tier=tiers["1g"]).allocations.get()
    Allocation.objects.filter(pk=a.pk).update(state="active")
    r = owner_client.post(reverse("portal:slice_release", args=[a.pk]))
    assert r.status_code == 302
    a.refresh_from_db()
    assert a.state == "releasing"


def test_members_role_change_and_removal(as_user, world, members_a):
    from tenants.models import Membership

    viewer = Membership.objects.get(user=members_a["viewer"])
    admin = as_user(members_a["admin"])
    r = admin.post(f"/portal/members/{viewer.pk}/role/", {"role": "member"}, format="multipart")
    assert r.status_code == 302 and Membership.objects.get(pk=viewer.pk).role == "member"
    # an admin cannot grant owner; the row is unchanged
    r = admin.post(f"/portal/members/{viewer.pk}/role/", {"role": "owner"}, format="multipart")
    assert r.status_code == 403 and Membership.objects.get(pk=viewer.pk).role == "member"
    # the last owner cannot be demoted: a clear message, nothing changed
    owner_m = Membership.objects.get(user=members_a["owner"])
    r = as_user(members_a["owner"]).post(f"/portal/members/{owner_m.pk}/role/", {"role": "viewer"}, format="multipart",
                                             follow=True)
    assert "at least one owner" in r.content.decode() and Membership.objects.get(pk=owner_m.pk).role == "owner"
    # another tenant's member is a 404
    foreign = Membership.objects.get(user=world["owner_b"])
    assert admin.post(f"/portal/members/{foreign.pk}/remove/").status_code == 404
    assert admin.post(f"/portal/members/{viewer.pk}/remove/").status_code == 302
    assert not Membership.objects.filter(pk=viewer.pk).exists()
    # a member may leave, but not remove others
    member = as_user(members_a["member"])
    billing_m = Membership.objects.get(user=members_a["billing"])
    assert member.post(f"/portal/members/{billing_m.pk}/remove/").status_code == 403
    me = Membership.objects.get(user=members_a["member"])
    assert member.post(f"/portal/members/{me.pk}/remove/").status_code == 302
    assert not Membership.objects.filter(pk=me.pk).exists()
