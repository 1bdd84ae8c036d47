"""Rating and invoices: totals equal the sum of lines and of the rated usage, each hour at its own
price, finalized invoices never change, late usage becomes the next invoice's adjustment, spend
limits warn and block, webhooks are signed and retried."""

from __future__ import annotations

import http.server
import json
import threading
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.models import (
    Allocation,
    PricePlan,
    SpendNotice,
    WebhookDelivery,
    WebhookEndpoint,
)
from marketplace.services import billing, orders, webhooks
from telemetry.models import UsageHourly
from tenants.errors import Conflict, ServiceError
from tenants.roles import Role
from tenants.scoping import principal_for_user
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
OCT = date(2026, 10, 1)
T0 = datetime(2026, 10, 1, tzinfo=UTC)
NOV5 = datetime(2026, 11, 5, tzinfo=UTC)
D = Decimal


@pytest.fixture
def setup(catalog, tiers):
    tenant = TenantFactory(slug="acme")
    owner = MembershipFactory(tenant=tenant, role=Role.OWNER).user
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).update(effective_from=T0 - timedelta(days=30),
                                               price_per_slice_hour=D("2.0000"),
                                               price_per_1m_input_tokens=D("0.5000"),
                                               price_per_1m_output_tokens=D("1.5000"))
    order = OrderFactory(tenant=tenant, tier=tier)

    def allocation(active_from, released=None):
        return AllocationFactory(order=order, tenant=tenant, tier=tier, state="active",
                                 activated_at=active_from, released_at=released)

    def deployment(alloc, name="llm"):
        return DeploymentFactory(allocation=alloc, tenant=tenant, name=name, backend="python",
                                 spec={}, memory_mb=10, state="ready")

    return tenant, owner, tier, allocation, deployment


def usage(tenant, dep, hour, i, o, req=1):
    return UsageHourlyFactory(tenant=tenant, deployment=dep, hour=hour, input_tokens=i, output_tokens=o,
                              requests=req)


def test_total_is_sum_of_lines_and_of_rated_usage(setup):
    tenant, _, tier, allocation, deployment = setup
    a1 = allocation(T0 + timedelta(days=2, hours=3), T0 + timedelta(days=4, hours=3, minutes=30))  # 48.5 h
    allocation(T0 + timedelta(days=30, hours=20))  # still active at month end: 4 h in October
    dep = deployment(a1)
    usage(tenant, dep, T0 + timedelta(days=2, hours=5), 1_200_000, 300_000)
    usage(tenant, dep, T0 + timedelta(days=3, hours=1), 800_000, 700_000)
    usage(tenant, dep, datetime(2026, 11, 1, 1, tzinfo=UTC), 9_999_999, 9_999_999)  # November: not here
    inv = billing.refresh(billing.draft_for(tenant, OCT), now=NOV5)
    lines = list(inv.lines.all())
    assert inv.total == sum(line.amount for line in lines)
    expected = D("52.5") * D(2) + D("2.0") * D("0.5") + D("1.0") * D("1.5")  # hours, M input, M output
    assert inv.total == expected.quantize(D("0.01"))
    hours = next(line for line in lines if line.kind == "slice_hours")
    assert hours.quantity == D("52.5") and hours.unit_price == D("2.0000")


def test_mid_month_price_change_rates_each_hour_with_its_own_price(setup):
    tenant, _, tier, allocation, deployment = setup
    change = T0 + timedelta(days=15, hours=12)
    PricePlanFactory(tier=tier, currency="USD", effective_from=change, price_per_slice_hour=D("3.0000"),
                     price_per_1m_input_tokens=D("0.2500"), price_per_1m_output_tokens=D("1.0000"))
    a = allocation(change - timedelta(hours=10), change + timedelta(hours=6))
    dep = deployment(a)
    usage(tenant, dep, change - timedelta(hours=1), 2_000_000, 1_000_000)  # old price
    usage(tenant, dep, change, 4_000_000, 2_000_000)  # new price from this hour
    inv = billing.refresh(billing.draft_for(tenant, OCT), now=NOV5)
    by = {(line.kind, line.unit_price): line for line in inv.lines.all()}
    assert by[("slice_hours", D("2.0000"))].quantity == D(10)
    assert by[("slice_hours", D("3.0000"))].quantity == D(6)
    assert by[("input_tokens", D("0.5000"))].quantity == D(2)
    assert by[("input_tokens", D("0.2500"))].quantity == D(4)
    assert by[("output_tokens", D("1.5000"))].quantity == D(1)
    assert by[("output_tokens", D("1.0000"))].quantity == D(2)
    assert inv.total == D(10 * 2 + 6 * 3) + D("1.0") + D("1.0") + D("1.5") + D("2.0")


