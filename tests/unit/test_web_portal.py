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
    billing.current_invoice(t)  # the rating beat's work: the spend figure orders judge is the draft as rated
    r = owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "1"})
    assert r.status_code == 400 and "spend limit" in r.content.decode()
    assert Order.objects.count() == 1
    home = owner_client.get(reverse("portal:home")).content.decode()
    assert "Spend limit reached" in home and "Rated " in home


def test_a_spend_limit_of_0_refuses_orders_before_anything_is_spent(owner_client, h100_node, tiers, world):
    t = world["a"]
    t.monthly_spend_limit = 0
    t.save()
    r = owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "1"})
    assert r.status_code == 400 and "nothing may be spent" in r.content.decode()
    assert not Order.objects.exists()
    home = owner_client.get(reverse("portal:home")).content.decode()
    assert "Spend limit 0: nothing may be spent" in home and "Nothing rated this month yet" in home
    t.monthly_spend_limit = None  # no limit
    t.save()
    assert owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "1"}).status_code == 302
    assert 'id="spend-limit">none<' in owner_client.get(reverse("portal:home")).content.decode()


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


def test_service_errors_puts_a_refusal_on_its_field_and_lets_forbidden_through():
    from django import forms

    from marketplace.web.portal_forms import service_errors
    from tenants.errors import Forbidden, ServiceError

    class F(forms.Form):
        name = forms.CharField(required=False)
        expires_on = forms.DateField(required=False)

    form = F({"name": "x"})
    assert form.is_valid()
    with service_errors(form, "name") as failed:
        pass
    assert not failed and form.is_valid()
    with service_errors(form, "name", aliases={"expires_at": "expires_on"}) as failed:
        raise ServiceError("must be in the future", field="expires_at")
    assert failed and failed.text == "expires_at: must be in the future"
    assert form.errors == {"expires_on": ["must be in the future"]} and not form.is_valid()
    form = F({"name": "x"})
    form.is_valid()
    with service_errors(form, "name"):
        raise ServiceError("no capacity", field="tier")  # a field the form lacks: on the default field
    assert form.errors == {"name": ["no capacity"]}
    with pytest.raises(Forbidden), service_errors(form, "name"):
        raise Forbidden("no")
    with pytest.raises(ValueError), service_errors(form, "name"):
        raise ValueError("not a service's refusal")


def test_deploy_form_errors_are_shown_next_to_their_fields_and_nothing_is_stored(owner_client, world, tiers):
    other = make_alloc(world["b"], tiers["1g"])
    r = owner_client.post(reverse("portal:deployment_create"), {"allocation": other.pk, "name": "x",
                                                                "context": "lots"})
    body = r.content.decode()
    assert r.status_code == 400 and not ModelDeployment.objects.exists()
    assert r.context["form"].errors == {"allocation": ["choose one of your active slices"],
                                        "context": ["a whole number"]}
    assert '<span class="errorlist">a whole number</span></label>' in body
    assert 'value="lots"' in body and 'value="x"' in body  # what was typed stays
    mine = make_alloc(world["a"], tiers["1g"])
    r = owner_client.post(reverse("portal:deployment_create"), {"allocation": mine.pk, "name": "m",
                                                                "library_model": "nope"})
    assert r.status_code == 400 and r.context["form"].errors == {
        "library_model": ["choose a model of the library"]} and not ModelDeployment.objects.exists()


def test_invite_and_key_forms_validate_before_any_service_call(owner_client, world):
    n = Invitation.objects.count()
    r = owner_client.post(reverse("portal:member_invite"), {"email": "not-an-address", "role": "viewer"})
    assert r.status_code == 400 and r.context["form"].errors == {"email": ["enter an e-mail address"]}
    assert '<span class="errorlist">enter an e-mail address</span></label>' in r.content.decode()
    r = owner_client.post(reverse("portal:member_invite"), {"email": "pat@alpha.example", "role": "emperor"})
    assert r.status_code == 400 and "role" in r.context["form"].errors and Invitation.objects.count() == n
    r = owner_client.post(reverse("portal:key_create"), {"name": "ci", "scopes": ["read", "usage:write"]})
    assert r.status_code == 400 and "scopes" in r.context["form"].errors
    assert not ApiKey.objects.filter(name="ci").exists()


