"""The portal catalog's availability (read as plain values) against an independent oracle and against what the
placement service accepts, on random fleets stored in the database: healthy and faulted GPUs, ready and
draining nodes, MIG on and off, GPUs dedicated (sticky or not) to one tenant or shared, random valid layouts.

The oracle reads the same GPUs as model instances and applies the MIG rules and the tenancy rule written out
in tests/unit/test_placement.py (``oracle_fits``, ``oracle_tenancy_ok``), not the engine's tables."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from marketplace.hardware.geometry import geometry
from marketplace.models import Gpu, GpuInstance, GpuModel, GpuSlot, MigPlacement, Node, ServerPlatform, Tier
from marketplace.placement import GpuState, Instance, Request
from marketplace.selectors import catalog as catalog_sel
from marketplace.services.fleet import NoCapacityError, place_instance
from tests.factories import TenantFactory
from tests.unit.test_placement import oracle_fits, oracle_tenancy_ok

pytestmark = pytest.mark.django_db


def _random_layout(rng: random.Random, geo_key: str, mig: bool) -> list[tuple[int | None, int]]:
    """A valid layout, grown one random fitting (profile, start) at a time (whole GPU when MIG is off)."""
    if not mig:
        return [(None, 0)] if rng.random() < 0.4 else []
    g = geometry(geo_key)
    layout: list[Instance] = []
    for _ in range(rng.randint(0, 5)):
        fits = [(p.profile_id, s) for p in g.profiles for s in p.starts
                if oracle_fits(geo_key, layout, p.profile_id, s)]
        if not fits:
            break
        pid, start = rng.choice(fits)
        layout.append(Instance(pid, start, 0))
    return [(i.profile_id, i.start) for i in layout]


def _build_fleet(rng: random.Random, tenants) -> None:
    platforms = list(ServerPlatform.objects.filter(key__in=["hgx-h100-8", "hgx-h200-8"]).select_related("gpu_model"))
    placements = {(p.profile.gpu_model_id, p.profile.profile_id, p.start): p
                  for p in MigPlacement.objects.select_related("profile")}
    for n in range(rng.randint(1, 3)):
        platform = rng.choice(platforms)
        # its worker heard from just now, long ago (stale), or never (registered by an operator, worker not started)
        heard = rng.choice([timezone.now()] * 4 + [timezone.now() - timedelta(hours=2), None])
        node = Node.objects.create(hostname=f"rand-{n}", platform=platform, queue=f"node.rand-{n}",
                                   state=rng.choice([Node.State.READY] * 3 + [Node.State.DRAINING]),
                                   last_heartbeat=heard)
        model = platform.gpu_model
        for index in range(rng.randint(1, 4)):
            mig = rng.random() < 0.8
            layout = _random_layout(rng, model.key, mig)
            owner = rng.choice([None, None, *tenants[:2]])
            # the engine's own dedication (not sticky) ends with the GPU's last instance (services.fleet.release)
            sticky = owner is not None and (not layout or rng.random() < 0.5)
            gpu = Gpu.objects.create(node=node, index=index, uuid=f"GPU-rand-{n}-{index}", gpu_model=model,
                                     mig_mode=mig, state=rng.choice([Gpu.State.OK] * 4 + [Gpu.State.FAULTED]),
                                     dedicated_tenant=owner, dedicated_sticky=sticky)
            for pid, start in layout:
                placement = None if pid is None else placements[(model.pk, pid, start)]
                size = 8 if placement is None else placement.size
                inst = GpuInstance.objects.create(gpu=gpu, placement=placement, start=start, size=size,
                                                  tenant=owner or rng.choice(tenants))
                GpuSlot.objects.bulk_create([GpuSlot(gpu=gpu, slot=s, instance=inst)
                                             for s in range(start, start + size)])


def _tiers() -> list[Tier]:
    out = []
    for model in GpuModel.objects.filter(key__in=["h100-sxm-80gb", "h200-sxm-141gb"]):
        short = model.key.split("-")[0]
        out.append(Tier.objects.create(key=f"{short}-whole", name="whole", gpu_model=model, profile=None))
        for profile in model.profiles.all():
            for dedicated in (False, True):
                out.append(Tier.objects.create(key=f"{short}-{profile.profile_id}-{int(dedicated)}", name="t",
                                               gpu_model=model, profile=profile, dedicated=dedicated))
    return list(Tier.objects.filter(pk__in=[t.pk for t in out]).select_related("gpu_model", "profile"))


def _oracle(tier: Tier, tenant_id: int) -> list[tuple[int, int]]:
    """Every (GPU id, start) where the tier's request could go, from model instances and the written-out rules."""
    pid = None if tier.profile is None else tier.profile.profile_id
    request = Request(tier.gpu_model.key, tenant_id, profile_id=pid, whole_gpu=pid is None, dedicated=tier.dedicated)
    hosts = []
    for gpu in (Gpu.objects.filter(gpu_model=tier.gpu_model, mig_mode=pid is not None)
                .select_related("node", "gpu_model").prefetch_related("instances__placement__profile")):
        if gpu.state != Gpu.State.OK or gpu.node.state != Node.State.READY:
            continue
        heard = gpu.node.last_heartbeat  # a node takes work only while its worker is heard from
        if heard is None or (timezone.now() - heard).total_seconds() > settings.TESSERA_NODE_HEARTBEAT_STALE_S:
            continue
        insts = [Instance(i.placement.profile.profile_id if i.placement else None, i.start, i.tenant_id)
                 for i in gpu.instances.all()]
        state = GpuState(gpu.pk, gpu.gpu_model.key, gpu.node_id, insts, gpu.dedicated_tenant_id)
        if not oracle_tenancy_ok(state, request):
            continue
        starts = (0,) if pid is None else geometry(gpu.gpu_model.key).profile_by_id(pid).starts
        hosts += [(gpu.pk, s) for s in starts if oracle_fits(gpu.gpu_model.key, insts, pid, s)]
    return hosts


