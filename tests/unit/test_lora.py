"""LoRA adapters per tenant on a library base model: validated like repositories, deployed with their base by
vLLM multi-LoRA (model.json enable_lora / max_loras / max_lora_rank, multi_lora.json), counted by the fit."""

from __future__ import annotations

import io
import json
import math

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from marketplace.hardware import model_repo as mr
from marketplace.models import LibraryModel, LoraAdapter
from marketplace.services import deployments
from marketplace.services import models as model_svc
from tenants.errors import ServiceError
from tests.factories import validated
from tests.unit.test_model_deploy import owner, slice_of  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db
WEIGHTS = b"\1" * (3 * 1024 * 1024 + 5)  # 3 MiB and a bit: 4 MiB in the fit
ADAPTER = {"sql-lora/adapter_config.json": json.dumps({"r": 16, "base_model_name_or_path": "meta-llama/Llama-3.1-8B",
                                                       "target_modules": ["q_proj", "v_proj"]}),
           "sql-lora/adapter_model.safetensors": WEIGHTS}


def upload(owner, name="sql", files=ADAPTER, base="llama-3.1-8b-instruct"):  # noqa: F811
    """Uploaded (the web request) and validated (the control worker's task, in-line)."""
    tenant, p = owner
    f = SimpleUploadedFile("a.tar.gz", mr.archive_bytes(files))
    return validated(model_svc.upload_adapter(p, tenant, name, LibraryModel.objects.get(key=base), f))


@pytest.mark.parametrize("files,needle", [
    ({"x/adapter_model.safetensors": b"x"}, "no adapter_config.json"),
    ({"adapter_config.json": '{"r": 0}', "adapter_model.safetensors": b"x"}, "LoRA rank"),
    ({"adapter_config.json": "{nope", "adapter_model.safetensors": b"x"}, "not valid JSON"),
    ({"adapter_config.json": '{"r": 8}'}, "no adapter_model"),
    ({**ADAPTER, "../../etc/x": "x"}, "path traversal"),
])
def test_adapter_validation(tmp_path, files, needle):
    with pytest.raises(mr.RepoError, match=needle):
        mr.import_repository(io.BytesIO(mr.archive_bytes(files)), tmp_path / "a", mr.Limits(),
                             validate=mr.validate_adapter)
    assert not (tmp_path / "a").exists()


def test_adapters_deploy_with_their_base_and_count_in_the_fit(owner, tiers, settings):  # noqa: F811
    sql = upload(owner)
    chat = upload(owner, "chat", {**ADAPTER, "sql-lora/adapter_config.json": json.dumps({"r": 40})})
    assert (sql.rank, chat.rank, sql.target_modules) == (16, 40, ["q_proj", "v_proj"])
    a = slice_of(owner, tiers["7g"])
    base = LibraryModel.objects.get(key="llama-3.1-8b-instruct")
    plain = deployments.deploy(owner[1], a, "plain", library_model=base, context=4096)
    dep = deployments.deploy(owner[1], a, "tuned", library_model=base, context=4096, adapters=[sql, chat])
    assert dep.memory_mb - plain.memory_mb == 2 * math.ceil(len(WEIGHTS) / 2**20)  # the adapters' memory
    assert {x.name for x in dep.adapters.all()} == {"sql", "chat"}
    assert deployments.load(dep.pk) == "ready"
    folder = deployments.repo_dir(a) / "tuned" / "1"
    args = json.loads((folder / "model.json").read_text())
    assert args["enable_lora"] == "true" and args["max_loras"] == 2 and args["max_lora_rank"] == 64
    assert json.loads((folder / "multi_lora.json").read_text()) == {  # copied into the slice's repository
        "chat": str(folder / "loras" / "chat"), "sql": str(folder / "loras" / "sql")}
    assert (folder / "loras/sql/adapter_model.safetensors").read_bytes() == WEIGHTS
    stored = settings.TESSERA_UPLOAD_ROOT / sql.path
    assert (stored.stat().st_mode & 0o777) == 0o700  # the upload root is Tessera's own, not the tenants' models'
    assert ((stored / "adapter_model.safetensors").stat().st_mode & 0o777) == 0o600
    assert deployments.load(dep.pk).startswith("nothing to do")
    assert not (deployments.repo_dir(a) / "plain" / "1" / "multi_lora.json").exists()
    with pytest.raises(ServiceError, match="deployed"):
        model_svc.delete_adapter(owner[1], sql)


def test_adapter_needs_its_own_base_and_a_vllm_base(owner, tiers):  # noqa: F811
    sql = upload(owner)
    a = slice_of(owner, tiers["7g"])
    qwen = LibraryModel.objects.get(key="qwen2.5-7b-instruct")
    with pytest.raises(ServiceError, match="another base model"):
        deployments.deploy(owner[1], a, "q", library_model=qwen, context=4096, adapters=[sql])
    with pytest.raises(ServiceError, match="library base model"):
        deployments.deploy(owner[1], a, "t", template="tiny-gen", adapters=[sql])
    LibraryModel.objects.filter(key="qwen2.5-7b-instruct").update(backend="tensorrtllm")
    with pytest.raises(ServiceError, match="served by vLLM"):
        upload(owner, "q-lora", base="qwen2.5-7b-instruct")
    assert LoraAdapter.objects.count() == 1


def test_adapter_api_upload_and_deploy(api, world, h100_node, tiers):
    c = api
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {world['secret_a']}")
    r = c.post("/api/v1/lora-adapters/", {"name": "sql", "base": "llama-3.1-8b-instruct",
                                          "archive": SimpleUploadedFile("a.zip", mr.archive_bytes(ADAPTER, "zip"))},
               format="multipart")
    assert r.status_code == 202, r.content
    assert r.json()["state"] == "validating" and r["Location"] == r.json()["url"]
    validated(LoraAdapter.objects.get(pk=r.json()["id"]))
    assert c.get(r.json()["url"]).json()["rank"] == 16
    r = c.post("/api/v1/lora-adapters/", {"name": "bad", "base": "llama-3.1-8b-instruct",
                                          "archive": SimpleUploadedFile("a.zip", mr.archive_bytes(
                                              {"adapter_config.json": "{}"}, "zip"))}, format="multipart")
    assert r.status_code == 202
    validated(LoraAdapter.objects.get(pk=r.json()["id"]))
    body = c.get(r.json()["url"]).json()
    assert body["state"] == "failed" and "adapter_config.json" in body["failure_reason"]
