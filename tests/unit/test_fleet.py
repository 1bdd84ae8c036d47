"""Catalog seeding, node registration, placement through the database, and the constraints that
make an overlapping or illegal placement impossible, including under concurrent writers."""

from __future__ import annotations

import threading

import pytest
from django.db import IntegrityError, connection, transaction

from marketplace.hardware.geometry import all_geometries
from marketplace.hardware.nvml import NvmlClient
from marketplace.hardware.nvml_sim import SimNvml
from marketplace.models import Gpu, GpuInstance, GpuModel, GpuSlot, MigPlacement, MigProfile, Node, ServerPlatform
from marketplace.services import fleet
from marketplace.services.catalog import sync_catalog
from marketplace.services.nodes import sim_discovery
from tenants.errors import ServiceError
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db


def profile(model_key, name):
    return MigProfile.objects.get(gpu_model__key=model_key, name=name)


def test_catalog_matches_the_data_file_and_is_idempotent(catalog):
    first = sync_catalog()
    assert first == sync_catalog()
    for key, geo in all_geometries().items():
        model = GpuModel.objects.get(key=key)
        assert model.nvml_name == geo.nvml_name
        for p in geo.profiles:
            row = MigProfile.objects.get(gpu_model=model, profile_id=p.profile_id)
            assert (row.name, row.memory_slices, row.compute_slices, row.max_count) == (
                p.name, p.memory_slices, p.compute_slices, p.max_count)
            assert sorted(MigPlacement.objects.filter(profile=row).values_list("start", flat=True)) == list(p.starts)
    # NVIDIA's figures for the two sold models (MIG User Guide, Supported MIG Profiles)
    assert profile("h200-sxm-141gb", "3g.71gb").profile_id == 9
    assert list(MigPlacement.objects.filter(profile=profile("h100-sxm-80gb", "3g.40gb")).values_list(
        "start", flat=True)) == [0, 4]
    assert profile("h100-sxm-80gb", "1g.20gb").memory_slices == 2
    assert profile("h100-sxm-80gb", "1g.20gb").compute_slices == 1


def test_register_node_from_sim_discovery(h100_node):
    sim_uuids = [g.uuid for g in NvmlClient(SimNvml(fleet=["h100-sxm-80gb"] * 8, node="node-a")).open().gpus()]
    assert list(h100_node.gpus.order_by("index").values_list("uuid", flat=True)) == sim_uuids
    assert h100_node.queue == "node.node-a"
    assert all(g.mig_mode for g in h100_node.gpus.all())


def test_register_node_refuses_wrong_model_and_stores_nothing(catalog):
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    h200s = sim_discovery("node-x", ServerPlatform.objects.get(key="hgx-h200-8"))
    with pytest.raises(ServiceError, match="H200"):
        fleet.register_node("node-x", platform, h200s)
    with pytest.raises(ServiceError, match="8 GPUs"):
        fleet.register_node("node-x", platform, sim_discovery("node-x", platform)[:7])
    assert not Node.objects.exists() and not Gpu.objects.exists()


def test_place_prefers_partly_used_gpu_and_records_reason(h100_node):
    t = TenantFactory()
    model = GpuModel.objects.get(key="h100-sxm-80gb")
    a = fleet.place_instance(t, model, profile(model.key, "1g.10gb"))
    b = fleet.place_instance(t, model, profile(model.key, "1g.10gb"))
    assert a.gpu_id == b.gpu_id  # the second goes next to the first, not onto an empty GPU
    assert a.reason and "partly used" in b.reason
    assert sorted(GpuSlot.objects.filter(gpu=a.gpu).values_list("slot", flat=True)) == sorted([a.start, b.start])
    c = fleet.place_instance(t, model, profile(model.key, "3g.40gb"))
    assert c.gpu_id == a.gpu_id and c.start == 0  # the 1g pair left the 3g half at 0 free
    fleet.release_instance(a)
    assert not GpuInstance.objects.filter(pk=a.pk).exists()
    assert GpuSlot.objects.filter(gpu=a.gpu).count() == 1 + 4


