"""The operator console: access, pages, actions, and query counts independent of the row count."""

from __future__ import annotations

from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from marketplace.models import Allocation, DriftEvent, Invoice, Order, PricePlan
from marketplace.services import allocations as alloc_svc
from marketplace.services import orders
from tenants.models import Tenant
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import InvoiceFactory, InvoiceLineFactory, TenantFactory
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db

PAGES = ["overview", "nodes", "allocations", "allocation_drift", "tenants", "tiers", "invoices", "deployments",
         "charts", "tenant_create", "tier_create", "node_create", "audit"]


@pytest.fixture
def op_client(client, operator):
    client.force_login(operator)
    return client


@pytest.fixture
def placed(h100_node, tiers, world, operator):
    """Two placed allocations of tenant A (on_commit provisioning does not run in these tests)."""
    order = orders.create_order(principal_for_user(operator), tenant=world["a"], tier=tiers["1g"], quantity=2)
    return list(order.allocations.order_by("pk"))


def _add_rows(n: int, tiers, node) -> None:
    """n tenants, each with an order, an allocation, an invoice and a drift event."""
    today = timezone.now().date().replace(day=1)
    for i in range(n):
        t = TenantFactory(monthly_spend_limit=Decimal("100") if i % 2 else None)
        order = Order.objects.create(tenant=t, tier=tiers["1g"])
        a = Allocation.objects.create(order=order, tenant=t, tier=tiers["1g"], node=node,
                                      state="failed" if i % 3 == 0 else "active", failure_reason="x")
        Invoice.objects.create(tenant=t, period_start=today, period_end=(today + timedelta(days=32)).replace(day=1),
                               currency="USD", total=Decimal(90 + i))
        DriftEvent.objects.create(node=node, kind="error", detail="d", allocation=a, resolved=False)


# --- access -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PAGES)
def test_pages_for_operator_tenant_and_anonymous(client, operator, members_a, tiers, name):
    url = reverse(f"console:{name}")
    resp = client.get(url)
    assert resp.status_code == 302 and resp["Location"].startswith("/login/")
    client.force_login(members_a[Role.OWNER])
    assert client.get(url).status_code == 403
    client.force_login(operator)
    resp = client.get(url)
    assert resp.status_code == 200
    assert b"MSP console" in resp.content


def test_detail_pages(op_client, placed, world, tiers):
    a = placed[0]
    inv = Invoice.objects.create(tenant=world["a"], period_start=date(2024, 1, 1), period_end=date(2024, 2, 1),
                                 currency="USD")
    for url in [reverse("console:allocation_detail", args=[a.pk]), reverse("console:tenant_detail",
                                                                            args=[world["a"].pk]),
                reverse("console:tier_detail", args=[tiers["1g"].pk]),
                reverse("console:invoice_detail", args=[inv.pk])]:
        assert op_client.get(url).status_code == 200, url
    assert op_client.get(reverse("console:allocation_detail", args=[999999])).status_code == 404


def test_tenant_user_cannot_post_actions(client, members_a, placed, world):
    client.force_login(members_a[Role.OWNER])
    assert client.post(reverse("console:allocation_release", args=[placed[0].pk])).status_code == 403
    assert client.post(reverse("console:tenant_suspend", args=[world["a"].pk])).status_code == 403
    placed[0].refresh_from_db()
    assert placed[0].state == "placed"


def test_actions_are_post_only(op_client, placed, world):
    assert op_client.get(reverse("console:allocation_release", args=[placed[0].pk])).status_code == 405
    assert op_client.get(reverse("console:tenant_suspend", args=[world["a"].pk])).status_code == 405


# --- pages show what they should ------------------------------------------------------------------

def test_nodes_page_shows_slot_map(op_client, placed):
    resp = op_client.get(reverse("console:nodes"))
    html = resp.content.decode()
    assert "node-a" in html
    assert html.count('class="slotmap"') == 8
    assert "alpha" in html and "1g.10gb" in html


