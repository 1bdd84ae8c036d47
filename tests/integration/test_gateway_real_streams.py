"""A stream the client cuts, in front of a REAL tritonserver: the server sees the request cancelled.

The model (python backend, decoupled) sends three tokens, then waits between tokens (up to 30 s) the way a model
does in a long step, asking Triton each 10 ms whether the request was cancelled. The client reads three words
and closes; the gateway drops its upstream request; Triton marks it cancelled; the model stops and says so
(a ``status`` prompt answers what the last request did). Only what was written is billed.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from marketplace.gateway import metering
from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning
from telemetry.models import UsageEvent
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, make_key
from tests.triton_server import tritonserver_available
from tests.unit.test_gateway_streams import CUT_BOUND, open_stream, read_words

AVAILABLE, REASON = tritonserver_available()
pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}")]

CANCELLABLE_PY = '''
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils


def _text(value):
    return pb_utils.Tensor("text", np.array([value.encode()], dtype=np.object_))


class TritonPythonModel:
    def initialize(self, args):
        self.last = {"sent": 0, "cancelled": False, "done": False}

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy().reshape(-1)[0]
            prompt = prompt.decode() if isinstance(prompt, bytes) else str(prompt)
            if prompt == "status":
                sender.send(pb_utils.InferenceResponse(output_tensors=[_text(json.dumps(self.last))]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            n = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            self.last = {"sent": 0, "cancelled": False, "done": False}
            for i in range(n):
                waited = 0.0
                while i == 3 and waited < 30 and not sender.is_cancelled():  # a long step after three tokens
                    time.sleep(0.01)
                    waited += 0.01
                if sender.is_cancelled():
                    self.last["cancelled"] = True
                    break
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    _text(" w%d" % (i + 1)),
                    pb_utils.Tensor("input_tokens", np.array([1], dtype=np.int32)),
                    pb_utils.Tensor("output_tokens", np.array([i + 1], dtype=np.int32))]))
                self.last["sent"] = i + 1
            self.last["done"] = True
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
CANCELLABLE = {
    "backend": "python", "max_batch_size": 0, "memory_mb": 16, "decoupled": True,
    "inputs": [{"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]},
               {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
    "outputs": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]},
                {"name": "input_tokens", "data_type": "TYPE_INT32", "dims": [1]},
                {"name": "output_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
    "instance_group": {"count": 1, "kind": "KIND_CPU"},
    "files": {"model.py": CANCELLABLE_PY},
}


@pytest.fixture
def cancellable(real_serving, tiers):
    tenant = TenantFactory()
    owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    a = orders.create_order(owner, tenant=tenant, tier=tiers["3g"]).allocations.get()
    assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
    dep = deployments.deploy(owner, Allocation.objects.get(pk=a.pk), "cancellable", spec=CANCELLABLE)
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    _, key = make_key(tenant, ["inference"])
    return {"tenant": tenant, "dep": dep, "key": key}


def _status(gw, key: str) -> tuple[dict, str]:
    req = urllib.request.Request(f"{gw.url}/v2/models/cancellable/generate",
                                 data=json.dumps({"prompt": "status", "max_tokens": 1}).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(json.loads(r.read())["text"]), r.headers["x-request-id"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v2/models/cancellable/generate_stream"])
def test_a_cut_stream_is_cancelled_in_triton_and_billed_for_what_was_written(cancellable, gateway_factory, path):
    gw = gateway_factory()
    body = {"prompt": "x", "max_tokens": 200}
    if path.startswith("/v1/"):
        body |= {"model": "cancellable", "stream": True}
    s = open_stream(gw, cancellable["key"], path, body)
    assert read_words(s, 3) == ["w1", "w2", "w3"]
    s.close()
    # the model waits (30 s at most) after three tokens: the status request is served once it has stopped
    status, status_id = _status(gw, cancellable["key"])
    assert status == {"sent": 3, "cancelled": True, "done": True}, status
    metering.consume(budget_s=10)
    (cut,) = UsageEvent.objects.exclude(event_id=status_id)
    assert cut.deployment_id == cancellable["dep"].pk
    assert 3 <= cut.output_tokens <= 3 + CUT_BOUND, cut.output_tokens