def test_no_capacity_is_a_clear_error_and_stores_nothing(h100_node):
    t = TenantFactory()
    model = GpuModel.objects.get(key="h100-sxm-80gb")
    for _ in range(8):
        fleet.place_instance(t, model, profile(model.key, "7g.80gb"))
    before = GpuInstance.objects.count()
    with pytest.raises(fleet.NoCapacityError) as err:
        fleet.place_instance(t, model, profile(model.key, "1g.10gb"))
    assert "1g.10gb" in str(err.value.message) or "no" in err.value.message.lower()
    assert GpuInstance.objects.count() == before


def test_dedicated_gpu_is_never_shared(h100_node):
    a, b = TenantFactory(), TenantFactory()
    model = GpuModel.objects.get(key="h100-sxm-80gb")
    ded = fleet.place_instance(a, model, profile(model.key, "1g.10gb"), dedicated=True)
    assert Gpu.objects.get(pk=ded.gpu_id).dedicated_tenant == a
    for _ in range(7 * 7):  # fill every other GPU with tenant B's 1g slices
        try:
            inst = fleet.place_instance(b, model, profile(model.key, "1g.10gb"))
        except fleet.NoCapacityError:
            break
        assert inst.gpu_id != ded.gpu_id
    assert not GpuInstance.objects.filter(gpu_id=ded.gpu_id, tenant=b).exists()
    fleet.release_instance(ded)
    assert Gpu.objects.get(pk=ded.gpu_id).dedicated_tenant is None  # engine dedication ends when empty


def test_database_rejects_overlap_illegal_start_and_second_media_extension(h100_node):
    t = TenantFactory()
    gpu = h100_node.gpus.get(index=0)
    three_g = profile("h100-sxm-80gb", "3g.40gb")
    inst = GpuInstance.objects.create(gpu=gpu, placement=MigPlacement.objects.get(profile=three_g, start=0),
                                      tenant=t, start=0, size=4)
    GpuSlot.objects.bulk_create([GpuSlot(gpu=gpu, slot=s, instance=inst) for s in range(4)])
    other = GpuInstance.objects.create(gpu=gpu, placement=MigPlacement.objects.get(
        profile=profile("h100-sxm-80gb", "2g.20gb"), start=2), tenant=t, start=2, size=2)
    with pytest.raises(IntegrityError), transaction.atomic():
        GpuSlot.objects.create(gpu=gpu, slot=3, instance=other)
    # a 3g at start 2 has no placement row, and no row can be made that leaves the GPU
    assert not MigPlacement.objects.filter(profile=three_g, start=2).exists()
    with pytest.raises(IntegrityError), transaction.atomic():
        MigPlacement.objects.create(profile=three_g, start=6, size=4)
    me = MigPlacement.objects.get(profile=profile("h100-sxm-80gb", "1g.10gb+me"), start=5)
    GpuInstance.objects.create(gpu=gpu, placement=me, tenant=t, start=5, size=1, media_extensions=True)
    with pytest.raises(IntegrityError), transaction.atomic():
        GpuInstance.objects.create(gpu=gpu, placement=MigPlacement.objects.get(profile=me.profile, start=6),
                                   tenant=t, start=6, size=1, media_extensions=True)
    with pytest.raises(IntegrityError), transaction.atomic():
        GpuSlot.objects.create(gpu=gpu, slot=8, instance=inst)