def test_allocation_filters_and_sort(op_client, placed, world, tiers):
    other = orders.create_order(principal_for_user(world["owner_b"]), tenant=world["b"], tier=tiers["3g"])
    b_alloc = other.allocations.get()
    url = reverse("console:allocations")
    html = op_client.get(url, {"tenant": "bravo"}).content.decode()
    assert f"#{b_alloc.pk}<" in html and f"#{placed[0].pk}<" not in html
    html = op_client.get(url, {"tier": "h100-1g", "state": "placed", "node": "node-a"}).content.decode()
    assert f"#{placed[0].pk}<" in html and f"#{b_alloc.pk}<" not in html
    html = op_client.get(url, {"sort": "id"}).content.decode()
    assert html.index(f"#{placed[0].pk}<") < html.index(f"#{b_alloc.pk}<")
    assert op_client.get(url, {"tenant": "nope", "sort": "bogus"}).status_code == 200


def test_allocation_history_shown(op_client, placed):
    html = op_client.get(reverse("console:allocation_detail", args=[placed[0].pk])).content.decode()
    assert "State history" in html and "requested" in html and "placed" in html
    assert 'id="release"' in html and 'id="retry"' not in html


def test_overview_alerts(op_client, placed, world, h100_node):
    alloc_svc.fail(placed[0], "test", "boom on the GPU")
    DriftEvent.objects.create(node=h100_node, kind="orphan_destroyed", detail="ghost instance", resolved=False)
    t = world["a"]
    t.monthly_spend_limit = Decimal("10")
    t.save()
    Invoice.objects.update_or_create(tenant=t, period_start=timezone.now().date().replace(day=1),
                                     defaults={"period_end": date(2100, 1, 1), "currency": "USD",
                                               "total": Decimal("9.50")})
    html = op_client.get(reverse("console:overview")).content.decode()
    assert "boom on the GPU" in html
    assert "ghost instance" in html
    assert "95%" in html
    assert "9.50 USD" in html
    assert "H100" in html  # occupancy per GPU model


# --- actions ------------------------------------------------------------------------------------

def test_release_from_console(op_client, placed):
    a = placed[0]
    resp = op_client.post(reverse("console:allocation_release", args=[a.pk]), {"reason": "ops cleanup"}, follow=True)
    assert resp.status_code == 200
    a.refresh_from_db()
    assert a.state == "releasing"
    assert a.events.filter(to_state="releasing", reason="ops cleanup", actor="user:op@msp.example").exists()
    assert "being released" in resp.content.decode()
    resp = op_client.post(reverse("console:allocation_release", args=[a.pk]), follow=True)
    assert "msg error" in resp.content.decode()  # releasing -> releasing is refused, shown as a message


def test_retry_failed_allocation(op_client, placed):
    a = placed[0]
    alloc_svc.fail(a, "test", "create failed")
    instance = a.instance
    Allocation.objects.filter(pk=a.pk).update(instance=None)
    instance.delete()
    html = op_client.get(reverse("console:allocation_detail", args=[a.pk])).content.decode()
    assert 'id="retry"' in html
    resp = op_client.post(reverse("console:allocation_retry", args=[a.pk]), follow=True)
    assert "being retried" in resp.content.decode()
    a.refresh_from_db()
    assert a.state == "placed" and a.instance_id is not None


def test_retry_of_a_live_allocation_is_refused(op_client, placed):
    resp = op_client.post(reverse("console:allocation_retry", args=[placed[0].pk]), follow=True)
    assert "only failed allocations are retried" in resp.content.decode()


def test_suspend_and_activate(op_client, world):
    t = world["a"]
    resp = op_client.post(reverse("console:tenant_suspend", args=[t.pk]), {"reason": "unpaid"}, follow=True)
    assert "is suspended" in resp.content.decode()
    t.refresh_from_db()
    assert t.status == Tenant.Status.SUSPENDED and t.suspended_reason == "unpaid"
    assert 'id="activate"' in resp.content.decode()
    op_client.post(reverse("console:tenant_activate", args=[t.pk]))
    t.refresh_from_db()
    assert t.status == Tenant.Status.ACTIVE


def _quota_data(t: Tenant, **over) -> dict:
    data = {"max_slices": t.max_slices, "max_slices_per_tier": t.max_slices_per_tier,
            "max_memory_gb": t.max_memory_gb, "monthly_spend_limit": "", "spend_warn_ratio": t.spend_warn_ratio,
            "spend_block_ratio": t.spend_block_ratio, "max_concurrent_requests": t.max_concurrent_requests,
            "max_key_requests_per_minute": "", "max_key_tokens_per_minute": ""}
    return data | over