@pytest.mark.parametrize("seed", range(12))
def test_availability_is_what_placement_accepts(catalog, monkeypatch, seed):
    monkeypatch.setattr(catalog_sel, "AVAILABILITY_CAP", 10**6)  # exact counts here; the cap is tested elsewhere
    rng = random.Random(seed)
    tenants = [TenantFactory() for _ in range(3)]
    _build_fleet(rng, tenants)
    tiers = _tiers()
    for _step in range(6):
        tenant = rng.choice(tenants)
        free = catalog_sel.availability(tiers, tenant.pk)
        for tier in tiers:
            assert free[tier.pk] == len(_oracle(tier, tenant.pk)), (seed, tier.key, tenant.pk)
        # what the catalog shows as free is what the placement service then accepts (and only that)
        tier = rng.choice(tiers)
        hosts = _oracle(tier, tenant.pk)
        if not hosts:
            with pytest.raises(NoCapacityError):
                place_instance(tenant, tier.gpu_model, tier.profile, dedicated=tier.dedicated)
        else:
            inst = place_instance(tenant, tier.gpu_model, tier.profile, dedicated=tier.dedicated)
            assert (inst.gpu_id, inst.start) in hosts, (seed, tier.key)


def test_availability_caps_and_reads_in_two_queries(catalog, django_assert_num_queries):
    rng = random.Random(99)
    tenants = [TenantFactory() for _ in range(3)]
    _build_fleet(rng, tenants)
    tiers = _tiers()
    with django_assert_num_queries(2):
        free = catalog_sel.availability(tiers, tenants[0].pk)
    for tier in tiers:
        n = len(_oracle(tier, tenants[0].pk))
        assert free[tier.pk] == (n if n <= catalog_sel.AVAILABILITY_CAP else f"{catalog_sel.AVAILABILITY_CAP}+")
