"""Triton model deployments on a slice, with the simulated Triton server (the real one is in
tests/integration/test_triton_deploy.py)."""

from __future__ import annotations

import pytest

from marketplace.hardware.triton import parse_config
from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning
from tenants.errors import Conflict, ServiceError
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, make_key

pytestmark = pytest.mark.django_db
D = ModelDeployment.State


@pytest.fixture
def active(h100_node, tiers):
    tenant = TenantFactory(slug="acme")
    owner = MembershipFactory(tenant=tenant, role=Role.OWNER).user
    p = principal_for_user(owner)
    a = orders.create_order(p, tenant=tenant, tier=tiers["1g"]).allocations.get()
    provisioning.provision(a.pk)
    return p, Allocation.objects.get(pk=a.pk)


def test_deploy_writes_repository_loads_and_serves(active):
    p, a = active
    dep = deployments.deploy(p, a, "tiny-gen", template="tiny-gen")
    assert dep.state == D.PENDING
    assert deployments.load(dep.pk) == "ready"
    dep.refresh_from_db()
    assert dep.state == D.READY and dep.ready_at
    repo = deployments.repo_dir(a)
    cfg = parse_config((repo / "tiny-gen" / "config.pbtxt").read_text())
    assert cfg.name == "tiny-gen" and (repo / "tiny-gen" / "1" / "model.py").exists()
    server = deployments.backend_for(a)
    out = server.infer_text("tiny-gen", "the quick brown fox", max_tokens=6)
    assert out["input_tokens"] == 4 and out["output_tokens"] == 6 and out["text"]
    assert server.statistics("tiny-gen")["inference_count"] == 1
    assert deployments.load(dep.pk).startswith("nothing to do")  # a replayed task is harmless
    deployments.remove(p, dep)
    assert deployments.unload(dep.pk) == "removed"
    assert not (repo / "tiny-gen").exists() and not server.is_model_ready("tiny-gen")


def test_several_models_per_slice_and_memory_refusal(active):
    p, a = active
    cap = deployments.slice_memory_mb(a)  # 1g.10gb: 9984 MiB
    deployments.deploy(p, a, "m1", template="tiny-gen", spec={"memory_mb": 4000})
    deployments.deploy(p, a, "m2", template="tiny-gen", spec={"memory_mb": 4000})
    with pytest.raises(ServiceError, match="does not fit") as err:
        deployments.deploy(p, a, "m3", template="tiny-gen", spec={"memory_mb": cap - 7999})
    assert err.value.field == "spec"
    assert ModelDeployment.objects.filter(allocation=a).count() == 2
    with pytest.raises(Conflict):
        deployments.deploy(p, a, "m1", template="tiny-gen")


def test_deploy_needs_an_active_slice_and_valid_spec(active, tiers):
    p, a = active
    Allocation.objects.filter(pk=a.pk).update(state=Allocation.State.RELEASING)
    with pytest.raises(Conflict, match="active"):
        deployments.deploy(p, a, "x", template="tiny-gen")
    Allocation.objects.filter(pk=a.pk).update(state=Allocation.State.ACTIVE)
    for bad in [{"backend": "nope", "memory_mb": 10}, {"backend": "python", "max_batch_size": -1, "memory_mb": 1},
                {"backend": "python", "memory_mb": 0, "files": {"model.py": "x"}}]:
        with pytest.raises(ServiceError):
            deployments.deploy(p, a, "x", spec=bad)
    assert not ModelDeployment.objects.exists()


def test_release_unloads_models_first(active):
    p, a = active
    dep = deployments.deploy(p, a, "tiny-gen", template="tiny-gen")
    deployments.load(dep.pk)
    orders.request_release(p, a)
    provisioning.release_allocation(a.pk)
    assert ModelDeployment.objects.get(pk=dep.pk).state == D.REMOVED
    assert Allocation.objects.get(pk=a.pk).state == Allocation.State.RELEASED


def test_deployments_api_and_isolation(as_key, active, world):
    p, a = active
    _, secret = make_key(a.tenant, ["deployments:write", "read"])
    api = as_key(secret)
    r = api.post("/api/v1/deployments/", {"allocation": a.pk, "name": "tiny-gen", "template": "tiny-gen"})
    assert r.status_code == 201, r.content
    assert r.json()["state"] == "pending" and r.json()["spec"]["files"] == ["model.py"]
    for bad, field in [({"allocation": a.pk, "name": "bad name!", "template": "tiny-gen"}, "name"),
                       ({"allocation": a.pk, "name": "x", "template": "nope"}, "template"),
                       ({"allocation": 999999, "name": "x", "template": "tiny-gen"}, "allocation"),
                       ({"allocation": a.pk, "name": "x", "spec": {"backend": "python"}}, "spec")]:
        r = api.post("/api/v1/deployments/", bad, format="json")
        assert r.status_code == 400 and field in r.json(), (bad, r.content)
    assert ModelDeployment.objects.count() == 1
    other = as_key(world["secret_a"])  # tenant "alpha"
    dep_id = ModelDeployment.objects.get().pk
    assert other.get(f"/api/v1/deployments/{dep_id}/").status_code == 404
    assert other.delete(f"/api/v1/deployments/{dep_id}/").status_code == 404
    r = other.post("/api/v1/deployments/", {"allocation": a.pk, "name": "spy", "template": "tiny-gen"})
    assert r.status_code == 400 and "allocation" in r.json()
    assert as_key(secret).delete(f"/api/v1/deployments/{dep_id}/").status_code == 202
