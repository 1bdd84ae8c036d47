"""Deploying a tenant's own repository and library models (simulated Triton; real ones in
tests/integration/test_model_upload_real.py): the memory fit refuses what does not fit, with the numbers."""

from __future__ import annotations

import json
import math

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from marketplace.hardware import model_repo
from marketplace.hardware.triton import parse_config, parse_model_config
from marketplace.models import Allocation, LibraryModel, ModelDeployment, ModelRepository
from marketplace.services import deployments, orders, provisioning
from marketplace.services import models as model_svc
from tenants.errors import ServiceError
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, validated
from tests.unit.test_model_repo import CONFIG, GOOD

pytestmark = pytest.mark.django_db
D = ModelDeployment.State


@pytest.fixture
def owner(h100_node):
    tenant = TenantFactory(slug="acme")
    return tenant, principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)


def slice_of(owner, tier):
    tenant, p = owner
    a = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    assert provisioning.provision(a.pk) == "activated"
    return Allocation.objects.select_related("tier__profile", "tier__gpu_model", "node").get(pk=a.pk)


def upload(owner, files=GOOD, name="echo-repo", kind="tar"):
    """Uploaded (the web request) and validated (the control worker's task, in-line)."""
    tenant, p = owner
    f = SimpleUploadedFile(f"repo.{'zip' if kind == 'zip' else 'tar.gz'}", model_repo.archive_bytes(files, kind))
    return validated(model_svc.upload_repository(p, tenant, name, f))


def test_uploaded_repository_deploys_loads_and_is_removed(owner, tiers, settings):
    repo = upload(owner)
    assert repo.manifest[0]["name"] == "echo" and len(repo.archive_sha256) == 64
    assert (settings.TESSERA_UPLOAD_ROOT / repo.path / "echo/1/model.py").is_file()
    a = slice_of(owner, tiers["1g"])
    dep = deployments.deploy(owner[1], a, "", repository=repo)
    assert dep.name == "echo" and dep.memory_mb == 1 + 512  # files' size (rounded up to 1 MiB) + python overhead
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    slice_repo = deployments.repo_dir(a)
    assert parse_config((slice_repo / "echo/config.pbtxt").read_text()).backend == "python"
    assert deployments.backend_for(a).is_model_ready("echo")
    deployments.remove(owner[1], dep)
    assert deployments.unload(dep.pk) == "removed" and not (slice_repo / "echo").exists()
    with pytest.raises(ServiceError, match="several|exists"):
        upload(owner)  # the same name again


def test_refused_upload_stores_nothing(owner, settings):
    with pytest.raises(ServiceError, match="path traversal") as exc:
        upload(owner, files={**GOOD, "../evil": "x"})
    assert exc.value.field == "archive"
    assert not ModelRepository.objects.exists()
    assert not any(settings.TESSERA_UPLOAD_ROOT.rglob("*.py"))
    settings.TESSERA_UPLOAD_MAX_BYTES = 10
    with pytest.raises(ServiceError, match="the limit is 10"):
        upload(owner)


def test_import_from_the_model_store(owner, settings):
    src = settings.TESSERA_MODEL_STORE_ROOT / "tenants-shared" / "echo"
    for k, v in GOOD.items():
        (src / k).parent.mkdir(parents=True, exist_ok=True)
        (src / k).write_text(v)
    tenant, p = owner
    repo = validated(model_svc.import_from_store(p, tenant, "from-store", "tenants-shared/echo"))
    assert repo.source == "store" and repo.state == "ready" and repo.manifest[0]["name"] == "echo"
    for bad in ("../etc", "/etc", "nope/x", "a\x00b"):
        with pytest.raises(ServiceError) as exc:
            model_svc.import_from_store(p, tenant, "bad", bad)
        assert exc.value.field == "store_path"