def test_finalize_numbers_freezes_and_late_usage_goes_to_next_invoice(setup):
    tenant, _, tier, allocation, deployment = setup
    a = allocation(T0, T0 + timedelta(hours=10))
    dep = deployment(a)
    row = usage(tenant, dep, T0 + timedelta(hours=2), 1_000_000, 1_000_000)
    with pytest.raises(ServiceError, match="still open"):
        billing.finalize(billing.draft_for(tenant, OCT), now=T0 + timedelta(days=3))
    inv = billing.finalize(billing.draft_for(tenant, OCT), now=NOV5)
    assert inv.status == "finalized" and inv.number.startswith("TSR-2026-")
    frozen = (inv.total, list(inv.lines.values_list("amount", flat=True)))
    row.refresh_from_db()
    assert row.billed_input_tokens == 1_000_000
    with pytest.raises(Conflict):
        billing.refresh(inv)
    with pytest.raises(Conflict):
        billing.finalize(inv, now=NOV5)
    # a late event for a finalized hour: counted in the rollup, charged next month as an adjustment
    UsageHourly.objects.filter(pk=row.pk).update(input_tokens=3_000_000)
    nov = billing.refresh(billing.draft_for(tenant, date(2026, 11, 1)), now=NOV5)
    adj = nov.lines.get(kind="adjustment_input")
    assert adj.quantity == D(2) and adj.unit_price == D("0.5000") and "late" in adj.description
    inv.refresh_from_db()
    assert (inv.total, list(inv.lines.values_list("amount", flat=True))) == frozen
    nov = billing.finalize(nov, now=datetime(2026, 12, 2, tzinfo=UTC))
    assert nov.number > inv.number
    row.refresh_from_db()
    assert row.billed_input_tokens == 3_000_000  # billed once, never again
    dec = billing.refresh(billing.draft_for(tenant, date(2026, 12, 1)), now=datetime(2026, 12, 2, tzinfo=UTC))
    assert not dec.lines.filter(kind__startswith="adjustment").exists()


def test_earlier_drafts_are_finalized_first(setup):
    tenant, *_ = setup
    billing.draft_for(tenant, OCT)
    with pytest.raises(Conflict, match="earlier"):
        billing.finalize(billing.draft_for(tenant, date(2026, 11, 1)), now=datetime(2026, 12, 2, tzinfo=UTC))


def test_spend_limit_warns_then_blocks_orders(setup, h100_node, tiers):
    """Orders judge the one spend figure (the month's invoice as last rated), not a rating of their own: the
    beat's rating moves it, and the refusal says how fresh it is."""
    tenant, owner, tier, allocation, deployment = setup
    tenant.monthly_spend_limit = D("100.00")
    tenant.save()
    month_start = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    dep = deployment(allocation(None))  # no slice-hours: the spend is the tokens alone
    row = usage(tenant, dep, month_start, 164_000_000, 0)  # 164 M x 0.50 = 82.00: past 80%
    billing.ensure_invoices(tenant=tenant)
    assert billing.rate_tenant(tenant) == ["warn"]  # the rating beat: re-rate the draft, then judge it
    assert billing.rate_tenant(tenant) == []  # once per month
    p = principal_for_user(owner)
    orders.create_order(p, tenant=tenant, tier=tiers["1g"])  # still allowed
    UsageHourly.objects.filter(pk=row.pk).update(input_tokens=204_000_000)  # 102.00, not rated yet
    orders.create_order(p, tenant=tenant, tier=tiers["1g"])  # the figure is still 82.00 (as rated)
    assert billing.rate_tenant(tenant) == ["block"]
    with pytest.raises(billing.SpendLimitReached, match=r"spend limit is reached \(102.00 of 100.00 USD, as rated at "):
        orders.create_order(p, tenant=tenant, tier=tiers["1g"])
    assert set(SpendNotice.objects.values_list("level", flat=True)) == {"warn", "block"}
    assert Allocation.objects.filter(tier=tiers["1g"]).count() == 2