def test_quota_change(op_client, world):
    t = world["a"]
    resp = op_client.post(reverse("console:tenant_detail", args=[t.pk]),
                          _quota_data(t, max_slices=32, monthly_spend_limit="500.00"))
    assert resp.status_code == 302
    t.refresh_from_db()
    assert t.max_slices == 32 and t.monthly_spend_limit == Decimal("500.00")


@pytest.mark.parametrize("over, message", [
    ({"max_slices_per_tier": 99}, "cannot exceed max_slices"),  # service check
    ({"max_slices": "-3"}, "greater than or equal to 0"),  # form check
    ({"spend_warn_ratio": "2.00", "spend_block_ratio": "1.00"}, "cannot exceed spend_block_ratio"),
    ({"max_memory_gb": "lots"}, "Enter a whole number"),
])
def test_bad_quota_shows_error_and_changes_nothing(op_client, world, over, message):
    t = world["a"]
    before = {f: getattr(t, f) for f in ("max_slices", "max_slices_per_tier", "max_memory_gb", "spend_warn_ratio",
                                         "spend_block_ratio", "monthly_spend_limit")}
    resp = op_client.post(reverse("console:tenant_detail", args=[t.pk]), _quota_data(t, **over))
    assert resp.status_code == 400
    html = resp.content.decode()
    assert message in html and "errorlist" in html
    t.refresh_from_db()
    assert {f: getattr(t, f) for f in before} == before


def _plan_data(**over) -> dict:
    data = {"kind": "on_demand", "currency": "USD", "price_per_slice_hour": "2.5000",
            "price_per_1m_input_tokens": "0.1000", "price_per_1m_output_tokens": "0.3000", "monthly_commit": "",
            "effective_from": (timezone.now() + timedelta(days=3)).strftime("%Y-%m-%dT%H:%M")}
    return data | over


def test_add_future_price_plan(op_client, tiers):
    tier = tiers["1g"]
    resp = op_client.post(reverse("console:tier_detail", args=[tier.pk]), _plan_data(), follow=True)
    assert resp.status_code == 200
    assert tier.plans.count() == 2
    assert "scheduled" in resp.content.decode() and "in force" in resp.content.decode()


@pytest.mark.parametrize("over, message", [
    ({"kind": "reserved"}, "needs a monthly commit"),
    ({"price_per_slice_hour": "-1"}, "greater than or equal to 0"),
])
def test_bad_price_plan_shows_error(op_client, tiers, over, message):
    tier = tiers["1g"]
    resp = op_client.post(reverse("console:tier_detail", args=[tier.pk]), _plan_data(**over))
    assert resp.status_code == 400
    assert message in resp.content.decode()
    assert PricePlan.objects.filter(tier=tier).count() == 1


def test_backdated_price_plan_over_a_finalized_invoice_shows_error(op_client, tiers):
    tier = tiers["1g"]
    held = InvoiceFactory(status="finalized", number="TSR-2026-000007")
    InvoiceLineFactory(invoice=held, tier=tier, usage_from=timezone.now() - timedelta(days=400),
                       usage_to=timezone.now() - timedelta(days=399))
    resp = op_client.post(reverse("console:tier_detail", args=[tier.pk]),
                          _plan_data(effective_from=(timezone.now() - timedelta(days=500)).strftime("%Y-%m-%dT%H:%M")))
    assert resp.status_code == 400
    assert "would reprice hours that finalized invoices hold: TSR-2026-000007" in resp.content.decode()
    assert PricePlan.objects.filter(tier=tier).count() == 2  # the tier's, and the invoice line's own plan


def test_invoice_csv_and_finalize(op_client, world, tiers):
    t = world["a"]
    old = Invoice.objects.create(tenant=t, period_start=date(2024, 1, 1), period_end=date(2024, 2, 1), currency="USD")
    open_ = Invoice.objects.create(tenant=t, period_start=timezone.now().date().replace(day=1),
                                   period_end=date(2100, 1, 1), currency="USD")
    resp = op_client.get(reverse("console:invoice_csv", args=[old.pk]))
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/csv")
    assert b"total" in resp.content and "attachment" in resp["Content-Disposition"]
    html = op_client.get(reverse("console:invoice_detail", args=[open_.pk])).content.decode()
    assert 'id="finalize"' not in html
    html = op_client.get(reverse("console:invoice_detail", args=[old.pk])).content.decode()
    assert 'id="finalize"' in html
    resp = op_client.post(reverse("console:invoice_finalize", args=[old.pk]), follow=True)
    old.refresh_from_db()
    assert old.status == "finalized" and old.number
    assert old.number in resp.content.decode()
    resp = op_client.post(reverse("console:invoice_finalize", args=[open_.pk]), follow=True)
    assert "still open" in resp.content.decode()