def test_declared_memory_sums_and_tier_backend_allow_list(owner, tiers):
    cfg = CONFIG + 'parameters { key: "tessera_memory_mb" value { string_value: "6000" } }\n'
    repo = upload(owner, files={**GOOD, "echo/config.pbtxt": cfg})
    a = slice_of(owner, tiers["1g"])  # 9,984 MiB
    deployments.deploy(owner[1], a, "small", template="tiny-gen", spec={"memory_mb": 4000})
    with pytest.raises(ServiceError, match="does not fit") as exc:
        deployments.deploy(owner[1], a, "", repository=repo)
    assert "6,512 MiB" in str(exc.value) and "4,000 of 9,984 MiB" in str(exc.value)
    tiers["1g"].allowed_backends = "onnxruntime"
    tiers["1g"].save()
    with pytest.raises(ServiceError, match="backend python is not offered"):
        deployments.deploy(owner[1], a, "two", template="tiny-gen", spec={"memory_mb": 10})


def test_library_vllm_repository_written_from_the_fit(owner, tiers, settings):
    m = LibraryModel.objects.get(key="llama-3.1-8b-instruct")  # seeded by the migration
    a = slice_of(owner, tiers["7g"])
    dep = deployments.deploy(owner[1], a, "llama8b", library_model=m, context=8192, concurrency=8)
    f = dep.spec["fit"]
    weights_mib = 8030261248 * 2 / 2**20  # 15,316.5 MiB at BF16
    assert f["fits"] and dep.memory_mb == f["needed_mib"] == math.ceil(weights_mib + 3072 + 8192 * 8 * 128 / 1024)
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    folder = deployments.repo_dir(a) / "llama8b"
    parse_model_config((folder / "config.pbtxt").read_text())
    args = json.loads((folder / "1/model.json").read_text())
    assert args["max_model_len"] == 8192 and args["max_num_seqs"] == 8 and args["dtype"] == "bfloat16"
    assert args["gpu_memory_utilization"] == math.ceil(dep.memory_mb / 81152 * 100) / 100
    assert args["gpu_memory_utilization"] * 81152 >= dep.memory_mb
    assert args["model"] == str(settings.TESSERA_MODEL_STORE_ROOT / "meta-llama/Llama-3.1-8B-Instruct")
    # the longest context that fits when none is asked for
    dep2 = deployments.deploy(owner[1], a, "llama8b-b", library_model=m, concurrency=1)
    assert dep2.context == m.max_context  # 131,072 tokens still fit beside the first


def test_library_model_that_does_not_fit_is_refused_with_numbers(owner, tiers):
    a = slice_of(owner, tiers["7g"])
    m70 = LibraryModel.objects.get(key="llama-3.1-70b-instruct")
    with pytest.raises(ServiceError, match=r"weights and runtime alone need 137,643 MiB, 81,152 MiB are free"):
        deployments.deploy(owner[1], a, "llama70b", library_model=m70, context=4096)
    fp8 = LibraryModel.objects.get(key="llama-3.1-70b-instruct-fp8")
    with pytest.raises(ServiceError, match="at most 34,543 cached tokens") as exc:
        deployments.deploy(owner[1], a, "llama70b", library_model=fp8, context=65536)
    assert exc.value.field == "context"
    assert deployments.deploy(owner[1], a, "llama70b", library_model=fp8, context=32768).memory_mb <= 81152
    assert ModelDeployment.objects.filter(allocation=a).count() == 1


def test_tensorrtllm_ensemble_layout_validates_with_triton_schema(owner, tiers):
    m = LibraryModel.objects.get(key="qwen2.5-7b-instruct")
    m.backend = "tensorrtllm"
    from marketplace import fit

    result = fit.fit(model_svc.library_shape(m), 40448, context=4096, concurrency=4)
    files = model_svc.library_files("qwen", m, result, concurrency=4)
    assert model_svc.model_names(files) == ["qwen", "qwen-llm", "qwen-post", "qwen-pre"]
    ens = parse_model_config(files["qwen/config.pbtxt"])
    assert ens.platform == "ensemble" and [s.model_name for s in ens.ensemble_scheduling.step] == [
        "qwen-pre", "qwen-llm", "qwen-post"]
    llm = parse_model_config(files["qwen-llm/config.pbtxt"])
    assert llm.backend == "tensorrtllm"
    assert llm.parameters["max_tokens_in_paged_kv_cache"].string_value == str(4096 * 4)
