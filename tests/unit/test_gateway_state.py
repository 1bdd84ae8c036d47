"""The gateway's incremental snapshot (state.Loader): an unchanged world re-reads no row, a change re-reads its
bucket only, and after every kind of change (any writer: ``.update()``, deletes, rows leaving the query) the
incremental snapshot equals a full read. Revocation, suspension and spend blocks through a running gateway:
test_gateway.py::test_keys_revoked_expired_without_scope_and_tenant_states."""

from __future__ import annotations

import pytest
from django.utils import timezone

from marketplace.gateway.state import Loader, Snapshot, Tables
from marketplace.models import ModelDeployment, TritonServer
from tenants.models import ApiKey, Tenant
from tests.factories import make_key

pytestmark = pytest.mark.django_db


def _same_as_full(snap: Snapshot) -> None:
    full = Loader().load()  # a full read
    assert snap.keys == full.keys
    assert snap.tenants == full.tenants
    assert {r: [(u.deployment_id, u.base_url, u.adapter, u.headers, u.io) for u in ups]
            for r, ups in snap.routes.items()} == \
        {r: [(u.deployment_id, u.base_url, u.adapter, u.headers, u.io) for u in ups] for r, ups in full.routes.items()}


def _reread(loader: Loader) -> tuple[int, int, int, int]:
    return loader.keys.reread, loader.tenants.reread, loader.deployments.reread, loader.adapters.reread


def test_an_unchanged_world_rereads_nothing_and_each_change_only_its_bucket(gateway_fleet):
    tenant = gateway_fleet["a"]
    keys = [make_key(tenant, ["inference"], name=f"k{i}")[0] for i in range(80)]
    loader = Loader()
    first = loader.load()
    _same_as_full(first)
    assert loader.keys.reread == ApiKey.objects.filter(tenant__isnull=False).count()

    again = loader.load()
    assert _reread(loader) == (0, 0, 0, 0)
    assert again.keys is first.keys and again.tenants is first.tenants and again.routes is first.routes

    # a revocation written by any path (here a bare UPDATE) is seen at the next refresh, re-reading one bucket
    ApiKey.objects.filter(pk=keys[7].pk).update(revoked_at=timezone.now())
    snap = loader.load()
    assert snap.keys[keys[7].prefix].revoked
    assert 0 < loader.keys.reread < len(keys) / 4 and _reread(loader)[1:] == (0, 0, 0)
    assert snap.tenants is first.tenants and snap.routes is first.routes
    _same_as_full(snap)

    # scopes, limits, expiry, a deleted key, a new key
    ApiKey.objects.filter(pk=keys[8].pk).update(scopes=["read"], requests_per_minute=5)
    ApiKey.objects.filter(pk=keys[9].pk).update(expires_at=timezone.now())
    gone = keys[10].prefix
    ApiKey.objects.filter(pk=keys[10].pk).delete()
    new, _ = make_key(tenant, ["inference"], name="new")
    snap = loader.load()
    assert snap.keys[keys[8].prefix].scopes == frozenset({"read"})
    assert snap.keys[keys[8].prefix].requests_per_minute == 5
    assert snap.keys[keys[9].prefix].expires_at is not None
    assert gone not in snap.keys and new.prefix in snap.keys
    _same_as_full(snap)

    # the tenant suspended, then blocked by a spend limit of 0, by bare UPDATEs
    Tenant.objects.filter(pk=tenant.pk).update(status="suspended", suspended_reason="unpaid")
    snap = loader.load()
    assert not snap.tenants[tenant.pk].active
    assert _reread(loader)[0] == 0 and loader.tenants.reread >= 1
    _same_as_full(snap)
    Tenant.objects.filter(pk=tenant.pk).update(status="active", monthly_spend_limit=0)
    snap = loader.load()
    assert snap.tenants[tenant.pk].active and snap.tenants[tenant.pk].spend_blocked
    _same_as_full(snap)


def test_routes_follow_deployments_and_servers_and_keep_their_counters(gateway_fleet):
    gen = gateway_fleet["gen"]
    tenant_id = gateway_fleet["a"].pk
    loader = Loader()
    tables = Tables(loader.load())
    up = tables.routes(tenant_id, "tiny-gen")[0]
    up.outstanding = 3

    # another tenant's server moves: this route keeps its counters (re-read or not: here one bucket holds all)
    TritonServer.objects.filter(allocation=gateway_fleet["b_gen"].allocation).update(http_port=1)
    tables.replace(loader.load())
    assert tables.routes(tenant_id, "tiny-gen")[0].outstanding == 3
    assert tables.routes(gateway_fleet["b"].pk, "secret-model")[0].base_url.endswith(":1")
    _same_as_full(tables.snap)

    # no longer ready: the route goes; ready again: it comes back
    ModelDeployment.objects.filter(pk=gen.pk).update(state=ModelDeployment.State.UNLOADING)
    tables.replace(loader.load())
    assert tables.routes(tenant_id, "tiny-gen") == []
    _same_as_full(tables.snap)
    ModelDeployment.objects.filter(pk=gen.pk).update(state=ModelDeployment.State.READY)
    tables.replace(loader.load())
    assert [u.deployment_id for u in tables.routes(tenant_id, "tiny-gen")] == [gen.pk]
    _same_as_full(tables.snap)

    # its server stopped: the route goes (a change to a joined table, not to the deployment's row)
    TritonServer.objects.filter(allocation=gen.allocation).update(state=TritonServer.State.STOPPED)
    tables.replace(loader.load())
    assert tables.routes(tenant_id, "tiny-gen") == [] and tables.routes(tenant_id, "tiny-chat") == []
    _same_as_full(tables.snap)


def test_a_table_that_outgrows_its_buckets_is_rebucketed(gateway_fleet):
    loader = Loader()
    loader.load()
    small = loader.keys.buckets
    for i in range(40 * max(1, small)):
        make_key(gateway_fleet["a"], ["inference"], name=f"g{i}")
    loader.load()  # read into the old buckets
    snap = loader.load()  # now too full: rebucketed, everything read once
    assert loader.keys.buckets > small
    _same_as_full(snap)
    loader.load()
    assert loader.keys.reread == 0


def test_a_refresh_that_fails_part_way_loses_no_change(gateway_fleet, monkeypatch):
    key, _ = make_key(gateway_fleet["a"], ["inference"])
    loader = Loader()
    loader.load()
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())
    real = loader.tenants.sync

    def down(qs):
        raise OSError("the database went away")

    monkeypatch.setattr(loader.tenants, "sync", down)  # keys are brought up to date, then the refresh fails
    with pytest.raises(OSError):
        loader.load()
    monkeypatch.setattr(loader.tenants, "sync", real)
    snap = loader.load()  # the keys' fingerprints now match: their dictionary must be rebuilt all the same
    assert snap.keys[key.prefix].revoked
    _same_as_full(snap)