def test_invoice_filters(op_client, world):
    Invoice.objects.create(tenant=world["a"], period_start=date(2024, 1, 1), period_end=date(2024, 2, 1),
                           currency="USD", total=Decimal("11.11"))
    Invoice.objects.create(tenant=world["b"], period_start=date(2024, 2, 1), period_end=date(2024, 3, 1),
                           currency="USD", total=Decimal("22.22"))
    url = reverse("console:invoices")
    html = op_client.get(url, {"tenant": "alpha"}).content.decode()
    assert "11.11" in html and "22.22" not in html
    html = op_client.get(url, {"period": "2024-02", "status": "draft"}).content.decode()
    assert "22.22" in html and "11.11" not in html


# --- query counts -------------------------------------------------------------------------------

def _queries(client, url) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return len(ctx.captured_queries)


@pytest.mark.parametrize("name", ["allocations", "tenants", "invoices", "deployments", "allocation_drift",
                                  "overview", "tiers", "overview_alerts", "audit"])
def test_query_count_independent_of_rows(op_client, h100_node, tiers, name):
    url = reverse(f"console:{name}")
    _add_rows(2, tiers, h100_node)
    few = _queries(op_client, url)
    _add_rows(20, tiers, h100_node)
    many = _queries(op_client, url)
    assert few == many, f"{name}: {few} queries with few rows, {many} with many"


def test_nodes_query_count_independent_of_nodes_and_instances(op_client, h100_node, tiers, world, operator):
    orders.create_order(principal_for_user(operator), tenant=world["a"], tier=tiers["1g"])
    url = reverse("console:nodes")
    few = _queries(op_client, url)
    for i in range(4):
        make_node(f"node-x{i}")
    orders.create_order(principal_for_user(operator), tenant=world["a"], tier=tiers["3g"], quantity=3)
    orders.create_order(principal_for_user(operator), tenant=world["b"], tier=tiers["1g"], quantity=4)
    many = _queries(op_client, url)
    assert few == many


# --- filters: the API's FilterSets ----------------------------------------------------------------

def test_console_lists_and_the_api_share_one_filterset_per_list():
    from marketplace import filters
    from marketplace.api.billing import InvoiceViewSet
    from marketplace.api.catalog import NodeViewSet
    from marketplace.api.deployments import DeploymentViewSet
    from marketplace.api.orders import AllocationViewSet, DriftEventViewSet
    from tenants import filters as tenant_filters
    from tenants.api.views import AuditEventViewSet, TenantViewSet

    assert AllocationViewSet.filterset_class is filters.AllocationFilter
    assert DriftEventViewSet.filterset_class is filters.DriftEventFilter
    assert InvoiceViewSet.filterset_class is filters.InvoiceFilter
    assert NodeViewSet.filterset_class is filters.NodeFilter
    assert DeploymentViewSet.filterset_class is filters.DeploymentFilter
    assert TenantViewSet.filterset_class is tenant_filters.TenantFilter
    assert AuditEventViewSet.filterset_class is tenant_filters.AuditEventFilter


@pytest.mark.parametrize(("name", "params", "words"), [
    ("allocations", {"state": "bogus"}, "State “bogus” was ignored"),
    ("invoices", {"period": "2024-13"}, "“2024-13” was ignored"),
    ("invoices", {"status": "paidish", "tenant": "alpha"}, "“paidish” was ignored"),
    ("tenants", {"status": "nope"}, "“nope” was ignored"),
    ("deployments", {"state": "<script>"}, "“&lt;script&gt;” was ignored"),
    ("nodes", {"state": "melted"}, "“melted” was ignored"),
    ("allocation_drift", {"kind": "weird"}, "“weird” was ignored"),
])
def test_invalid_filter_values_are_said_not_a_500(op_client, world, name, params, words):
    resp = op_client.get(reverse(f"console:{name}"), params)
    assert resp.status_code == 200
    assert words in resp.content.decode()