def test_order_quantity_is_checked_by_the_form(owner_client, h100_node, tiers):
    r = owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "many"})
    assert r.status_code == 400 and "a whole number" in r.content.decode() and not Order.objects.exists()
    r = owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "65"})
    assert r.status_code == 400 and "must be between 1 and 64" in r.content.decode() and not Order.objects.exists()


def test_every_destructive_action_asks_first_the_same_way(owner_client, world, tiers, members_a):
    """Release, key revoke, model remove, member remove/leave, role change and invitation revoke: one include
    (a form with data-confirm, which static/tessera/app.js turns into a confirm dialog)."""
    import re

    a = make_alloc(world["a"], tiers["1g"])
    dep = make_dep(a, name="chat")
    make_key(world["a"], name='ci "prod" <b>')

    def confirms(url) -> dict[str, str]:
        body = owner_client.get(url).content.decode()
        return dict(re.findall(r'<form method="post" action="([^"]+)" class="[^"]*confirm[^"]*" '
                               r'data-confirm="([^"]+)"', body))

    assert confirms(reverse("portal:slice", args=[a.pk]))[reverse("portal:slice_release", args=[a.pk])] == \
        f"Release slice #{a.pk}? Its models are removed."
    remove = reverse("portal:deployment_remove", args=[dep.pk])
    question = f"Remove chat? It is unloaded from slice #{a.pk} at once and stops answering requests."
    assert confirms(reverse("portal:deployment", args=[dep.pk]))[remove] == question
    assert confirms(reverse("portal:deployments"))[remove] == question
    keys = confirms(reverse("portal:keys"))
    assert "Revoke ci &quot;prod&quot; &lt;b&gt;? Clients using it stop working." in keys.values()  # escaped once
    members = confirms(reverse("portal:members"))
    viewer = Membership.objects.get(user=members_a[Role.VIEWER])
    me = Membership.objects.get(user=members_a[Role.OWNER])
    inv = Invitation.objects.get(tenant=world["a"])
    assert members[reverse("portal:member_remove", args=[viewer.pk])] == \
        f"Remove {viewer.user.email} from Alpha? They lose access at once."
    assert members[reverse("portal:member_remove", args=[me.pk])].startswith("Leave Alpha? You lose access")
    assert members[reverse("portal:member_role", args=[viewer.pk])] == \
        f"Change the role of {viewer.user.email}? Their access changes at once."
    assert members[reverse("portal:invitation_revoke", args=[inv.pk])] == \
        f"Revoke the invitation for {inv.email}? Its link stops working."


def test_a_suspended_tenant_is_told_why_not_blamed_on_its_role(owner_client, world, operator):
    from tenants import services as tenant_services
    from tenants.scoping import principal_for_user as pfu

    tenant_services.suspend_tenant(pfu(operator), world["a"], reason="invoice 2026-0042 is 30 days overdue")
    for name in ("home", "catalog", "keys"):
        body = owner_client.get(reverse(f"portal:{name}")).content.decode()
        assert 'id="suspended-notice"' in body and "invoice 2026-0042 is 30 days overdue" in body, name
        assert "Your role (owner)" not in body, name
    assert "Ordering is paused while Alpha is suspended" in owner_client.get(reverse("portal:catalog")).content.decode()
    tenant_services.activate_tenant(pfu(operator), world["a"])
    body = owner_client.get(reverse("portal:catalog")).content.decode()
    assert "suspended-notice" not in body and "cannot-order" not in body


