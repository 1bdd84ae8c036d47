"""Upload -> validate -> deploy -> ready -> infer on REAL tritonserver processes (the nvidia-pytriton binary, CPU):
a tenant's python model, and a tenant's ONNX model run by a python model with onnxruntime (PyPI, CPU)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from marketplace.hardware import model_repo
from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning
from marketplace.services import models as model_svc
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, validated
from tests.triton_server import tritonserver_available

AVAILABLE, REASON = tritonserver_available()
pytestmark = [pytest.mark.triton, pytest.mark.django_db,
              pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}")]

ECHO_CONFIG = '''name: "shout"
backend: "python"
max_batch_size: 0
input [ { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''
ECHO_PY = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy().reshape(-1)[0].decode()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text", np.array([text.upper().encode()], dtype=np.object_))]))
        return out
'''
ONNX_CONFIG = '''name: "affine"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "tessera_memory_mb" value { string_value: "600" } }
'''
ONNX_PY = '''import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy().astype(np.float32)
            (y,) = self.session.run(None, {"x": x})
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", y.astype(np.float32))]))
        return out
'''


def affine_onnx() -> bytes:
    """y = 2x + 1 over FP32[4], built with onnx's helpers."""
    import onnx
    from onnx import TensorProto, helper

    two = helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t"]), helper.make_node("Add", ["t", "one"], ["y"])], "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], initializer=[two, one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    buf = io.BytesIO()
    onnx.save(model, buf)
    return buf.getvalue()


@pytest.fixture
def owner(db):
    tenant = TenantFactory()
    return tenant, principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)


@pytest.fixture
def venv_python_serving(real_serving, settings):
    """The python models import onnxruntime: the backend stub runs the worker's Python (which has it)."""
    settings.TESSERA_TRITON_PYTHON = ""
    settings.TESSERA_SERVING_ISOLATE = False
    settings.TESSERA_UPLOAD_ROOT = real_serving / "uploads"
    return real_serving


def _slice(owner, tier) -> Allocation:
    tenant, p = owner
    a = orders.create_order(p, tenant=tenant, tier=tier).allocations.get()
    assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
    return Allocation.objects.select_related("node", "tier__profile", "tier__gpu_model").get(pk=a.pk)


def _upload_and_deploy(owner, a, name, files, kind):
    tenant, p = owner
    f = SimpleUploadedFile(f"{name}.{'zip' if kind == 'zip' else 'tar.gz'}", model_repo.archive_bytes(files, kind))
    repo = validated(model_svc.upload_repository(p, tenant, name, f))  # the control worker's part, in-line
    assert repo.state == "ready", repo.failure_reason
    dep = deployments.deploy(p, a, "", repository=repo)
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    return dep


def _infer(a, model, inputs):
    import tritonclient.http as httpclient

    with deployments.backend_for(a) as server:
        tensors = []
        for name, array, dtype in inputs:
            t = httpclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            tensors.append(t)
        return server.client.infer(model, tensors, headers=server.admin_headers)


def test_uploaded_python_and_onnx_models_deploy_and_infer(venv_python_serving, owner, tiers):
    a = _slice(owner, tiers["1g"])
    shout = _upload_and_deploy(owner, a, "shout-repo", {"shout/config.pbtxt": ECHO_CONFIG, "shout/1/model.py": ECHO_PY},
                               "tar")
    out = _infer(a, "shout", [("prompt", np.array([b"tokens are metered"], dtype=np.object_), "BYTES")])
    assert out.as_numpy("text").reshape(-1)[0] == b"TOKENS ARE METERED"

    affine = _upload_and_deploy(owner, a, "affine-repo", {"affine/config.pbtxt": ONNX_CONFIG,
                                                          "affine/1/model.py": ONNX_PY,
                                                          "affine/1/model.onnx": affine_onnx()}, "zip")
    assert affine.memory_mb == 600 + 512  # declared in config.pbtxt, plus the python backend's overhead
    out = _infer(a, "affine", [("x", np.array([0, 1, 2, 3.5], dtype=np.float32), "FP32")])
    assert out.as_numpy("y").tolist() == [1.0, 3.0, 5.0, 8.0]

    for dep in (shout, affine):
        deployments.remove(owner[1], dep)
        assert deployments.unload(dep.pk) == "removed"
    assert not (deployments.repo_dir(a) / "affine").exists()


BROKEN_PY = '''class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot start: " + __file__)
'''
WARM_CONFIG = ECHO_CONFIG.replace('name: "shout"', 'name: "warm"') + '''model_warmup [ { name: "hello"
  batch_size: 1 inputs { key: "prompt" value: { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "prompt.bin" } } } ]
'''


def test_a_warmup_file_in_the_warmup_folder_loads_and_a_load_failure_names_no_node_path(venv_python_serving, owner,
                                                                                        tiers, settings):
    """Triton reads input_data_file relative to the model's warmup/ folder (model_config.proto): the file the
    validation keeps inside the model is the one the real server warms up with. A model Triton refuses fails with
    a reason naming model-relative files only."""
    a = _slice(owner, tiers["1g"])
    prompt = len(b"warm up").to_bytes(4, "little") + b"warm up"  # TYPE_STRING: 4-byte length, then the bytes
    warm = _upload_and_deploy(owner, a, "warm-repo", {"warm/config.pbtxt": WARM_CONFIG, "warm/1/model.py": ECHO_PY,
                                                      "warm/warmup/prompt.bin": prompt}, "tar")
    out = _infer(a, "warm", [("prompt", np.array([b"ok"], dtype=np.object_), "BYTES")])
    assert out.as_numpy("text").reshape(-1)[0] == b"OK" and warm.name == "warm"  # loaded: warmed up with it

    tenant, p = owner
    broken = {"broken/config.pbtxt": ECHO_CONFIG.replace('name: "shout"', 'name: "broken"'),
              "broken/1/model.py": BROKEN_PY}
    f = SimpleUploadedFile("broken.tar.gz", model_repo.archive_bytes(broken))
    repo = validated(model_svc.upload_repository(p, tenant, "broken-repo", f))
    dep = deployments.deploy(p, a, "", repository=repo)
    assert deployments.load(dep.pk) == "failed"
    reason = ModelDeployment.objects.get(pk=dep.pk).failure_reason
    assert "cannot start: broken/1/model.py" in reason  # Triton's message named its absolute path
    for folder in (venv_python_serving, settings.TESSERA_TRITON_REPO_ROOT, settings.TESSERA_UPLOAD_ROOT, "/tmp/"):
        assert str(folder) not in reason