def test_drift_shows_open_events_unless_asked(op_client, h100_node):
    DriftEvent.objects.create(node=h100_node, kind="error", detail="still-open", resolved=False)
    DriftEvent.objects.create(node=h100_node, kind="error", detail="long-fixed", resolved=True)
    url = reverse("console:allocation_drift")
    html = op_client.get(url).content.decode()
    assert "still-open" in html and "long-fixed" not in html
    html = op_client.get(url, {"resolved": "true"}).content.decode()
    assert "long-fixed" in html and "still-open" not in html
    html = op_client.get(url, {"resolved": ""}).content.decode()
    assert "long-fixed" in html and "still-open" in html


def test_tenant_search_filter(op_client, world):
    html = op_client.get(reverse("console:tenants"), {"q": "alp"}).content.decode()
    assert "Alpha" in html or "alpha" in html
    assert "bravo" not in html.lower().split("<tbody>")[1]


# --- create forms ---------------------------------------------------------------------------------

TENANT_POST = {"name": "Charlie Labs", "slug": "charlie", "billing_email": "billing@charlie.example",
               "currency": "EUR", "max_slices": "4", "max_slices_per_tier": "2", "max_memory_gb": "160",
               "monthly_spend_limit": "", "owner_email": "cto@charlie.example"}


def test_create_tenant_from_console(op_client, world):
    from tenants.models import AuditEvent, Invitation

    resp = op_client.post(reverse("console:tenant_create"), TENANT_POST)
    t = Tenant.objects.get(slug="charlie")
    assert resp.status_code == 302 and resp["Location"] == reverse("console:tenant_detail", args=[t.pk])
    assert (t.currency, t.max_slices, t.max_memory_gb, t.monthly_spend_limit) == ("EUR", 4, 160, None)
    assert Invitation.objects.filter(tenant=t, email="cto@charlie.example", role=Role.OWNER).exists()
    assert AuditEvent.objects.filter(action="tenant.create", tenant=t).exists()


@pytest.mark.parametrize(("over", "field", "words"), [
    ({"slug": "alpha"}, "slug", "already exists"),
    ({"slug": "Not a slug!"}, "slug", "valid"),
    ({"billing_email": "nope"}, "billing_email", "valid email"),
    ({"max_slices": "-1"}, "max_slices", "greater than or equal to 0"),
    ({"owner_email": "x@"}, "owner_email", "valid email"),
    ({"currency": "XXX"}, "currency", "valid choice"),
])
def test_bad_tenant_input_stores_nothing_and_says_where(op_client, world, over, field, words):
    from tenants.models import AuditEvent

    before = (Tenant.objects.count(), AuditEvent.objects.count())
    resp = op_client.post(reverse("console:tenant_create"), TENANT_POST | over)
    assert resp.status_code == 400
    assert words in str(resp.context["form"].errors[field])
    html = resp.content.decode()
    assert 'class="field has-error"' in html and words in html
    assert (Tenant.objects.count(), AuditEvent.objects.count()) == before


def test_create_tier_from_console(op_client, catalog):
    from marketplace.models import GpuModel, MigProfile, Tier

    h100 = GpuModel.objects.get(key="h100-sxm-80gb")
    h200_profile = MigProfile.objects.filter(gpu_model__key="h200-sxm-141gb").first()
    post = {"key": "h100-2g", "name": "H100 2g", "gpu_model": h100.pk,
            "profile": MigProfile.objects.get(gpu_model=h100, name="2g.20gb").pk,
            "description": "", "allowed_backends": "python,onnxruntime"}
    bad = op_client.post(reverse("console:tier_create"), post | {"profile": h200_profile.pk})
    assert bad.status_code == 400 and "is not a H100 SXM 80GB profile" in bad.content.decode()
    assert not Tier.objects.filter(key="h100-2g").exists()
    resp = op_client.post(reverse("console:tier_create"), post)
    tier = Tier.objects.get(key="h100-2g")
    assert resp.status_code == 302 and resp["Location"] == reverse("console:tier_detail", args=[tier.pk])
    assert tier.profile.name == "2g.20gb" and tier.backends == ["python", "onnxruntime"]
    again = op_client.post(reverse("console:tier_create"), post)
    assert again.status_code == 400 and "already exists" in str(again.context["form"].errors["key"])
    whole = op_client.post(reverse("console:tier_create"), post | {"key": "h100-whole", "profile": ""})
    assert whole.status_code == 302 and Tier.objects.get(key="h100-whole").profile is None