def test_key_expiry_is_set_in_the_portal_and_the_new_key_has_a_copy_button(owner_client, world):
    from datetime import UTC, datetime

    day = (timezone.now() + timedelta(days=30)).date()
    r = owner_client.post(reverse("portal:key_create"), {"name": "ci", "scopes": ["read"],
                                                         "expires_on": day.isoformat()})
    assert r.status_code == 200
    key = ApiKey.objects.get(name="ci")
    assert key.expires_at == datetime(day.year, day.month, day.day, tzinfo=UTC)
    body = r.content.decode()
    assert 'data-copy="#key-secret"' in body and "tessera/copy.js" in body
    assert f'id="key-expires">{day:%Y-%m-%d} 00:00 UTC<' in body
    assert "onclick" not in body  # the CSP forbids inline handlers: the button works from a static file
    assert f"expires {day:%Y-%m-%d} 00:00 UTC" in owner_client.get(reverse("portal:keys")).content.decode()
    today = timezone.now().date()
    r = owner_client.post(reverse("portal:key_create"), {"name": "old", "scopes": ["read"],
                                                         "expires_on": today.isoformat()})
    assert r.status_code == 400 and r.context["form"].errors == {"expires_on": ["must be a day after today"]}
    assert not ApiKey.objects.filter(name="old").exists()


def test_reserved_plans_are_orderable_with_a_monthly_estimate(owner_client, h100_node, tiers, world):
    import calendar
    from decimal import Decimal

    from marketplace.models import PricePlan

    PricePlan.objects.create(tier=tiers["3g"], kind="reserved", currency="USD", price_per_slice_hour=Decimal("2.0000"),
                             price_per_1m_input_tokens=Decimal("0.08"), price_per_1m_output_tokens=Decimal("0.30"),
                             monthly_commit=Decimal("2000.00"), effective_from=timezone.now() - timedelta(days=1))
    r = owner_client.get(reverse("portal:catalog"))
    row = {row["tier"].key: row for row in r.context["rows"]}
    assert row["h100-1g"]["reserved"] is None and row["h100-1g"]["estimate"] is None
    today = timezone.now().date()
    nxt = (today.replace(day=28) + timedelta(days=5)).replace(day=1)
    hours = calendar.monthrange(nxt.year, nxt.month)[1] * 24
    est = row["h100-3g"]["estimate"]
    # one slice all month: 2.00 x 744 h = 1,488.00 < 2,000.00 committed, so the month is topped up to 2,000.00
    assert (est["hours"], est["slice_hours"], est["total"]) == (hours, Decimal(2 * hours).quantize(Decimal("0.01")),
                                                                Decimal("2000.00"))
    assert est["top_up"] == Decimal("2000.00") - est["slice_hours"]
    # two slices held at once owe one commitment, which their slice-hours now exceed: no top-up
    from marketplace.selectors.billing import plan_month_estimate

    two = plan_month_estimate(PricePlan.objects.get(tier=tiers["3g"], kind="reserved"), slices=2, month=nxt)
    assert (two["slice_hours"], two["top_up"]) == (Decimal(4 * hours).quantize(Decimal("0.01")), 0)
    body = r.content.decode()
    assert 'id="reserved-h100-3g"' in body and "2,000.00 USD" in body and '<option value="reserved">' in body
    # a hostile form: another tenant, a currency and a price of its own: none of them is taken
    r = owner_client.post(reverse("portal:order", args=[tiers["3g"].pk]), {
        "quantity": "1", "plan_kind": "reserved", "tenant": world["b"].pk, "currency": "EUR",
        "price_per_slice_hour": "0.0001", "monthly_commit": "0"})
    assert r.status_code == 302
    assert Order.objects.get(tenant=world["a"]).plan_kind == "reserved"
    assert not Order.objects.filter(tenant=world["b"]).exists()
    world["a"].refresh_from_db()
    assert world["a"].currency == "USD"
    plan = PricePlan.objects.get(tier=tiers["3g"], kind="reserved")
    assert (plan.price_per_slice_hour, plan.monthly_commit) == (Decimal("2.0000"), Decimal("2000.00"))
    r = owner_client.post(reverse("portal:order", args=[tiers["1g"].pk]), {"quantity": "1", "plan_kind": "reserved"})
    assert r.status_code == 400 and "has no reserved price in USD" in r.content.decode()
    assert Order.objects.count() == 1


