"""PostgreSQL drops the web request's connection in the middle of a write (pg_terminate_backend, as on a
failover or an operator's kill) -> the client gets a clean 5xx (no traceback, nothing about the database
leaked) and nothing is half-written: no order without its allocations, no placed instance, no slot.

A real HTTP request to the live server (its own thread and database connection). The order is for three
slices; the placement of the second one is held (a hook around fleet.place_instance, in the server's
thread) after the order, the first allocation, its events, GPU instance and slots were written in the
open transaction; the test then terminates that backend from its own connection and lets the request go on."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid

import pytest
from django.db import connection

from marketplace.models import Allocation, AllocationEvent, GpuInstance, GpuSlot, Order
from marketplace.services import fleet, orders
from tests.factories import TenantFactory, make_key
from tests.faults.conftest import needs_real_services
from tests.fleet_fixtures import make_node, make_tier

pytestmark = [needs_real_services, pytest.mark.django_db(transaction=True)]


def call(url, secret, method="GET", body=None):
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json",
                                          "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def test_connection_terminated_mid_order_gives_clean_5xx_and_no_partial_rows(catalog, sim_dir, live_server,
                                                                            monkeypatch):
    make_node(f"db-{uuid.uuid4().hex[:8]}")
    tier = make_tier("db-1g", "h100-sxm-80gb", "1g.10gb")
    tenant = TenantFactory(max_slices=32, max_slices_per_tier=32, max_memory_gb=5000)
    _key, secret = make_key(tenant, ["read", "deployments:write"])
    monkeypatch.setattr(orders, "enqueue_provision", lambda allocation: None)  # no broker traffic

    held, release = threading.Event(), threading.Event()
    server_backend: list[int] = []
    real_place = fleet.place_instance
    calls = {"n": 0}

    def place_then_hold(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2 and not release.is_set():  # in the server's thread, mid-transaction
            with connection.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                server_backend.append(cur.fetchone()[0])
            held.set()
            release.wait(30)
        return real_place(*args, **kwargs)

    monkeypatch.setattr(fleet, "place_instance", place_then_hold)
    answer: dict = {}
    url = f"{live_server.url}/api/v1/orders/"
    t = threading.Thread(target=lambda: answer.update(r=call(url, secret, "POST", {"tier": tier.key, "quantity": 3})))
    t.start()
    try:
        assert held.wait(30), "the order request never reached its second placement"
        with connection.cursor() as cur:
            cur.execute("SELECT state, backend_xid IS NOT NULL FROM pg_stat_activity WHERE pid = %s", server_backend)
            assert cur.fetchone() == ("idle in transaction", True)  # rows written, not committed
            cur.execute("SELECT pg_terminate_backend(%s)", server_backend)
            assert cur.fetchone()[0] is True
    finally:
        release.set()
        t.join(60)
    status, ctype, body = answer["r"]
    print(f"observed: {status} {ctype} {body[:200]!r}")
    assert 500 <= status <= 599, (status, body[:500])
    for leak in ("Traceback", "OperationalError", "psycopg", "terminating connection", "SELECT", "File \""):
        assert leak not in body, f"the error page leaks {leak!r}: {body[:1000]}"
    assert len(body) < 5000, "a debug page, not a clean error"

    # nothing half-written
    assert Order.objects.filter(tenant=tenant).count() == 0
    assert Allocation.objects.filter(tenant=tenant).count() == 0
    assert AllocationEvent.objects.count() == 0
    assert GpuInstance.objects.count() == 0
    assert GpuSlot.objects.count() == 0

    # and the server recovered: the same order now goes through whole (new connection, no lock left)
    status, _ctype, body = call(url, secret, "POST", {"tier": tier.key, "quantity": 3})
    assert status == 201, body[:1000]
    assert len(json.loads(body)["allocations"]) == 3
    assert Allocation.objects.filter(tenant=tenant).count() == 3 and GpuSlot.objects.count() == 3