def _smi(names: list[str], mig_on: set[int] = frozenset()) -> str:
    out = []
    for i, name in enumerate(names):
        out.append(f"GPU {i}: {name} (UUID: GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x})")
        if i in mig_on:
            out.append(f"  MIG 1g.10gb     Device  0: (UUID: MIG-{i:08x}-1111-2222-3333-444444444444)")
    return "\n".join(out)


def test_register_node_from_console(op_client, catalog, sim_dir):
    from marketplace.models import Gpu, Node, ServerPlatform

    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    resp = op_client.post(reverse("console:node_create"), {"hostname": " Node-Z ", "platform": platform.pk,
                                                           "gpus": ""})  # the simulated backend discovers
    assert resp.status_code == 302
    assert Gpu.objects.filter(node__hostname="node-z").count() == 8
    resp = op_client.post(reverse("console:node_create"), {
        "hostname": "node-y", "platform": platform.pk, "gpus": _smi(["NVIDIA H100 80GB HBM3"] * 8, {0, 3})})
    assert resp.status_code == 302
    gpus = Gpu.objects.filter(node__hostname="node-y").order_by("index")
    assert [g.mig_mode for g in gpus] == [i in (0, 3) for i in range(8)]
    assert Node.objects.count() == 2
    from tenants.models import AuditEvent

    assert sorted(AuditEvent.objects.filter(action="node.register").values_list("target", flat=True)) == [
        "node:node-y", "node:node-z"]


def test_a_node_registered_from_the_console_takes_no_work_until_its_worker_is_heard(op_client, catalog, sim_dir,
                                                                                      settings):
    """Registering is not a heartbeat: the node shows "Awaiting its worker", its GPUs are no free capacity and
    placement refuses them; its worker's heartbeat makes it work; a quiet worker stops it again."""
    from datetime import timedelta

    from django.utils import timezone

    from marketplace.models import GpuModel, MigProfile, Node, ServerPlatform
    from marketplace.selectors.catalog import ready_gpus
    from marketplace.services.fleet import NoCapacityError, place_instance

    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    op_client.post(reverse("console:node_create"), {"hostname": "node-z", "platform": platform.pk, "gpus": ""})
    node = Node.objects.get(hostname="node-z")
    assert node.state == Node.State.READY and node.last_heartbeat is None
    page = op_client.get(reverse("console:nodes")).content.decode()
    assert "Awaiting its worker" in page
    assert not ready_gpus().exists()
    h100, tenant = GpuModel.objects.get(key="h100-sxm-80gb"), TenantFactory()
    slice_1g = MigProfile.objects.get(gpu_model=h100, name="1g.10gb")
    with pytest.raises(NoCapacityError):
        place_instance(tenant, h100, slice_1g)
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now())  # what its worker's reconcile writes
    assert ready_gpus().count() == 8
    assert "Awaiting its worker" not in op_client.get(reverse("console:nodes")).content.decode()
    assert place_instance(tenant, h100, slice_1g).gpu.node_id == node.pk
    quiet = timezone.now() - timedelta(seconds=settings.TESSERA_NODE_HEARTBEAT_STALE_S + 1)
    Node.objects.filter(pk=node.pk).update(last_heartbeat=quiet)
    assert not ready_gpus().exists()
    assert "No heartbeat" in op_client.get(reverse("console:nodes")).content.decode()


@pytest.mark.parametrize(("post", "field", "words"), [
    ({"hostname": "node-z"}, "hostname", "is registered"),
    ({"hostname": "bad host!"}, "hostname", "letters, digits"),
    ({"gpus": _smi(["NVIDIA H200"] * 8)}, "gpus", "but hgx-h100-8 has H100 SXM 80GB"),
    ({"gpus": _smi(["NVIDIA GeForce RTX 4090"] * 8)}, "gpus", "which the catalog does not sell"),
    ({"gpus": _smi(["NVIDIA H100 80GB HBM3"] * 4)}, "gpus", "has 8 GPUs; the node reports 4"),
    ({"gpus": "hello world"}, "gpus", "is not nvidia-smi -L output"),
    ({"platform": "999999"}, "platform", "valid choice"),
])
def test_bad_node_input_stores_nothing_and_says_where(op_client, catalog, sim_dir, post, field, words):
    from marketplace.models import Gpu, Node, ServerPlatform

    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    make_node("node-z")
    before = (Node.objects.count(), Gpu.objects.count())
    resp = op_client.post(reverse("console:node_create"), {"hostname": "node-new", "platform": platform.pk,
                                                           "gpus": ""} | post)
    assert resp.status_code == 400
    errors = resp.context["form"].errors
    assert words in str(errors[field]), errors
    assert (Node.objects.count(), Gpu.objects.count()) == before