def test_usage_by_hour_for_a_day_partial_days_marked_and_per_model_and_slice(owner_client, world, tiers):
    from telemetry.models import UsageHourly

    a1, a2 = make_alloc(world["a"], tiers["1g"]), make_alloc(world["a"], tiers["3g"])
    chat, code = make_dep(a1, name="chat"), make_dep(a2, name="code")
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    for h, dep, tokens in [(0, chat, 1000), (2, chat, 2000), (2, code, 500), (30, code, 7000), (168, code, 5)]:
        UsageHourly.objects.create(tenant=world["a"], deployment=dep, hour=hour - timedelta(hours=h),
                                   input_tokens=tokens, output_tokens=10, requests=3, events=3)
    r = owner_client.get(reverse("portal:usage"), {"days": "1"})
    assert r.context["bucket"] == "hour"
    rows = r.context["rows"]
    assert [x["hour"] for x in rows] == [hour, hour - timedelta(hours=2)]  # by hour; 30 h ago is outside the day
    assert rows[0]["partial"] == f"to {now:%H:%M}, so far" and "partial" not in rows[1]
    assert [(x["model"], x["allocation"], x["tier"], x["input_tokens"]) for x in r.context["per_model"]] == [
        ("chat", a1.pk, "h100-1g", 3000), ("code", a2.pk, "h100-3g", 500)]
    body = r.content.decode()
    assert "Hour (UTC)" in body and 'id="usage-by-model"' in body and "3,000" in body
    assert r.context["chart"] is not None and "partial: to" in body
    r = owner_client.get(reverse("portal:usage"), {"days": "7"})
    rows = r.context["rows"]
    assert r.context["bucket"] == "day" and rows[0]["partial"].endswith("so far")
    first = r.context["start"]
    assert first == hour - timedelta(days=7)  # from the hour a week ago
    if first.hour:  # the week's first day is covered from that hour on
        assert rows[-1]["day"] < first and rows[-1]["partial"] == f"from {first:%H:%M}"
    assert [x["input_tokens"] for x in r.context["per_model"]] == [7505, 3000]  # code, then chat


def test_a_deployed_lora_adapter_is_named_with_how_to_call_it(owner_client, world, tiers):
    """Adapters served with a model are listed on the models page and on the model's page, each with the exact model
    name to call and copy-paste examples (with copy buttons) that use it."""
    from marketplace.models import LibraryModel, LoraAdapter

    dep = make_dep(make_alloc(world["a"], tiers["1g"]), name="llama-base")
    base = LibraryModel.objects.first()
    for name in ("sql-assistant", "support-bot"):
        dep.adapters.add(LoraAdapter.objects.create(tenant=world["a"], name=name, base=base, source="upload", rank=8,
                                                    size_bytes=1, file_count=2, path=f"alpha/{name}",
                                                    state="ready"))
    listing = owner_client.get(reverse("portal:deployments")).content.decode()
    assert "LoRA: <code>sql-assistant</code>, <code>support-bot</code>" in listing
    page = owner_client.get(reverse("portal:deployment", args=[dep.pk])).content.decode()
    assert 'id="adapters"' in page and '<code class="adapter-name">sql-assistant</code>' in page
    assert '&quot;model&quot;: &quot;sql-assistant&quot;' in page  # its curl example calls it by its name
    assert 'model=&quot;support-bot&quot;' in page  # and its openai one
    assert page.count('data-copy="#example-') >= 7  # the model's three examples and two for each adapter
    assert "tessera/copy.js" in page
