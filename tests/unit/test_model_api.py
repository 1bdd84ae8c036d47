"""The models API: multipart upload of a repository (400 naming the file, nothing stored), the library with its
fit per tier, find-a-tier, and deployments of a repository's model or a library model."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from marketplace.hardware import model_repo
from marketplace.models import Allocation, LibraryModel, LoraAdapter, ModelDeployment, ModelRepository
from marketplace.services import orders, provisioning
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, make_key, validated
from tests.unit.test_model_repo import GOOD

pytestmark = pytest.mark.django_db


@pytest.fixture
def key_a(world):
    return world["secret_a"]


def archive(files=GOOD, kind="tar"):
    return SimpleUploadedFile("repo.zip" if kind == "zip" else "repo.tar.gz", model_repo.archive_bytes(files, kind))


def test_upload_multipart_then_list_and_detail(api, as_key, key_a, h100_node, world, settings):
    c = as_key(key_a)
    r = c.post("/api/v1/model-repositories/", {"name": "echo-repo", "archive": archive(kind="zip")},
               format="multipart")
    assert r.status_code == 202, r.content  # stored; a control worker unpacks and validates it
    body = r.json()
    assert body["state"] == "validating" and body["manifest"] == [] and body["failure_reason"] == ""
    assert r["Location"] == body["url"] and body["url"].endswith(f"/api/v1/model-repositories/{body['id']}/")
    assert type(r.headers["Location"]) is str  # exactly: wsgiref (runserver, the demo) refuses a str subclass
    validated(ModelRepository.objects.get(pk=body["id"]))
    body = c.get(body["url"]).json()
    assert body["state"] == "ready" and body["validated_at"]
    assert body["manifest"][0]["name"] == "echo" and body["source"] == "upload" and body["file_count"] == 2
    assert c.get("/api/v1/model-repositories/").json()["count"] == 1
    assert c.get("/api/v1/model-repositories/?state=validating").json()["count"] == 0
    _k, secret_b = make_key(world["b"], ["read", "deployments:write"])
    other = as_key(secret_b)
    assert other.get(f"/api/v1/model-repositories/{body['id']}/").status_code == 404
    assert other.get("/api/v1/model-repositories/").json()["count"] == 0


def test_refused_upload_names_the_file_and_stores_nothing(as_key, key_a, h100_node, settings):
    needle = "../x: path traversal"  # the archive's headers show it: refused by the request itself
    r = as_key(key_a).post("/api/v1/model-repositories/", {"name": "bad", "archive": archive({**GOOD, "../x": "x"})},
                           format="multipart")
    assert r.status_code == 400 and needle in r.content.decode()
    assert needle in r.json()["archive"][0]  # the field error names the file
    assert not ModelRepository.objects.exists()
    assert not any(p.is_file() for p in settings.TESSERA_UPLOAD_ROOT.rglob("*"))


def test_a_repository_failing_validation_says_why_and_keeps_nothing(as_key, key_a, h100_node, settings):
    needle = "echo/config.pbtxt: not a valid Triton model configuration"  # found by the worker
    c = as_key(key_a)
    r = c.post("/api/v1/model-repositories/", {"name": "bad", "archive": archive(
        {**GOOD, "echo/config.pbtxt": "nonsense: 1"})}, format="multipart")
    assert r.status_code == 202
    validated(ModelRepository.objects.get(pk=r.json()["id"]))
    body = c.get(r.json()["url"]).json()
    assert body["state"] == "failed" and body["failure_reason"].startswith(needle) and body["manifest"] == []
    assert not any(p.is_file() for p in settings.TESSERA_UPLOAD_ROOT.rglob("*"))  # nor the archive
    r = c.post("/api/v1/model-repositories/", {"name": "bad", "archive": archive()}, format="multipart")
    assert r.status_code == 202  # the failed one's name is free again: it is replaced
    assert list(ModelRepository.objects.values_list("state", flat=True)) == ["validating"]


def test_upload_needs_the_deploy_capability(as_user, members_a, h100_node):
    r = as_user(members_a[Role.VIEWER]).post("/api/v1/model-repositories/",
                                             {"name": "x", "tenant": "alpha", "archive": archive()},
                                             format="multipart")
    assert r.status_code == 403 and not ModelRepository.objects.exists()


def test_library_lists_seeded_models_with_figures(as_key, key_a, catalog):
    r = as_key(key_a).get("/api/v1/library/?search=llama")
    rows = {m["key"]: m for m in r.json()["results"]}
    assert rows["llama-3.1-8b-instruct"]["kv_cache_bytes_per_token"] == 131072
    assert rows["llama-3.1-70b-instruct"]["weights_mib"] == 134571
    assert "huggingface.co/meta-llama" in rows["llama-3.1-8b-instruct"]["source_url"]


def test_find_tier_never_ranks_another_models_measured_figure(as_key, key_a, tiers, monkeypatch):
    """A shape's measured tokens/s comes from whatever its slices served (the demo's toy model: thousands of
    tokens/s): every tier is ranked on this model's modelled figure, and the measured one is shown beside it."""
    from marketplace.selectors import models as model_sel

    c = as_key(key_a)
    body = {"library_model": "llama-3.1-8b-instruct", "context": 8192, "concurrency": 4}
    before = c.post("/api/v1/find-tier/", body, format="json").json()["tiers"]
    real = model_sel.shape_figures

    def toy_measured(since, until):
        figures = real(since, until)
        for f in figures:
            if f.profile is not None and f.profile.name == "3g.40gb" and f.gpu_model.key == "h100-sxm-80gb":
                f.measured_tps = 250_000.0
        return figures

    monkeypatch.setattr(model_sel, "shape_figures", toy_measured)
    after = c.post("/api/v1/find-tier/", body, format="json").json()["tiers"]
    assert [t["tier"] for t in after] == [t["tier"] for t in before]  # the same ranking
    for a, b in zip(after, before, strict=True):
        assert a["tokens_per_s"] == b["tokens_per_s"] and a["cost_per_1m_tokens"] == b["cost_per_1m_tokens"]
        assert a["tokens_per_s_source"].startswith("modelled")
    three = next(t for t in after if t["tier"] == "h100-3g")
    assert three["shape_measured_tokens_per_s"] == 250_000.0


