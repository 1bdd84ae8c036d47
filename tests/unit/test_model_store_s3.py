"""The S3-compatible model store: the operator configures endpoint, bucket, prefix and credentials; a tenant names an
object key under the prefix (never a URL); the archive is fetched with boto3 within the size limit and validated like
an upload. Against moto's server mode on a free local port (no network)."""

from __future__ import annotations

import hashlib

import boto3
import pytest
from moto.server import ThreadedMotoServer

from marketplace.hardware import model_repo
from marketplace.models import ModelRepository
from marketplace.services import models as model_svc
from tenants.errors import ServiceError
from tests.factories import validated
from tests.gateway_fixtures import free_port
from tests.unit.test_model_deploy import owner  # noqa: F401 - fixture
from tests.unit.test_model_repo import GOOD

pytestmark = pytest.mark.django_db


@pytest.fixture
def s3_store(settings):
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    settings.TESSERA_MODEL_STORE_S3_ENDPOINT = f"http://127.0.0.1:{port}"
    settings.TESSERA_MODEL_STORE_S3_BUCKET = "msp-models"
    settings.TESSERA_MODEL_STORE_S3_PREFIX = "shared/"
    settings.TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID = "test"
    settings.TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY = "test"
    s3 = boto3.client("s3", endpoint_url=settings.TESSERA_MODEL_STORE_S3_ENDPOINT, region_name="us-east-1",
                      aws_access_key_id="test", aws_secret_access_key="test")
    s3.create_bucket(Bucket="msp-models")
    yield s3
    server.stop()


def test_a_store_object_is_fetched_and_validated_like_an_upload(owner, s3_store):  # noqa: F811
    tenant, p = owner
    data = model_repo.archive_bytes(GOOD)
    s3_store.put_object(Bucket="msp-models", Key="shared/echo.tar.gz", Body=data)
    s3_store.put_object(Bucket="msp-models", Key="outside.tar.gz", Body=data)
    repo = model_svc.import_from_store(p, tenant, "from-s3", "echo.tar.gz")  # the request only HEADs it
    assert (repo.state, repo.archive_bytes, repo.archive_sha256) == ("validating", len(data), "")
    repo = validated(repo)  # the control worker downloads, unpacks and validates it
    assert (repo.source, repo.store_path, repo.archive_bytes, repo.manifest[0]["name"], repo.state) == (
        "store", "echo.tar.gz", len(data), "echo", "ready")
    assert repo.archive_sha256 == hashlib.sha256(data).hexdigest()
    assert ((model_svc.upload_root() / repo.path) / "echo" / "1" / "model.py").read_text() == GOOD["echo/1/model.py"]
    for bad, needle in (("../outside.tar.gz", "without '..'"), ("/echo.tar.gz", "without '..'"),
                        ("http://169.254.169.254/latest", "not a URL"), ("outside.tar.gz", "no such object"),
                        ("nope.tar.gz", "no such object")):
        with pytest.raises(ServiceError, match=needle) as exc:
            model_svc.import_from_store(p, tenant, "bad", bad)
        assert exc.value.field == "store_path"
    assert list(ModelRepository.objects.values_list("name", flat=True)) == ["from-s3"]


def test_size_limit_and_archive_validation(owner, s3_store, settings):  # noqa: F811
    tenant, p = owner
    s3_store.put_object(Bucket="msp-models", Key="shared/evil.tar.gz",
                        Body=model_repo.archive_bytes({**GOOD, "../../etc/x": "x"}))
    evil = validated(model_svc.import_from_store(p, tenant, "evil", "evil.tar.gz"))
    assert evil.state == "failed" and "../../etc/x: path traversal" in evil.failure_reason
    evil.delete()
    data = model_repo.archive_bytes(GOOD)
    s3_store.put_object(Bucket="msp-models", Key="shared/big.tar.gz", Body=data)
    settings.TESSERA_UPLOAD_MAX_BYTES = len(data) - 1
    with pytest.raises(ServiceError, match="the limit is"):
        model_svc.import_from_store(p, tenant, "big", "big.tar.gz")
    assert not ModelRepository.objects.exists()
