"""Portal: upload a model repository, find a tier for a library model and order it, deploy a library model."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from marketplace.hardware import model_repo
from marketplace.models import Allocation, ModelDeployment, ModelRepository
from marketplace.services import provisioning
from tenants.roles import Role
from tests.factories import validated
from tests.unit.test_model_repo import GOOD

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner_client(client, members_a):
    client.force_login(members_a[Role.OWNER])
    return client


def test_upload_repository_in_the_portal(owner_client, h100_node, world):
    url = reverse("portal:repository_upload")
    bad = SimpleUploadedFile("r.tar.gz", model_repo.archive_bytes({**GOOD, "echo/1/../../../x": "x"}))
    r = owner_client.post(url, {"name": "bad", "archive": bad})
    assert r.status_code == 400 and "path traversal" in r.content.decode()
    assert not ModelRepository.objects.exists()
    good = SimpleUploadedFile("r.zip", model_repo.archive_bytes(GOOD, "zip"))
    r = owner_client.post(url, {"name": "echo-repo", "archive": good})
    assert r.status_code == 302
    page = owner_client.get(reverse("portal:repositories")).content.decode()
    repo = ModelRepository.objects.get(name="echo-repo")
    assert "echo-repo" in page and f'id="repository-state-{repo.pk}">validating' in page
    status_url = reverse("portal:uploads_status") + "?which=repositories"
    assert f'hx-get="{status_url}" hx-trigger="every 1s"' in page  # refreshes while validating
    r = owner_client.get(reverse("portal:deployments"))
    assert "echo-repo" not in r.content.decode()  # not offered for deploying yet
    validated(repo)
    part = owner_client.get(status_url).content.decode()
    assert f'id="repository-state-{repo.pk}">ready' in part and "echo · python" in part and "hx-get" not in part
    assert "echo-repo" in owner_client.get(reverse("portal:deployments")).content.decode()


def test_viewer_cannot_upload(client, members_a, h100_node):
    client.force_login(members_a[Role.VIEWER])
    good = SimpleUploadedFile("r.zip", model_repo.archive_bytes(GOOD, "zip"))
    r = client.post(reverse("portal:repository_upload"), {"name": "x", "archive": good})
    assert r.status_code == 403 and not ModelRepository.objects.exists()


def test_find_a_tier_then_order_and_deploy(owner_client, h100_node, tiers, world):
    r = owner_client.get(reverse("portal:find_tier"), {"library_model": "llama-3.1-70b-instruct-fp8",
                                                       "context": "8192", "concurrency": "2"})
    page = r.content.decode()
    assert r.status_code == 200 and "h100-7g" in page and "h100-3g" not in page
    assert "modelled (memory-bandwidth roofline" in page
    r = owner_client.post(reverse("portal:order", args=[tiers["7g"].pk]), {"quantity": "1"})
    a = Allocation.objects.get(tenant=world["a"])
    assert r.status_code == 302 and provisioning.provision(a.pk) == "activated"
    r = owner_client.post(reverse("portal:deployment_create"), {
        "allocation": str(a.pk), "name": "llama70", "library_model": "llama-3.1-70b-instruct-fp8",
        "context": "200000", "concurrency": "1"})
    assert r.status_code == 400 and "max context" in r.content.decode()
    r = owner_client.post(reverse("portal:deployment_create"), {
        "allocation": str(a.pk), "name": "llama70", "library_model": "llama-3.1-70b-instruct-fp8",
        "context": "16384", "concurrency": "2"})
    assert r.status_code == 302
    dep = ModelDeployment.objects.get(name="llama70")
    assert dep.library_model.key == "llama-3.1-70b-instruct-fp8" and dep.context == 16384


def test_find_a_tier_refuses_bad_input(owner_client, tiers):
    r = owner_client.get(reverse("portal:find_tier"), {"library_model": "qwen2.5-7b-instruct", "context": "99999"})
    assert r.status_code == 400 and "max context" in r.content.decode()


def test_order_from_find_a_tier_checks_the_fit(owner_client, h100_node, tiers, world):
    r = owner_client.post(reverse("portal:order", args=[tiers["3g"].pk]), {
        "quantity": "1", "library_model": "llama-3.1-70b-instruct-fp8", "context": "8192", "concurrency": "1"})
    assert r.status_code == 400 and "does not fit" in r.content.decode()
    assert not Allocation.objects.exists()


def test_upload_an_adapter_and_deploy_it_with_its_base(owner_client, h100_node, tiers, world):
    import json

    from marketplace.models import LoraAdapter

    files = {"adapter_config.json": json.dumps({"r": 8}), "adapter_model.safetensors": b"\0" * 1000}
    r = owner_client.post(reverse("portal:adapter_upload"), {
        "name": "sql", "base": "llama-3.1-8b-instruct",
        "archive": SimpleUploadedFile("a.zip", model_repo.archive_bytes(files, "zip"))})
    assert r.status_code == 302
    ad = validated(LoraAdapter.objects.get(name="sql"))
    assert "sql" in owner_client.get(reverse("portal:repositories")).content.decode()
    r = owner_client.post(reverse("portal:adapter_upload"), {
        "name": "bad", "base": "llama-3.1-8b-instruct",
        "archive": SimpleUploadedFile("a.zip", model_repo.archive_bytes({"x.txt": "x"}, "zip"))})
    assert r.status_code == 302
    bad = validated(LoraAdapter.objects.get(name="bad"))
    page = owner_client.get(reverse("portal:repositories")).content.decode()
    assert f'id="adapter-state-{bad.pk}">failed' in page and "no adapter_config.json" in page
    owner_client.post(reverse("portal:order", args=[tiers["7g"].pk]), {"quantity": "1"})
    a = Allocation.objects.get(tenant=world["a"])
    provisioning.provision(a.pk)
    r = owner_client.post(reverse("portal:deployment_create"), {
        "allocation": str(a.pk), "name": "tuned", "library_model": "llama-3.1-8b-instruct", "context": "4096",
        "adapters": [str(ad.pk)]})
    assert r.status_code == 302
    assert list(ModelDeployment.objects.get(name="tuned").adapters.all()) == [ad]


def test_repository_and_adapter_forms_show_errors_next_to_their_fields(owner_client, h100_node):
    from marketplace.models import LoraAdapter

    good = SimpleUploadedFile("r.zip", model_repo.archive_bytes(GOOD, "zip"))
    r = owner_client.post(reverse("portal:repository_upload"), {"name": "both", "archive": good,
                                                                 "store_path": "shared/x"})
    assert r.status_code == 400 and r.context["form"].errors == {
        "archive": ["choose an archive (.tar.gz or .zip) or give a model-store path"]}
    assert '<span class="errorlist" id="upload-error">choose an archive' in r.content.decode()
    assert 'value="shared/x"' in r.content.decode() and not ModelRepository.objects.exists()
    r = owner_client.post(reverse("portal:adapter_upload"), {"name": "sql", "base": "no-such-model"})
    assert r.status_code == 400 and r.context["adapter_form"].errors == {
        "base": ["choose the library model it was trained on"],
        "archive": ["choose the adapter's archive (.tar.gz or .zip)"]}
    assert 'id="adapter-error">choose the adapter' in r.content.decode() and not LoraAdapter.objects.exists()
