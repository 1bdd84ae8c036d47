"""The portal catalog's availability reads the fleet in a fixed number of queries: more nodes, same count
(each GPU's label names its node: the node comes with the GPU, not one query per GPU)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from marketplace.models import Node
from tenants.roles import Role
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db


def _queries(client) -> int:
    with CaptureQueriesContext(connection) as q:
        assert client.get("/portal/catalog/").status_code == 200
    return len(q.captured_queries)


def test_portal_catalog_queries_do_not_grow_with_the_fleet(members_a, h100_node, tiers):
    client = Client()
    client.force_login(members_a[Role.OWNER])
    client.get("/portal/catalog/")  # warm (session, content types)
    one = _queries(client)
    for host in ("node-b", "node-c"):
        make_node(host)
    assert Node.objects.count() == 3
    assert _queries(client) == one
