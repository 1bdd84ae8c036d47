"""Operators change a node (state, serving address, port pool) in the console or the API, never in the admin:
one service (fleet.update_node), audited, refusing what would strand running servers, storing nothing it refuses."""

from __future__ import annotations

import pytest
from django.urls import reverse

from marketplace.models import Node, TritonServer
from tenants.models import AuditEvent
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(catalog, sim_dir):
    return make_node("node-e")


def _running_server(node, tiers) -> TritonServer:
    """A slice on the node, provisioned: its Triton server runs on ports from the node's pool."""
    from marketplace.services import orders, provisioning
    from tenants.roles import Role
    from tenants.scoping import principal_for_user
    from tests.factories import MembershipFactory, TenantFactory

    tenant = TenantFactory()
    owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    a = orders.create_order(owner, tenant=tenant, tier=tiers["1g"]).allocations.get()
    assert provisioning.provision(a.pk) == "activated"
    return TritonServer.objects.get(allocation=a, node=node)


def test_the_console_drains_a_node_and_moves_its_pool(client, operator, node):
    client.force_login(operator)
    page = client.get(reverse("console:node_edit", args=[node.pk]))
    assert page.status_code == 200 and 'value="20000"' in page.content.decode()
    resp = client.post(reverse("console:node_edit", args=[node.pk]), {
        "state": "draining", "serving_address": "10.0.0.7", "serving_port_min": "30000", "serving_port_max": "30299"})
    assert resp.status_code == 302
    node.refresh_from_db()
    assert (node.state, node.serving_address, node.serving_port_min, node.serving_port_max) == (
        "draining", "10.0.0.7", 30000, 30299)
    event = AuditEvent.objects.get(action="node.update")
    assert event.target == "node:node-e" and event.detail["state"] == "draining"
    assert "30000–30299" in client.get(reverse("console:nodes")).content.decode()


@pytest.mark.parametrize(("post", "field", "words"), [
    ({"serving_port_min": "30000", "serving_port_max": "30001"}, "serving_port_max", "at least 3 ports"),
    ({"serving_port_min": "80"}, "serving_port_min", "greater than or equal to 1024"),
    ({"serving_address": "not-an-ip"}, "serving_address", "valid IPv4 or IPv6"),
    ({"state": "gone"}, "state", "valid choice"),
])
def test_bad_values_say_where_and_store_nothing(client, operator, node, post, field, words):
    client.force_login(operator)
    data = {"state": "ready", "serving_address": "127.0.0.1", "serving_port_min": "20000",
            "serving_port_max": "20999"} | post
    resp = client.post(reverse("console:node_edit", args=[node.pk]), data)
    assert resp.status_code == 400 and words in str(resp.context["form"].errors[field])
    node.refresh_from_db()
    assert (node.state, node.serving_port_min, node.serving_port_max) == ("ready", 20000, 20999)
    assert not AuditEvent.objects.filter(action="node.update").exists()


def test_a_pool_that_would_strand_a_running_server_is_refused(api, operator, node, tiers):
    server = _running_server(node, tiers)
    api.force_authenticate(operator)
    url = reverse("api:node-detail", args=[node.pk])
    resp = api.patch(url, {"serving_port_min": 25000, "serving_port_max": 25999}, format="json")
    assert resp.status_code == 400 and str(server.http_port) in str(resp.json())
    node.refresh_from_db()
    assert node.serving_port_min == 20000
    resp = api.patch(url, {"serving_port_min": 20000, "serving_port_max": 21999, "state": "maintenance"},
                     format="json")
    assert resp.status_code == 200 and resp.json()["serving_port_max"] == 21999
    assert resp.json()["state"] == "maintenance"
    assert api.patch(url, {"hostname": "renamed"}, format="json").json().get("hostname") != "renamed"
    node.refresh_from_db()
    assert node.hostname == "node-e"


def test_tenants_cannot_change_nodes(api, members_a, node):
    api.force_authenticate(members_a["owner"])
    resp = api.patch(reverse("api:node-detail", args=[node.pk]), {"state": "offline"}, format="json")
    assert resp.status_code in (403, 404)
    node.refresh_from_db()
    assert node.state == Node.State.READY