def test_library_fit_and_find_tier(as_key, key_a, tiers):
    c = as_key(key_a)
    lib = {m["key"]: m["id"] for m in c.get("/api/v1/library/?page_size=50").json()["results"]}
    r = c.get(f"/api/v1/library/{lib['llama-3.1-70b-instruct-fp8']}/fit/?context=8192")
    by_tier = {t["tier"]: t for t in r.json()}
    assert by_tier["h100-7g"]["fits"] and not by_tier["h100-3g"]["fits"] and not by_tier["h100-1g"]["fits"]
    assert by_tier["h100-7g"]["max_cached_tokens"] == 34543
    r = c.post("/api/v1/find-tier/", {"library_model": "llama-3.1-8b-instruct", "context": 8192, "concurrency": 4},
               format="json")
    assert r.status_code == 200
    found = r.json()["tiers"]
    assert [t["tier"] for t in found] and {t["tier"] for t in found} <= {"h100-3g", "h100-7g"}
    for t in found:
        assert t["fits"] and t["price_per_hour"] == "1.0000" and t["tokens_per_s"] > 0
        assert t["tokens_per_s_source"].startswith("modelled") and float(t["cost_per_1m_tokens"]) > 0.25
    r = c.post("/api/v1/find-tier/", {"memory_mib": 30000, "backend": "onnxruntime"}, format="json")
    assert {t["tier"] for t in r.json()["tiers"]} == {"h100-3g", "h100-7g"}
    r = c.post("/api/v1/find-tier/", {"context": 10}, format="json")
    assert r.status_code == 400


def test_deploy_repository_and_library_model_through_the_api(as_key, key_a, world, h100_node, tiers):
    tenant = world["a"]
    owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    a = orders.create_order(owner, tenant=tenant, tier=tiers["7g"]).allocations.get()
    assert provisioning.provision(a.pk) == "activated"
    c = as_key(key_a)
    repo = c.post("/api/v1/model-repositories/", {"name": "echo-repo", "archive": archive()},
                  format="multipart").json()
    r = c.post("/api/v1/deployments/", {"allocation": a.pk, "repository": repo["id"]}, format="json")
    assert r.status_code == 409 and "still being validated" in r.json()["repository"][0]
    r = c.post("/api/v1/find-tier/", {"repository": repo["id"]}, format="json")
    assert r.status_code == 409 and "still being validated" in r.json()["repository"][0]
    validated(ModelRepository.objects.get(pk=repo["id"]))
    r = c.post("/api/v1/deployments/", {"allocation": a.pk, "repository": repo["id"]}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["name"] == "echo" and "path" not in r.json()["spec"]
    r = c.post("/api/v1/deployments/", {"allocation": a.pk, "name": "llama", "library_model": "llama-3.1-70b-instruct",
                                        "context": 4096}, format="json")
    assert r.status_code == 400 and "does not fit" in r.content.decode()
    r = c.post("/api/v1/deployments/", {"allocation": a.pk, "name": "llama", "library_model": "llama-3.1-8b-instruct",
                                        "context": 16384, "concurrency": 4}, format="json")
    assert r.status_code == 201 and r.json()["context"] == 16384 and r.json()["backend"] == "vllm"
    assert ModelDeployment.objects.filter(allocation=a).count() == 2
    assert Allocation.objects.get(pk=a.pk).state == Allocation.State.ACTIVE


def test_an_order_for_a_library_model_is_refused_where_it_does_not_fit(as_key, key_a, h100_node, tiers):
    from marketplace.models import Order

    c = as_key(key_a)
    r = c.post("/api/v1/orders/", {"tier": "h100-3g", "library_model": "llama-3.1-70b-instruct-fp8",
                                   "context": 8192}, format="json")
    assert r.status_code == 400 and "does not fit" in r.content.decode() and "40,448 MiB are free" in r.content.decode()
    assert not Order.objects.exists()
    r = c.post("/api/v1/orders/", {"tier": "h100-7g", "library_model": "llama-3.1-70b-instruct-fp8",
                                   "context": 8192}, format="json")
    assert r.status_code == 201 and Order.objects.count() == 1


def test_list_queries_do_not_grow_with_rows(as_key, key_a, world, h100_node, client, members_a):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    c = as_key(key_a)

    def counts():
        with CaptureQueriesContext(connection) as api_q:
            assert c.get("/api/v1/model-repositories/").status_code == 200
        with CaptureQueriesContext(connection) as ad_q:
            assert c.get("/api/v1/lora-adapters/").status_code == 200
        return len(api_q), len(ad_q)

    def add(i):
        ModelRepository.objects.create(tenant=world["a"], name=f"r{i}", source="upload", size_bytes=1,
                                       file_count=1, manifest=[], path=f"alpha/{i}")
        LoraAdapter.objects.create(tenant=world["a"], name=f"l{i}", base=LibraryModel.objects.first(),
                                   source="upload", rank=8, size_bytes=1, file_count=2, path=f"alpha/l{i}")

    add(0)
    counts()  # the first request of a key also records its last use
    one = counts()
    for i in range(1, 6):
        add(i)
    assert counts() == one
