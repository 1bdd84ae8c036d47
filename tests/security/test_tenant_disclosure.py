"""What tenants may learn about the fleet: nothing beyond their own slices.

The placement engine explains every decision for operators ("H100 SXM 80GB GPU 17 (node 3): partly
used ...; 40 other candidates", "no H100 GPU has a free 3g placement; 504 GPUs of this model, 37
dedicated to other tenants"). A tenant principal (portal session, API key) must see neither those
texts nor the internal ids and hostnames behind them: order refusals, allocation details and
events, its GPU instances, the portal's slice page and catalog, usage reports. Operators keep the
diagnostics.

The fixture makes every secret distinctive so that its absence means something: the node is
``gpu-secret-node`` with id 4300077, its GPUs have ids 4200000..4200007, a rival tenant (id
4400123) holds three GPUs dedicated to it, and the fleet is 8 GPUs of which 3 are the rival's.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from marketplace.models import Allocation, AllocationEvent, Gpu, ModelDeployment, Node, ServerPlatform
from marketplace.services import fleet, orders, provisioning
from marketplace.services.nodes import sim_discovery
from telemetry.models import UsageHourly
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_tier

pytestmark = pytest.mark.django_db

SECRET_HOST = "gpu-secret-node"
NODE_PK = 4_300_077
GPU_PK0 = 4_200_000
RIVAL_PK = 4_400_123
RIVAL_GPUS = 3
# Phrases of the engine's diagnostics that carry fleet figures or internal ids.
LEAKY_PHRASES = ("GPUs of this model", "other tenants", "dedicated to tenant", "candidate", "fragmentation",
                 "(node ", " · GPU ", "in the fleet", "shared GPU is left")


def _number(n: int) -> re.Pattern:
    return re.compile(rf"(?<!\d){n}(?!\d)")


def assert_no_fleet_secrets(text: str, fw: dict) -> None:
    """`text` (a response body) names no node, GPU, other tenant or fleet figure."""
    assert SECRET_HOST not in text
    for uuid in fw["gpu_uuids"]:
        assert uuid not in text, uuid
    for n in (NODE_PK, RIVAL_PK, *fw["gpu_pks"]):
        assert not _number(n).search(text), n
    assert "rival" not in text.lower()
    for phrase in LEAKY_PHRASES:
        assert phrase not in text, phrase


@pytest.fixture
def fw(world, catalog, sim_dir):
    """The fleet world: one 8-GPU node with distinctive ids, three GPUs dedicated to a rival
    tenant, tenant alpha (world["a"]) with room in its quotas."""
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    discovered = sim_discovery(SECRET_HOST, platform)
    Node.objects.create(pk=NODE_PK, hostname=SECRET_HOST, platform=platform, queue=Node.queue_for(SECRET_HOST))
    for g in discovered:  # register_node keeps these rows (and their ids): it matches on (node, index)
        Gpu.objects.create(pk=GPU_PK0 + g.index, node_id=NODE_PK, index=g.index, uuid=g.uuid,
                           gpu_model=platform.gpu_model, mig_mode=g.mig_mode)
    node = fleet.register_node(SECRET_HOST, platform, discovered)
    assert node.pk == NODE_PK
    rival = TenantFactory(pk=RIVAL_PK, slug="rival-co", name="Rival Co")
    gpus = list(node.gpus.order_by("index"))
    for g in gpus[-RIVAL_GPUS:]:
        fleet.dedicate_gpu(g, rival)
    alpha = world["a"]
    alpha.max_slices = alpha.max_slices_per_tier = 64
    alpha.max_memory_gb = 10_000
    alpha.save()
    tiers = {
        "1g": make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb"),
        "7g": make_tier("h100-7g", "h100-sxm-80gb", "7g.80gb"),
        "3g-dedicated": make_tier("h100-3g-dedicated", "h100-sxm-80gb", "3g.40gb", dedicated=True),
    }
    owner = MembershipFactory(tenant=alpha, role=Role.OWNER, user=UserFactory(email="boss@alpha.example")).user
    return {"node": node, "gpu_pks": [g.pk for g in gpus], "gpu_uuids": [g.uuid for g in gpus], "rival": rival,
            "alpha": alpha, "tiers": tiers, "owner": owner, "p": principal_for_user(owner)}


def fill_shared_gpus(fw) -> list[Allocation]:
    """Alpha takes every shared GPU with a 7g slice (5 of 8; the rival's 3 stay empty)."""
    o = orders.create_order(fw["p"], tenant=fw["alpha"], tier=fw["tiers"]["7g"], quantity=8 - RIVAL_GPUS)
    return list(o.allocations.order_by("pk"))


def active_allocation(fw) -> Allocation:
    a = orders.create_order(fw["p"], tenant=fw["alpha"], tier=fw["tiers"]["1g"]).allocations.get()
    assert provisioning.provision(a.pk) == "activated"
    a.refresh_from_db()
    return a


# --- the engine's two texts --------------------------------------------------------------------------

def test_engine_summaries_name_no_gpu_node_tenant_or_count():
    from marketplace.placement import Fleet, GpuState, Request

    h100, p3g = "h100-sxm-80gb", 9
    secrets = ["4242001", "4242002", "4242003", "4343", "4444", "4545", "3 GPUs", "1 dedicated"]
    f = Fleet([GpuState(4242001, h100, 4343, dedicated_tenant_id=4444, dedication_sticky=True),
               GpuState(4242002, h100, 4343), GpuState(4242003, h100, 4343)])
    answers = [f.place(Request(h100, 4545, profile_id=p3g)) for _ in range(5)]  # 4 fit, the fifth does not
    answers += [f.place(Request(h100, 4545, profile_id=p3g, dedicated=True)),
                f.place(Request(h100, 4545, whole_gpu=True))]
    assert [bool(a) for a in answers] == [True] * 4 + [False] * 3
    for a in answers:
        assert a.summary and a.reason != a.summary
        for secret in secrets:
            assert secret not in a.summary, (secret, a.summary)
    assert "4242002" in answers[0].reason and "3 GPUs of this model, 1 dedicated" in answers[4].reason
    assert answers[0].summary == "3g.40gb slice placed on a shared H100 SXM 80GB GPU"
    assert answers[4].summary == "No capacity for H100 SXM 80GB 3g.40gb right now; try another tier or later"
    assert "your dedicated GPUs" in answers[5].summary and "a whole H100 SXM 80GB GPU" in answers[6].summary


# --- order refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", ["7g", "3g-dedicated"])
def test_no_capacity_refusal_tells_a_tenant_key_nothing_about_the_fleet(fw, world, as_key, tier):
    fill_shared_gpus(fw)
    r = as_key(world["secret_a"]).post("/api/v1/orders/", {"tier": fw["tiers"][tier].key}, format="json")
    assert r.status_code == 409, r.content
    text = r.content.decode()
    assert_no_fleet_secrets(text, fw)
    assert not re.search(rf"(?<!\d)(8|{RIVAL_GPUS}) (GPU|dedicated)", text)  # fleet size, the rival's share
    message = r.json()["profile"][0]
    assert "capacity" in message.lower() and fw["tiers"][tier].profile.name in message
    if tier == "3g-dedicated":
        assert "your dedicated GPUs" in message


def test_no_capacity_refusal_in_the_portal(fw, client):
    fill_shared_gpus(fw)
    client.force_login(fw["owner"])
    r = client.post(reverse("portal:order", args=[fw["tiers"]["3g-dedicated"].pk]), {"quantity": "1"})
    assert r.status_code == 400
    text = r.content.decode()
    assert_no_fleet_secrets(text, fw)
    assert "Not ordered" in text and "your dedicated GPUs" in text


def test_operator_keeps_the_no_capacity_diagnostic(fw, operator, as_user):
    fill_shared_gpus(fw)
    r = as_user(operator).post("/api/v1/orders/", {"tenant": "alpha", "tier": "h100-7g"}, format="json")
    assert r.status_code == 409
    text = r.json()["profile"][0]
    assert "8 GPUs of this model" in text and f"{RIVAL_GPUS} dedicated to other tenants" in text


# --- allocations, their events and instances --------------------------------------------------------

def test_allocation_detail_and_list_hide_fleet_internals_from_a_tenant(fw, world, as_key, as_user):
    a = active_allocation(fw)
    placed = a.events.get(to_state="placed")
    assert placed.reason and a.placement_reason and a.mig_uuid
    for api in (as_key(world["secret_a"]), as_user(fw["owner"])):
        detail = api.get(f"/api/v1/allocations/{a.pk}/")
        assert detail.status_code == 200
        listing = api.get("/api/v1/allocations/")
        order = api.get(f"/api/v1/orders/{a.order_id}/")
        for r in (detail, listing, order):
            assert r.status_code == 200
            assert_no_fleet_secrets(r.content.decode(), fw)
        body = detail.json()
        assert body["node"] is None and body["gpu_uuid"] == "" and body["start"] is None
        assert body["mig_uuid"] == a.mig_uuid  # its own slice's device id: the tenant may pin work to it
        assert body["placement_reason"]  # a tenant-safe explanation is still there
        assert [e["to_state"] for e in body["events"]] == ["requested", "placed", "provisioning", "ready", "active"]


@pytest.mark.parametrize("url", ["/api/v1/allocations/", "/api/v1/fleet/instances/"])
def test_node_filter_cannot_confirm_a_hostname_for_a_tenant(fw, world, as_key, operator, as_user, url):
    active_allocation(fw)
    tenant = as_key(world["secret_a"]).get(url, {"node": SECRET_HOST})
    assert tenant.status_code == 200 and tenant.json()["count"] == 0
    assert as_user(operator).get(url, {"node": SECRET_HOST}).json()["count"] == 1
    assert as_user(operator).get(url, {"node": "gpu-other-node"}).json()["count"] == 0


def test_operator_sees_the_placement_diagnostic(fw, operator, as_user):
    a = active_allocation(fw)
    body = as_user(operator).get(f"/api/v1/allocations/{a.pk}/").json()
    assert body["node"] == SECRET_HOST and body["gpu_uuid"] in fw["gpu_uuids"] and body["start"] is not None
    diagnostic = f"{SECRET_HOST} · GPU "  # the one GPU naming: node hostname and NVML index
    assert diagnostic in body["placement_detail"] and "candidate" in body["placement_detail"]
    placed = next(e for e in body["events"] if e["to_state"] == "placed")
    assert diagnostic in placed["detail"]


def test_gpu_instances_of_a_tenant_hide_fleet_internals(fw, world, as_key, operator, as_user):
    a = active_allocation(fw)
    r = as_key(world["secret_a"]).get("/api/v1/fleet/instances/")
    assert r.status_code == 200 and r.json()["count"] == 1
    assert_no_fleet_secrets(r.content.decode(), fw)
    row = r.json()["results"][0]
    assert row["gi_id"] is None and row["ci_id"] is None and row["reason"] == "" and row["mig_uuid"] == a.mig_uuid
    op = as_user(operator).get("/api/v1/fleet/instances/").json()["results"][0]
    assert op["node"] == SECRET_HOST and op["gi_id"] is not None and f"{SECRET_HOST} · GPU " in op["reason"]


def test_portal_slice_page_hides_fleet_internals(fw, client):
    a = active_allocation(fw)
    client.force_login(fw["owner"])
    for name in ("portal:slice", "portal:slice_status"):
        r = client.get(reverse(name, args=[a.pk]))
        assert r.status_code == 200
        text = r.content.decode()
        assert "placed" in text
        assert_no_fleet_secrets(text, fw)
    assert a.mig_uuid in client.get(reverse("portal:slice", args=[a.pk])).content.decode()


def test_console_shows_the_diagnostic(fw, operator, client):
    a = active_allocation(fw)
    client.force_login(operator)
    text = client.get(reverse("console:allocation_detail", args=[a.pk])).content.decode()
    assert f"{SECRET_HOST} · GPU " in text


def test_existing_leaky_events_are_rewritten_by_the_migration(fw):
    """Rows written before the split (the engine's text in reason) become tenant-safe; the old
    text moves to the operator-only detail."""
    import importlib

    from django.apps import apps

    a = active_allocation(fw)
    leaky = "H100 SXM 80GB GPU 4200001 (node 4300077): empty; 2 other candidates"
    AllocationEvent.objects.filter(allocation=a, to_state="placed").update(reason=leaky, detail="")
    Allocation.objects.filter(pk=a.pk).update(placement_reason=leaky, placement_detail="")
    migration = importlib.import_module("marketplace.migrations.0005_tenant_safe_reasons")
    migration.split_reasons(apps, None)
    e = AllocationEvent.objects.get(allocation=a, to_state="placed")
    a.refresh_from_db()
    assert e.detail == leaky and a.placement_detail == leaky
    assert_no_fleet_secrets(e.reason, fw)
    assert_no_fleet_secrets(a.placement_reason, fw)
    assert "1g.10gb" in e.reason


# --- usage and catalog ------------------------------------------------------------------------------

def test_metered_vs_served_names_no_node_for_a_tenant(fw, world, as_key, operator, as_user):
    a = active_allocation(fw)
    dep = ModelDeployment.objects.create(allocation=a, tenant=fw["alpha"], name="m", backend="python", spec={},
                                         memory_mb=100, state="ready")
    hour = (timezone.now() - timedelta(hours=2)).replace(minute=0, second=0, microsecond=0)
    UsageHourly.objects.create(tenant=fw["alpha"], deployment=dep, hour=hour, requests=5, events=1)
    r = as_key(world["secret_a"]).get("/api/v1/usage/metered-vs-served/")
    assert r.status_code == 200 and r.json()["results"][0]["metered_requests"] == 5
    assert_no_fleet_secrets(r.content.decode(), fw)
    op = as_user(operator).get("/api/v1/usage/metered-vs-served/").json()
    assert op["results"][0]["node"] == SECRET_HOST


def test_portal_catalog_availability_is_the_tenants_own_and_capped(fw, client, world):
    client.force_login(fw["owner"])
    r = client.get(reverse("portal:catalog"))
    free = {row["tier"].key: row["free"] for row in r.context["rows"]}
    # The rival's three dedicated GPUs are not alpha's to use: five shared GPUs, one 7g each.
    assert free["h100-7g"] == 8 - RIVAL_GPUS
    # Seven 1g starts on each of five GPUs is a fleet figure: shown only up to the cap.
    assert free["h100-1g"] == "10+"  # marketplace.selectors.catalog.AVAILABILITY_CAP
    assert free["h100-3g-dedicated"] == 2 * (8 - RIVAL_GPUS)  # empty shared GPUs alpha could dedicate
    assert "35" not in re.findall(r'class="badge [a-z]+ availability">([^<]*)<', r.content.decode())
    # The rival sees its own GPUs as well.
    rival_owner = MembershipFactory(tenant=fw["rival"], role=Role.OWNER).user
    client.force_login(rival_owner)
    free = {row["tier"].key: row["free"] for row in client.get(reverse("portal:catalog")).context["rows"]}
    assert free["h100-7g"] == 8