def test_every_engine_placement_is_accepted_by_the_simulator(h100_node):
    model = GpuModel.objects.get(key="h100-sxm-80gb")
    names = ["1g.10gb", "3g.40gb", "2g.20gb", "1g.20gb", "1g.10gb+me", "4g.40gb", "1g.10gb", "2g.20gb", "7g.80gb"]
    tenants = [TenantFactory() for _ in range(3)]
    sim = SimNvml(fleet=["h100-sxm-80gb"] * 8, node="node-a")
    client = NvmlClient(sim).open()
    placed = 0
    for i in range(40):
        try:
            inst = fleet.place_instance(tenants[i % 3], model, profile(model.key, names[i % len(names)]))
        except fleet.NoCapacityError:
            continue
        s = client.create_slice(inst.gpu.index, inst.placement.profile.profile_id, inst.start)
        assert (s.start, s.size) == (inst.start, inst.size)
        placed += 1
        if i % 5 == 4:  # release one now and then, on both sides
            victim = GpuInstance.objects.select_related("gpu", "placement__profile").order_by("?").first()
            gi = next(x.gi_id for x in client.slices(victim.gpu.index) if x.start == victim.start)
            assert client.destroy_slice(victim.gpu.index, gi)
            fleet.release_instance(victim)
    assert placed >= 20
    for gpu in h100_node.gpus.all():
        db = sorted((i.start, i.size) for i in gpu.instances.all())
        assert db == sorted((s.start, s.size) for s in client.slices(gpu.index))


needs_pg = pytest.mark.skipif("connection.vendor != 'postgresql'", reason="concurrent writers need PostgreSQL")


@needs_pg
@pytest.mark.django_db(transaction=True)
def test_concurrent_overlapping_slot_writes_exactly_one_wins(h100_node):
    t = TenantFactory()
    gpu = h100_node.gpus.get(index=0)
    pl = {s: MigPlacement.objects.get(profile=profile("h100-sxm-80gb", "2g.20gb"), start=s) for s in (0, 2)}
    big = MigPlacement.objects.get(profile=profile("h100-sxm-80gb", "3g.40gb"), start=0)
    barrier = threading.Barrier(2)
    outcomes = []

    def writer(placement, size):
        try:
            with transaction.atomic():
                inst = GpuInstance.objects.create(gpu=gpu, placement=placement, tenant=t,
                                                  start=placement.start, size=size)
                barrier.wait(timeout=10)
                GpuSlot.objects.bulk_create([GpuSlot(gpu=gpu, slot=s, instance=inst) for s in inst.slot_range])
            outcomes.append("ok")
        except IntegrityError:
            outcomes.append("conflict")
        finally:
            connection.close()

    threads = [threading.Thread(target=writer, args=(big, 4)), threading.Thread(target=writer, args=(pl[2], 2))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(outcomes) == ["conflict", "ok"]
    assert GpuInstance.objects.count() == 1
    assert GpuSlot.objects.filter(gpu=gpu).count() == GpuInstance.objects.get().size


@needs_pg
@pytest.mark.django_db(transaction=True)
def test_two_concurrent_placements_for_the_last_slot_one_wins(catalog):
    platform = ServerPlatform.objects.get(key="hgx-h100-8")
    node = fleet.register_node("node-b", platform, sim_discovery("node-b", platform))
    model = GpuModel.objects.get(key="h100-sxm-80gb")
    t1, t2 = TenantFactory(), TenantFactory()
    # leave exactly one free 1g.10gb placement in the whole node
    for gpu in node.gpus.exclude(index=0):
        Gpu.objects.filter(pk=gpu.pk).update(state=Gpu.State.MAINTENANCE)
    for _ in range(6):
        fleet.place_instance(t1, model, profile(model.key, "1g.10gb"))
    barrier = threading.Barrier(2)
    results = []

    def order(tenant):
        try:
            barrier.wait(timeout=10)
            results.append(fleet.place_instance(tenant, model, profile(model.key, "1g.10gb")).pk)
        except fleet.NoCapacityError as e:
            results.append(e.message)
        finally:
            connection.close()

    threads = [threading.Thread(target=order, args=(t,)) for t in (t1, t2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    wins = [r for r in results if isinstance(r, int)]
    assert len(wins) == 1, results
    assert GpuInstance.objects.count() == 7
    assert GpuSlot.objects.filter(gpu=node.gpus.get(index=0)).count() == 7
