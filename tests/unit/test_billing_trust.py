"""Billing holes found in use (issue 14): the currency is the operator's and an invoice is rated in its
own; usage with no price is an alert that blocks finalization; every used month gets an invoice; the
beat handles each tenant on its own; reads never write; deadlocks are retried, not outages."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from unittest import mock

import pytest
from django.db import OperationalError

from marketplace.models import Allocation, BillingAlert, Invoice, InvoiceLine, PricePlan
from marketplace.services import billing, dbretry
from telemetry.models import UsageHourly
from tenants.roles import Role
from tests.billing_reference import rate_all
from tests.factories import (
    AllocationFactory,
    DeploymentFactory,
    MembershipFactory,
    OrderFactory,
    PricePlanFactory,
    TenantFactory,
    UsageHourlyFactory,
    make_key,
)

pytestmark = pytest.mark.django_db
D = Decimal
OCT = date(2026, 10, 1)
T0 = datetime(2026, 10, 1, tzinfo=UTC)
NOV5 = datetime(2026, 11, 5, tzinfo=UTC)


@pytest.fixture
def acme(catalog, tiers):
    tenant = TenantFactory(slug="acme", currency="USD")
    owner = MembershipFactory(tenant=tenant, role=Role.OWNER).user
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).update(effective_from=T0 - timedelta(days=30),
                                               price_per_slice_hour=D("2.0000"),
                                               price_per_1m_input_tokens=D("0.5000"),
                                               price_per_1m_output_tokens=D("1.5000"))
    PricePlanFactory(tier=tier, currency="GBP", effective_from=T0 - timedelta(days=30),
                     price_per_slice_hour=D("1.6000"), price_per_1m_input_tokens=D("0.4000"),
                     price_per_1m_output_tokens=D("1.2000"))
    order = OrderFactory(tenant=tenant, tier=tier)
    alloc = AllocationFactory(order=order, tenant=tenant, tier=tier, state="active", activated_at=T0,
                              released_at=T0 + timedelta(hours=10))
    dep = DeploymentFactory(allocation=alloc, tenant=tenant, name="llm", backend="python", spec={},
                            memory_mb=10, state="ready")
    return tenant, owner, tier, alloc, dep


def now_month_usage(tenant, dep, tokens=1_000_000):
    hour = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return UsageHourlyFactory(tenant=tenant, deployment=dep, hour=hour, input_tokens=tokens,
                              output_tokens=0, requests=1)


# --- currency -----------------------------------------------------------------------------------

def test_tenant_owner_cannot_change_the_billing_currency(acme, as_user):
    tenant, owner, *_ = acme
    r = as_user(owner).patch(f"/api/v1/tenants/{tenant.slug}/", {"currency": "JPY"}, format="json")
    assert r.status_code == 403, r.content
    tenant.refresh_from_db()
    assert tenant.currency == "USD"


def test_operator_currency_change_applies_from_the_next_period(acme, as_user, operator):
    tenant, _, _, _, dep = acme
    now_month_usage(tenant, dep)
    r = as_user(operator).patch(f"/api/v1/tenants/{tenant.slug}/", {"currency": "GBP"}, format="json")
    assert r.status_code == 200, r.content
    current = Invoice.objects.get(tenant=tenant, period_start=billing.month_of(datetime.now(UTC)))
    assert current.currency == "USD"  # the open month keeps its currency
    inv = billing.refresh(current)
    assert inv.total == D("0.50")  # 1 M input tokens at the USD price, not GBP's 0.40
    tenant.refresh_from_db()
    nxt = billing.draft_for(tenant, billing.next_month(current.period_start))
    assert nxt.currency == "GBP"


def test_invoice_is_rated_in_its_own_currency(acme):
    tenant, *_ = acme
    inv = billing.draft_for(tenant, OCT)
    Invoice.objects.filter(pk=inv.pk).update(currency="GBP")
    inv = billing.refresh(inv, now=NOV5)
    assert inv.total == D("16.00")  # 10 h x 1.60 GBP
    assert {li.plan.currency for li in inv.lines.select_related("plan")} == {"GBP"}


def test_usage_with_no_price_in_the_currency_alerts_and_blocks_finalization(acme):
    tenant, *_ = acme
    inv = billing.draft_for(tenant, OCT)
    Invoice.objects.filter(pk=inv.pk).update(currency="JPY")
    inv = billing.refresh(inv, now=NOV5)
    assert inv.total == D("0.00")
    a = BillingAlert.objects.get(tenant=tenant, kind="unpriced", resolved_at__isnull=True)
    assert "JPY" in a.message
    with pytest.raises(billing.FinalizeBlocked, match="no price in JPY"):
        billing.finalize(inv, now=NOV5)
    inv.refresh_from_db()
    assert inv.status == "draft" and inv.number is None
    PricePlanFactory(tier=acme[2], currency="JPY", effective_from=T0 - timedelta(days=1),
                     price_per_slice_hour=D("300"), price_per_1m_input_tokens=D("60"),
                     price_per_1m_output_tokens=D("200"))
    inv = billing.finalize(inv, now=NOV5)
    assert inv.total == D("3000.00") and inv.status == "finalized"
    assert not BillingAlert.objects.filter(tenant=tenant, kind="unpriced", resolved_at__isnull=True).exists()


# --- every used month gets an invoice -----------------------------------------------------------

def test_month_with_usage_and_no_invoice_gets_one_at_month_end(acme):
    tenant, _, _, _, dep = acme
    UsageHourlyFactory(tenant=tenant, deployment=dep, hour=T0 + timedelta(hours=2), input_tokens=2_000_000,
                       output_tokens=0, requests=1)
    assert not Invoice.objects.filter(tenant=tenant).exists()
    done = billing.finalize_due(now=NOV5)
    inv = Invoice.objects.get(tenant=tenant, period_start=OCT)
    assert inv.status == "finalized" and done == [inv.number]
    assert inv.total == D("21.00")  # 10 h x 2.00 + 2 M x 0.50
    assert UsageHourly.objects.get(tenant=tenant).billed_input_tokens == 2_000_000


def test_late_usage_of_a_finalized_month_opens_the_current_draft(acme):
    tenant, _, _, _, dep = acme
    row = UsageHourlyFactory(tenant=tenant, deployment=dep, hour=T0 + timedelta(hours=2),
                             input_tokens=1_000_000, output_tokens=0, requests=1)
    billing.finalize_due(now=NOV5)
    UsageHourly.objects.filter(pk=row.pk).update(input_tokens=3_000_000)  # late events for October
    Allocation.objects.all().update(released_at=T0 + timedelta(hours=10))
    dec = datetime(2026, 12, 3, tzinfo=UTC)
    billing.ensure_invoices(dec)
    inv = Invoice.objects.get(tenant=tenant, period_start=date(2026, 12, 1))
    inv = billing.refresh(inv, now=dec)
    assert inv.lines.get(kind="adjustment_input").quantity == D(2)


# --- the beat: one tenant at a time -------------------------------------------------------------

def test_beat_goes_on_after_a_tenant_fails_and_records_it(acme, tiers):
    tenant, _, _, _, dep = acme
    now_month_usage(tenant, dep)
    other = TenantFactory(slug="other")
    o_order = OrderFactory(tenant=other, tier=acme[2])
    o_alloc = AllocationFactory(order=o_order, tenant=other, tier=acme[2], state="active",
                                activated_at=datetime.now(UTC) - timedelta(minutes=5))
    odep = DeploymentFactory(allocation=o_alloc, tenant=other, name="m", backend="python", spec={},
                             memory_mb=10, state="ready")
    now_month_usage(other, odep, 2_000_000)
    # acme's month was finalized early (force): refreshing it would be a Conflict
    billing.finalize(billing.draft_for(tenant, billing.month_of(datetime.now(UTC))), force=True)
    real = billing.evaluate_spend

    def boom(t, now=None):
        if t.slug == "acme":
            raise RuntimeError("boom")
        return real(t, now)

    with mock.patch.object(billing.spend, "evaluate_spend", boom):
        out = rate_all()
    assert out["failed"] == ["acme"]
    assert BillingAlert.objects.get(tenant=tenant, kind="rating_failed").message.endswith("boom")
    o_inv = Invoice.objects.get(tenant=other, period_start=billing.month_of(datetime.now(UTC)))
    assert o_inv.rated_at is not None and o_inv.total >= D("1.00")  # the other tenant was rated


def test_spend_and_portal_after_an_early_finalize(acme, as_user, as_key, operator):
    tenant, owner, _, _, dep = acme
    now_month_usage(tenant, dep)
    billing.finalize(billing.draft_for(tenant, billing.month_of(datetime.now(UTC))), force=True)
    r = as_user(operator).get("/api/v1/billing/spend/")
    assert r.status_code == 200, r.content
    assert as_user(owner).get("/portal/").status_code == 200


# --- reads never write --------------------------------------------------------------------------

def test_get_spend_and_portal_do_not_write(acme, as_user, as_key, django_assert_max_num_queries):
    tenant, owner, _, _, dep = acme
    now_month_usage(tenant, dep)
    inv = billing.current_invoice(tenant)
    line_ids = set(inv.lines.values_list("pk", flat=True))
    rated_at = inv.rated_at
    _, key = make_key(tenant, ["billing:read"])
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as q:
        r = as_key(key).get("/api/v1/billing/spend/")
        assert r.status_code == 200 and r.json()["results"][0]["spend"] == "0.50"
        assert as_user(owner).get("/portal/").status_code == 200
    writes = [x["sql"] for x in q.captured_queries
              if x["sql"].lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))
              and "invoice" in x["sql"].lower()]
    assert writes == []
    inv.refresh_from_db()
    assert set(inv.lines.values_list("pk", flat=True)) == line_ids and inv.rated_at == rated_at


def test_an_order_does_not_rewrite_the_invoice(acme, h100_node, tiers):
    from marketplace.services import orders
    from tenants.scoping import principal_for_user

    tenant, owner, _, _, dep = acme
    now_month_usage(tenant, dep)
    inv = billing.current_invoice(tenant)
    ids = set(InvoiceLine.objects.filter(invoice=inv).values_list("pk", flat=True))
    orders.create_order(principal_for_user(owner), tenant=tenant, tier=tiers["1g"])
    assert set(InvoiceLine.objects.filter(invoice=inv).values_list("pk", flat=True)) == ids


# --- deadlocks ----------------------------------------------------------------------------------

class _PgError(Exception):
    def __init__(self, sqlstate):
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


def _db_error(sqlstate):
    exc = OperationalError("deadlock detected")
    exc.__cause__ = _PgError(sqlstate)
    return exc


@pytest.mark.django_db(transaction=True)
def test_finalize_retries_a_deadlock(acme):
    tenant, *_ = acme
    real = billing.rate
    calls = []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise _db_error("40P01")
        return real(*a, **kw)

    with mock.patch.object(billing.invoices, "rate", flaky), mock.patch.object(dbretry.time, "sleep"):
        inv = billing.finalize(billing.draft_for(tenant, OCT), now=NOV5)
    assert inv.status == "finalized" and len(calls) == 2 and inv.number.endswith("000001")


@pytest.mark.django_db(transaction=True)
def test_deadlock_is_never_answered_as_database_unavailable(acme, as_user, operator):
    tenant, *_ = acme
    inv = billing.draft_for(tenant, OCT)
    with mock.patch.object(billing.invoices, "rate", side_effect=_db_error("40001")), \
            mock.patch.object(dbretry.time, "sleep"):
        r = as_user(operator).post(f"/api/v1/invoices/{inv.pk}/finalize/")
    assert r.status_code == 409, r.content
    assert "unavailable" not in r.json()["detail"] and r["Retry-After"]