class _Receiver(http.server.BaseHTTPRequestHandler):
    responses: list[int] = []
    seen: list[tuple[dict, bytes]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append((dict(self.headers), body))
        self.send_response(type(self).responses.pop(0) if type(self).responses else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver(settings):
    settings.TESSERA_WEBHOOK_ALLOW_NETWORKS = ["127.0.0.1/32"]  # the test receiver is on loopback
    _Receiver.responses, _Receiver.seen = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", _Receiver
    server.shutdown()


def test_webhook_signed_retried_and_logged(setup, receiver, operator, django_capture_on_commit_callbacks):
    tenant, owner, tier, allocation, deployment = setup
    url, rx = receiver
    ep = webhooks.create_endpoint(principal_for_user(owner), tenant=tenant, url=url, events=["invoice.finalized"])
    allocation(T0, T0 + timedelta(hours=1))
    with django_capture_on_commit_callbacks(execute=False):
        inv = billing.finalize(billing.draft_for(tenant, OCT), now=NOV5)
    d = WebhookDelivery.objects.get(endpoint=ep)
    assert d.event == "invoice.finalized" and d.payload["data"]["number"] == inv.number
    rx.responses = [500]
    assert webhooks.deliver(d.pk) == "pending"
    d.refresh_from_db()
    assert d.status == "pending" and d.attempts == 1 and d.last_status_code == 500
    assert d.next_attempt_at > timezone.now() and webhooks.deliver(d.pk) == "not due"  # the retry is not due yet
    WebhookDelivery.objects.filter(pk=d.pk).update(next_attempt_at=timezone.now())  # ... now it is
    assert webhooks.deliver(d.pk) == "delivered"
    d.refresh_from_db()
    assert d.attempts == 2 and d.delivered_at
    headers, body = rx.seen[-1]
    assert webhooks.verify(ep.secret, body, headers["X-Tessera-Signature"])
    assert not webhooks.verify("wrong", body, headers["X-Tessera-Signature"])
    assert json.loads(body)["data"]["total"] == str(inv.total)
    # a second finalize event for the same invoice cannot be queued twice
    assert webhooks.emit(tenant, "invoice.finalized", f"invoice:{inv.pk}", {}) == []


def test_webhook_gives_up_after_final_attempt(setup, operator, settings):
    settings.TESSERA_WEBHOOK_MAX_ATTEMPTS = 1
    tenant, *_ = setup
    ep = WebhookEndpoint.objects.create(tenant=None, url="http://127.0.0.1:9/none", secret="s",
                                        events=["spend_limit.reached"])
    d = WebhookDelivery.objects.create(endpoint=ep, event="spend_limit.reached", event_key="k", payload={})
    assert webhooks.deliver(d.pk) == "failed"
    d.refresh_from_db()
    assert d.status == "failed" and d.last_error


def test_invoice_api_csv_json_and_isolation(setup, as_key, as_user, operator, world):
    tenant, owner, tier, allocation, deployment = setup
    allocation(T0, T0 + timedelta(hours=3))
    inv = billing.finalize(billing.draft_for(tenant, OCT), now=NOV5)
    _, billing_key = make_key(tenant, ["billing:read"])
    api = as_key(billing_key)
    r = api.get("/api/v1/invoices/")
    assert r.status_code == 200 and r.json()["results"][0]["number"] == inv.number
    detail = api.get(f"/api/v1/invoices/{inv.pk}/").json()
    assert D(detail["total"]) == sum(D(li["amount"]) for li in detail["lines"])
    csv = api.get(f"/api/v1/invoices/{inv.pk}/export/?format=csv")
    assert csv.status_code == 200 and csv["Content-Type"].startswith("text/csv")
    text = csv.content.decode()
    assert inv.number in text and "slice_hours" in text and text.strip().splitlines()[-1].startswith("total")
    js = api.get(f"/api/v1/invoices/{inv.pk}/export/?format=json").json()
    assert js["number"] == inv.number and js["total"] == str(inv.total)
    _, read_only = make_key(tenant, ["read"])
    assert as_key(read_only).get("/api/v1/invoices/").status_code == 403
    other = as_key(world["secret_a"])  # alpha's key (has billing:read)
    assert other.get(f"/api/v1/invoices/{inv.pk}/").status_code == 404
    assert other.get(f"/api/v1/invoices/{inv.pk}/export/?format=csv").status_code == 404
    assert as_user(operator).get("/api/v1/invoices/").json()["count"] >= 1


def test_usage_summary_api_groups_and_isolates(setup, as_key, world):
    tenant, owner, tier, allocation, deployment = setup
    dep = deployment(allocation(T0))
    usage(tenant, dep, T0 + timedelta(hours=1), 100, 10, 2)
    usage(tenant, dep, T0 + timedelta(days=1, hours=1), 300, 30, 3)
    _, key = make_key(tenant, ["billing:read"])
    api = as_key(key)
    r = api.get("/api/v1/billing/usage/", {"start": "2026-10-01T00:00:00Z", "end": "2026-11-01T00:00:00Z",
                                            "group_by": "day"})
    assert r.status_code == 200, r.content
    rows = r.json()["results"]
    assert [(x["input_tokens"], x["requests"]) for x in rows] == [(100, 2), (300, 3)]
    r = api.get("/api/v1/billing/usage/", {"start": "2026-10-01T00:00:00Z", "end": "2026-11-01T00:00:00Z",
                                            "group_by": "tier"})
    assert r.json()["results"][0]["output_tokens"] == 40
    assert api.get("/api/v1/billing/usage/", {"group_by": "planet"}).status_code == 400
    assert api.get("/api/v1/billing/usage/", {"start": "2026-11-01T00:00:00Z",
                                              "end": "2026-10-01T00:00:00Z"}).status_code == 400
    other = as_key(world["secret_a"]).get("/api/v1/billing/usage/", {"start": "2026-10-01T00:00:00Z",
                                                                      "end": "2026-11-01T00:00:00Z"})
    assert other.status_code == 200 and other.json()["results"] == []