def test_register_node_without_gpus_needs_the_list_on_real_nvml(op_client, catalog, settings):
    from marketplace.models import Node, ServerPlatform

    settings.TESSERA_NVML_BACKEND = "pynvml"
    resp = op_client.post(reverse("console:node_create"), {
        "hostname": "node-q", "platform": ServerPlatform.objects.get(key="hgx-h100-8").pk, "gpus": ""})
    assert resp.status_code == 400 and "nvidia-smi -L" in str(resp.context["form"].errors["gpus"])
    assert not Node.objects.exists()


# --- audit log ------------------------------------------------------------------------------------

def _audit(n: int, tenant, action="tier.update", **kw):
    from tenants.models import AuditEvent

    now = timezone.now()
    AuditEvent.objects.bulk_create([
        AuditEvent(at=now - timedelta(minutes=i), actor="user:op@msp.example", tenant=tenant, action=action,
                   target=f"thing:{i}", detail={"n": i}, **kw) for i in range(n)])


def test_audit_log_newest_first_filtered_and_paginated(op_client, world):
    from tenants.models import AuditEvent

    AuditEvent.objects.all().delete()
    _audit(30, world["a"], action="member.role")
    _audit(3, world["b"], action="key.revoke")
    AuditEvent.objects.create(at=timezone.now() + timedelta(minutes=1), actor="user:op@msp.example",
                              tenant=world["b"], action="tenant.suspend", target="tenant:bravo")
    url = reverse("console:audit")
    resp = op_client.get(url)
    html = resp.content.decode().split("<tbody>")[1]
    assert resp.context["table"].total == 34
    assert html.index("tenant.suspend") < html.index("key.revoke")  # newest first
    assert "page 1 of 2" in html
    html = op_client.get(url, {"tenant": "bravo"}).content.decode().split("<tbody>")[1]
    assert "key.revoke" in html and "member.role" not in html
    resp = op_client.get(url, {"tenant": "alpha", "action": "member.role", "page": "2"})
    assert resp.context["table"].total == 30 and "thing:29" in resp.content.decode()
    resp = op_client.get(url, {"action": "key.revoke", "sort": "at"})
    assert [e.target for e in resp.context["table"].page] == ["thing:2", "thing:1", "thing:0"]


def test_audit_log_query_count_is_pinned_and_independent_of_rows(op_client, world,
                                                                   django_assert_max_num_queries):
    url = reverse("console:audit")
    _audit(2, world["a"])
    with django_assert_max_num_queries(12):
        few = _queries(op_client, url)
    for i in range(10):
        _audit(5, TenantFactory(), action=f"action.{i}")
    with django_assert_max_num_queries(12):
        many = _queries(op_client, url)
    assert few == many


@pytest.mark.parametrize("name", ["tenant_create", "tier_create", "node_create"])
def test_create_pages_query_count_is_pinned(op_client, h100_node, tiers, world, name, django_assert_max_num_queries):
    with django_assert_max_num_queries(10):
        few = _queries(op_client, reverse(f"console:{name}"))
    for i in range(5):
        make_node(f"node-x{i}")
    with django_assert_max_num_queries(10):
        assert _queries(op_client, reverse(f"console:{name}")) == few


# --- live lists (htmx) ----------------------------------------------------------------------------

LIVE = [("allocations", "live-list"), ("deployments", "live-list"), ("allocation_drift", "live-list"),
        ("overview", "live-alerts")]


def _hx(client, url, params=None):
    return client.get(url, params or {}, HTTP_HX_REQUEST="true")


@pytest.mark.parametrize(("name", "region"), LIVE)
def test_live_lists_poll_and_answer_htmx_with_the_list_alone(op_client, placed, name, region):
    url = reverse(f"console:{name}")
    page = op_client.get(url).content.decode()
    assert f'id="{region}"' in page and 'hx-trigger="every 5s"' in page
    assert "django_htmx/htmx-2.min.js" in page  # shipped by the django-htmx package, no CDN
    poll = page.split(f'id="{region}"')[1].split('hx-get="')[1].split('"')[0]
    resp = _hx(op_client, poll)
    body = resp.content.decode()
    assert resp.status_code == 200 and "HX-Request" in resp["Vary"]
    assert body.lstrip().startswith(f'<div id="{region}"') and "<html" not in body and "mainnav" not in body


