"""The inference gateway in front of REAL tritonserver processes (nvidia-pytriton's binary, CPU, python backend),
started by the serving runtime with every API restricted to the per-server secret. Clients are the official
``openai`` package (plain and streaming) and ``tritonclient`` (http); what they are served is what is metered."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

from marketplace.gateway import metering
from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning
from telemetry.models import UsageEvent
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, make_key
from tests.triton_server import tritonserver_available

AVAILABLE, REASON = tritonserver_available()
pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}")]

SLOW_CHAT_PY = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            for i in range(n):
                time.sleep(0.05)
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text", np.array([b"w "], dtype=np.object_)),
                    pb_utils.Tensor("input_tokens", np.array([1], dtype=np.int32)),
                    pb_utils.Tensor("output_tokens", np.array([i + 1], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
SLOW_CHAT = {
    "backend": "python", "max_batch_size": 0, "memory_mb": 16, "decoupled": True,
    "inputs": [{"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]},
               {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
    "outputs": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]},
                {"name": "input_tokens", "data_type": "TYPE_INT32", "dims": [1]},
                {"name": "output_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
    "instance_group": {"count": 1, "kind": "KIND_CPU"},
    "files": {"model.py": SLOW_CHAT_PY},
}


@pytest.fixture
def served(real_serving, tiers):
    tenant = TenantFactory()
    owner = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
    a = orders.create_order(owner, tenant=tenant, tier=tiers["3g"]).allocations.get()
    assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
    a = Allocation.objects.get(pk=a.pk)
    deps = {}
    for name, kwargs in (("tiny-gen", {"template": "tiny-gen"}), ("tiny-chat", {"template": "tiny-chat"}),
                         ("slow-chat", {"spec": SLOW_CHAT})):
        dep = deployments.deploy(owner, a, name, **kwargs)
        assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
        deps[name] = dep
    _, key = make_key(tenant, ["inference"])
    return {"tenant": tenant, "deps": deps, "key": key}


def _events():
    metering.consume(budget_s=10)
    return {e.event_id: e for e in UsageEvent.objects.all()}


def test_openai_client_plain_and_streaming_through_the_gateway(served, gateway_factory):
    gw = gateway_factory()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=served["key"], max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny-gen", max_tokens=6,
                                           messages=[{"role": "user", "content": "metered by the gateway"}])
    assert reply.usage.prompt_tokens == 6 and reply.usage.completion_tokens == 6  # as the model reported them
    stream = client.chat.completions.create(model="tiny-chat", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "stream these words"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 5 and chunks[-1].usage.completion_tokens == 5
    completion = client.completions.create(model="tiny-chat", prompt="one two", max_tokens=3)  # decoupled, aggregated
    assert completion.choices[0].text == "two one two" and completion.usage.total_tokens == 5
    events = _events()
    assert events[reply.id.removeprefix("chatcmpl-")].output_tokens == 6
    assert events[chunks[0].id.removeprefix("chatcmpl-")].output_tokens == 5
    assert events[completion.id.removeprefix("cmpl-")].input_tokens == 2
    assert sum(e.requests for e in events.values()) == 3


def test_tritonclient_infer_with_binary_tensors_and_generate_stream(served, gateway_factory):
    gw = gateway_factory()
    client = httpclient.InferenceServerClient(gw.url.removeprefix("http://"))
    headers = {"Authorization": f"Bearer {served['key']}"}
    prompt = httpclient.InferInput("prompt", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[b"a b c d"]], dtype=np.object_))
    limit = httpclient.InferInput("max_tokens", [1, 1], "INT32")
    limit.set_data_from_numpy(np.array([[3]], dtype=np.int32))
    result = client.infer("tiny-gen", [prompt, limit], headers=headers)  # binary tensors both ways
    assert result.as_numpy("text").reshape(-1)[0] == b"d c b"
    assert client.is_model_ready("tiny-gen", headers=headers)
    assert client.get_model_metadata("tiny-gen", headers=headers)["name"] == "tiny-gen"
    with pytest.raises(Exception, match="does not exist"):
        client.infer("no-such-model", [prompt], headers=headers)
    request_id = result.get_response()["id"] if result.get_response().get("id") else None
    events = _events()
    assert sorted((e.input_tokens, e.output_tokens) for e in events.values()) == [(4, 3)]
    assert request_id is None or request_id in events


def test_a_stream_cut_by_the_client_is_metered_for_what_was_sent(served, gateway_factory):
    gw = gateway_factory()
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "slow-chat", "prompt": "x", "max_tokens": 40, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + served["key"].encode() + b"\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
    # closed after three events (2 s of the 40 x 50 ms the model would take)
    deadline_events = {}
    for _ in range(100):
        deadline_events = _events()
        if deadline_events:
            break
        time.sleep(0.1)
    (event,) = deadline_events.values()
    assert 3 <= event.output_tokens < 40, event.output_tokens
