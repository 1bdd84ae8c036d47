"""Scopes and inputs (issue 14): a usage-only key reads no prices, a billing:read key cannot re-rate an
invoice, and a field a client may not set is a 400 naming it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from marketplace.services import billing
from tenants.models import ApiKey, Tenant
from tenants.roles import Role
from tests.factories import make_key

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("url", ["/api/v1/tiers/", "/api/v1/price-plans/", "/api/v1/catalog/gpu-models/"])
def test_a_usage_write_only_key_reads_no_tiers_or_prices(world, tiers, as_key, url):
    _, usage_only = make_key(world["a"], ["usage:write"])
    assert as_key(usage_only).get(url).status_code == 403
    _, reader = make_key(world["a"], ["read"])
    assert as_key(reader).get(url).status_code == 200


def test_a_billing_read_key_cannot_refresh_an_invoice(world, members_a, as_key, as_user):
    inv = billing.draft_for(world["a"], billing.month_of(datetime.now(UTC)))
    _, key = make_key(world["a"], ["billing:read"])
    assert as_key(key).get(f"/api/v1/invoices/{inv.pk}/").status_code == 200
    assert as_key(key).post(f"/api/v1/invoices/{inv.pk}/refresh/").status_code == 403
    _, both = make_key(world["a"], ["read", "billing:read"])
    assert as_key(both).post(f"/api/v1/invoices/{inv.pk}/refresh/").status_code == 403
    inv.refresh_from_db()
    assert inv.rated_at is None
    r = as_user(members_a[Role.BILLING]).post(f"/api/v1/invoices/{inv.pk}/refresh/")
    assert r.status_code == 200, r.content


def test_patch_tenant_names_read_only_and_unknown_fields(world, members_a, as_user):
    api = as_user(members_a[Role.OWNER])
    r = api.patch("/api/v1/tenants/alpha/", {"slug": "hijack", "name": "New"}, format="json")
    assert r.status_code == 400 and "slug" in r.json() and "name" not in r.json()
    r = api.patch("/api/v1/tenants/alpha/", {"colour": "red"}, format="json")
    assert r.status_code == 400 and "colour" in r.json()
    t = Tenant.objects.get(pk=world["a"].pk)
    assert (t.slug, t.name) == ("alpha", "Alpha")
    assert api.patch("/api/v1/tenants/alpha/", {"name": "New"}, format="json").status_code == 200


def test_creating_a_key_with_a_read_only_field_is_refused(world, members_a, as_user):
    r = as_user(members_a[Role.OWNER]).post("/api/v1/api-keys/", {"tenant": "alpha", "name": "k", "scopes": ["read"],
                                                                  "prefix": "mine"}, format="json")
    assert r.status_code == 400 and "prefix" in r.json()
    assert not ApiKey.objects.filter(name="k").exists()


def test_a_usage_batch_with_an_unknown_top_level_field_is_refused(world, as_key, usage_key):
    r = as_key(usage_key).post("/api/v1/usage/events/", {"tenant": "alpha", "events": [], "billed": True},
                               format="json")
    assert r.status_code == 400 and "billed" in r.json()