def test_live_allocations_list_shows_a_new_state_without_a_reload(op_client, placed):
    url = reverse("console:allocations")
    assert "failed</span>" not in _hx(op_client, url).content.decode()
    alloc_svc.fail(placed[0], "test", "boom")
    assert "failed</span>" in _hx(op_client, url).content.decode()
    alerts = _hx(op_client, reverse("console:overview_alerts")).content.decode()
    assert f"#{placed[0].pk}</a>" in alerts and "boom" in alerts


def test_live_filter_keeps_its_query_and_says_bad_values_in_the_list(op_client, placed):
    url = reverse("console:allocations")
    body = _hx(op_client, url, {"state": "bogus", "tenant": "alpha"}).content.decode()
    assert "State “bogus” was ignored" in body
    assert 'hx-get="/console/allocations/?state=bogus&amp;tenant=alpha"' in body  # the poll keeps the filter
    assert "was ignored" not in op_client.get(reverse("console:tenants")).content.decode()  # no stale message


@pytest.mark.parametrize(("name", "most"), [("allocations", 8), ("deployments", 6), ("allocation_drift", 7),
                                            ("overview_alerts", 12)])
def test_live_refresh_query_count_pinned_and_independent_of_rows(op_client, h100_node, tiers, name, most,
                                                                   django_assert_max_num_queries):
    url = reverse(f"console:{name}")
    _add_rows(2, tiers, h100_node)
    with CaptureQueriesContext(connection) as few, django_assert_max_num_queries(most):
        assert _hx(op_client, url).status_code == 200
    _add_rows(20, tiers, h100_node)
    with CaptureQueriesContext(connection) as many:
        assert _hx(op_client, url).status_code == 200
    assert len(few.captured_queries) == len(many.captured_queries)


def test_htmx_is_a_static_file_of_an_installed_package():
    from django.contrib.staticfiles import finders

    path = finders.find("django_htmx/htmx-2.min.js")
    assert path and "site-packages" in str(path)


def test_the_shared_filtersets_filter_the_api_the_same_way(op_client, world, h100_node):
    """The console's month and search filters are the API's too (one FilterSet per list)."""
    Invoice.objects.create(tenant=world["a"], period_start=date(2024, 1, 1), period_end=date(2024, 2, 1),
                           currency="USD", total=Decimal("11.11"))
    Invoice.objects.create(tenant=world["b"], period_start=date(2024, 2, 1), period_end=date(2024, 3, 1),
                           currency="USD", total=Decimal("22.22"))
    rows = op_client.get("/api/v1/invoices/", {"period": "2024-02"}).json()["results"]
    assert [r["total"] for r in rows] == ["22.22"]
    assert op_client.get("/api/v1/invoices/", {"period": "2024-13"}).status_code == 400
    slugs = [r["slug"] for r in op_client.get("/api/v1/tenants/", {"q": "alp"}).json()["results"]]
    assert slugs == ["alpha"]
    DriftEvent.objects.create(node=h100_node, kind="error", detail="open", resolved=False)
    DriftEvent.objects.create(node=h100_node, kind="error", detail="done", resolved=True)
    rows = op_client.get("/api/v1/fleet/drift/", {"resolved": "false"}).json()["results"]
    assert [r["detail"] for r in rows] == ["open"]


def test_audit_details_read_as_people_read_them(op_client, world):
    """The details are JSON: shown without Python's spelling (None, True, ['a', 'b'], {'k': 1})."""
    from tenants.models import AuditEvent

    AuditEvent.objects.all().delete()
    AuditEvent.objects.create(actor="user:op@msp.example", action="api_key.create", target="key:x", detail={
        "scopes": ["read", "inference"], "owner_email": None, "forced": False, "failed": [], "limits": {"rpm": 60}})
    page = op_client.get(reverse("console:audit")).content.decode()
    row = page[page.index("key:x"):]
    row = row[:row.index("</tr>")]
    for raw in ("None", "False", "[", "{", "'"):
        assert raw not in row, (raw, row)
    for shown in ("read, inference", "owner_email</span> —", "forced</span> no", "failed</span> none",
                  "limits</span> rpm: 60"):
        assert shown in row, (shown, row)
