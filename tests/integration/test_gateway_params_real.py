"""OpenAI request fields through the gateway to REAL tritonserver processes (nvidia-pytriton's binary, CPU, python
backend), with the official ``openai`` package: sampling fields reach a model that declares them as inputs (it
answers with what it got), fields a model cannot take are refused with 400 naming them, ``stop`` is honoured by the
gateway and only what the tenant received is billed, and a spend block is OpenAI's 429 insufficient_quota.
The same on simulated slices (and vLLM's sampling_parameters): tests/unit/test_gateway_params.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from marketplace.gateway import metering
from telemetry.models import UsageEvent
from tests.factories import make_key
from tests.serving_fixtures import deploy_ready, order_active, tenant_owner
from tests.triton_server import tritonserver_available

AVAILABLE, REASON = tritonserver_available()
pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}")]

# Answers with the sampling inputs it received, as Triton gave them to it (their declared types).
SAMPLER_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            got = []
            for name in ("temperature", "top_p", "random_seed"):
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    value = tensor.as_numpy().reshape(-1)[0]
                    got.append(f"{name}={value.item()!r}:{value.dtype}")
            text = " ".join(got) or "defaults"
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text", np.array([text.encode()], dtype=np.object_)),
                pb_utils.Tensor("output_tokens", np.array([len(got) or 1], dtype=np.int32))]))
        return responses
'''
SAMPLER = {
    "backend": "python", "max_batch_size": 0, "memory_mb": 16,
    "inputs": [{"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]},
               {"name": "temperature", "data_type": "TYPE_FP32", "dims": [1], "optional": True},
               {"name": "top_p", "data_type": "TYPE_FP32", "dims": [1], "optional": True},
               {"name": "random_seed", "data_type": "TYPE_UINT64", "dims": [1], "optional": True}],
    "outputs": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]},
                {"name": "output_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
    "instance_group": {"count": 1, "kind": "KIND_CPU"},
    "files": {"model.py": SAMPLER_PY},
}


# An embedding model: [words, characters / 10, 0.25] of its prompt, and the words as its input token count.
EMBEDDER_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy().reshape(-1)[0].decode()
            if text == "refuse me":
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("refused")))
                continue
            vector = np.array([len(text.split()), len(text) / 10, 0.25], dtype=np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("embedding", vector),
                pb_utils.Tensor("input_tokens", np.array([len(text.split())], dtype=np.int32))]))
        return responses
'''
EMBEDDER = {
    "backend": "python", "max_batch_size": 0, "memory_mb": 16,
    "inputs": [{"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]}],
    "outputs": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [3]},
                {"name": "input_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
    "instance_group": {"count": 1, "kind": "KIND_CPU"},
    "files": {"model.py": EMBEDDER_PY},
}


@pytest.fixture
def served(real_serving, tiers):
    owner = tenant_owner()
    a = order_active(owner, tiers["3g"])
    for name, kwargs in (("tiny-gen", {"template": "tiny-gen"}), ("tiny-chat", {"template": "tiny-chat"}),
                         ("sampler", {"spec": SAMPLER})):
        deploy_ready(owner, a, name, **kwargs)
    _, key = make_key(owner[0], ["inference"])
    return {"tenant": owner[0], "key": key}


def _client(gw, key, **kwargs):
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, timeout=60, **{"max_retries": 0, **kwargs})


def _billed():
    metering.consume(budget_s=10)
    return {e.event_id: (e.input_tokens, e.output_tokens) for e in UsageEvent.objects.all()}


def test_sampling_fields_reach_the_model_as_its_declared_inputs(served, gateway_factory):
    gw = gateway_factory()
    client = _client(gw, served["key"])
    r = client.chat.completions.create(model="sampler", temperature=0, top_p=0.5, seed=42,
                                       messages=[{"role": "user", "content": "x"}])
    # temperature 0 sent as the JSON integer 0 arrives as the model's FP32; seed as its UINT64 random_seed
    assert r.choices[0].message.content == "temperature=0.0:float32 top_p=0.5:float32 random_seed=42:uint64"
    assert client.completions.create(model="sampler", prompt="x").choices[0].text == "defaults"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="sampler", prompt="x", presence_penalty=1)
    assert err.value.param == "presence_penalty" and "temperature, top_p, random_seed" in str(err.value)
    assert len(_billed()) == 2  # the refused request was not served


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"stop": None, "logprobs": True},
                                    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
                                    {"response_format": {"type": "json_object"}}, {"user": "u-1"}])
def test_what_a_model_cannot_take_is_refused_naming_it(served, gateway_factory, kwargs):
    gw = gateway_factory()
    with pytest.raises(openai.BadRequestError) as err:
        _client(gw, served["key"]).chat.completions.create(
            model="tiny-gen", messages=[{"role": "user", "content": "x"}], **kwargs)
    field = next(k for k, v in kwargs.items() if v is not None)
    assert err.value.status_code == 400 and err.value.code == "unsupported_parameter"
    assert err.value.param == field and f"'{field}'" in err.value.message
    assert _billed() == {}


def test_stop_is_honoured_and_only_the_text_received_is_billed(served, gateway_factory):
    gw = gateway_factory()
    client = _client(gw, served["key"])
    # the case: 6 tokens past the stop were sent and billed, finish "length"
    r = client.completions.create(model="tiny-gen", prompt="a b c", max_tokens=6, stop=["a"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("c b ", "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 2)
    # streamed from a decoupled model: the gateway stops reading at the stop sequence
    stream = client.completions.create(model="tiny-chat", prompt="one two three", max_tokens=9, stop="one",
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "three two " and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 2
    # aggregated (decoupled, not streamed), a stop string spanning two responses of the model
    agg = client.completions.create(model="tiny-chat", prompt="one two three", max_tokens=9, stop=["two one"])
    assert agg.choices[0].text == "three " and agg.usage.completion_tokens == 1
    billed = _billed()
    assert billed[r.id.removeprefix("cmpl-")] == (3, 2)
    assert billed[chunks[0].id.removeprefix("cmpl-")] == (3, 2)
    assert billed[agg.id.removeprefix("cmpl-")] == (3, 1)


def test_a_spend_block_is_openais_insufficient_quota(served, gateway_factory):
    tenant = served["tenant"]
    tenant.monthly_spend_limit = 0  # nothing may be spent
    tenant.save(update_fields=["monthly_spend_limit"])
    gw = gateway_factory()
    gw.refresh()
    sent = []  # every HTTP request the SDK makes: it retries a 429 twice unless told not to (x-should-retry)
    http = httpx.Client(event_hooks={"request": [sent.append]})
    client = _client(gw, served["key"], max_retries=2, http_client=http)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="tiny-gen", prompt="a b", max_tokens=2)
    assert len(sent) == 1
    assert err.value.status_code == 429 and err.value.code == "insufficient_quota"
    assert err.value.body["type"] == "insufficient_quota" and err.value.body["tessera_code"] == "spend_limit_reached"
    assert err.value.response.headers["x-should-retry"] == "false" and _billed() == {}


def test_keys_are_metered_apart_split_on_the_invoice_and_held_to_their_allowance(served, gateway_factory):
    """Two keys of one tenant through the openai package: the usage per key adds up to the tenant's, the invoice's
    token lines split over the keys to the cent, and a key past its monthly token allowance is refused as a spent
    quota while the other key goes on."""
    from django.utils import timezone

    from marketplace.selectors.billing import key_breakdown
    from marketplace.services import billing
    from tenants.models import ApiKey

    tenant = served["tenant"]
    team, team_secret = make_key(tenant, ["inference"], name="team-b")
    ApiKey.objects.filter(pk=team.pk).update(monthly_token_allowance=10)
    gw = gateway_factory()
    mine, theirs = _client(gw, served["key"]), _client(gw, team_secret)
    served_to = {served["key"].split("_")[1]: 0, team.prefix: 0}
    for prefix, client, prompt in ((team.prefix, theirs, "a b c d"), (served["key"].split("_")[1], mine, "a b"),
                                   (team.prefix, theirs, "e f g")):
        r = client.completions.create(model="tiny-gen", prompt=prompt, max_tokens=3)
        served_to[prefix] += r.usage.total_tokens
    _billed()
    assert served_to[team.prefix] >= 10
    gw.refresh()
    with pytest.raises(openai.RateLimitError) as err:
        theirs.completions.create(model="tiny-gen", prompt="a", max_tokens=1)
    assert err.value.code == "insufficient_quota" and err.value.body["tessera_code"] == "key_allowance_reached"
    assert mine.completions.create(model="tiny-gen", prompt="a", max_tokens=1).usage.total_tokens == 2
    served_to[served["key"].split("_")[1]] += 2
    per_event = _billed()
    assert sum(i + o for i, o in per_event.values()) == sum(served_to.values())
    by_key = {e.api_key: 0 for e in UsageEvent.objects.all()}
    for e in UsageEvent.objects.all():
        by_key[e.api_key] += e.input_tokens + e.output_tokens
    assert by_key == served_to
    invoice = billing.current_invoice(tenant, timezone.now())
    split = key_breakdown(invoice)
    tokens = {r["key"]: r["input_tokens"] + r["output_tokens"] for r in split["keys"]}
    assert tokens == served_to
    assert sum(r["amount"] for r in split["keys"]) + split["not_per_key"] == invoice.total


def test_a_price_plan_created_between_two_requests_of_one_hour_prices_each_at_its_own(served, tiers, operator,
                                                                                      gateway_factory):
    """Issue 29's case through the openai package: tokens served just before and just after an operator adds a
    price inside the same hour are each priced at the plan in force when they were served."""
    from decimal import Decimal

    from django.utils import timezone

    from marketplace.services import billing, offers
    from tenants.scoping import principal_for_user

    now = timezone.now()
    if now.minute == 59 and now.second > 40:  # the two requests must fall in one hour
        pytest.skip("too close to the hour's end")
    gw = gateway_factory()
    client = _client(gw, served["key"])
    before = client.completions.create(model="tiny-gen", prompt="a b c", max_tokens=4).usage
    offers.add_price_plan(principal_for_user(operator), tier=tiers["3g"], currency="USD",
                          price_per_slice_hour=Decimal("1.0000"), price_per_1m_input_tokens=Decimal("1000.0000"),
                          price_per_1m_output_tokens=Decimal("3000.0000"))
    after = client.completions.create(model="tiny-gen", prompt="a b", max_tokens=2).usage
    _billed()
    invoice = billing.current_invoice(served["tenant"], timezone.now())
    lines = {(li.kind, li.unit_price): li.quantity for li in invoice.lines.all() if li.kind.endswith("_tokens")}
    assert lines == {("input_tokens", Decimal("0.1000")): Decimal(before.prompt_tokens) / 10**6,
                     ("output_tokens", Decimal("0.4000")): Decimal(before.completion_tokens) / 10**6,
                     ("input_tokens", Decimal("1000.0000")): Decimal(after.prompt_tokens) / 10**6,
                     ("output_tokens", Decimal("3000.0000")): Decimal(after.completion_tokens) / 10**6}


def test_embeddings_for_a_model_that_declares_them(real_serving, tiers, gateway_factory):
    owner = tenant_owner()
    a = order_active(owner, tiers["3g"])
    deploy_ready(owner, a, "embedder", spec=EMBEDDER)
    deploy_ready(owner, a, "tiny-gen", template="tiny-gen")
    _, key = make_key(owner[0], ["inference"])
    gw = gateway_factory()
    client = _client(gw, key)
    # the openai package asks for base64 unless told otherwise, and decodes it
    r = client.embeddings.create(model="embedder", input=["one two three", "four"])
    assert [d.embedding for d in r.data] == [[3.0, 1.2999999523162842, 0.25], [1.0, 0.4000000059604645, 0.25]]
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == r.usage.total_tokens == 4
    floats = client.embeddings.create(model="embedder", input="a b", encoding_format="float")
    assert floats.data[0].embedding == [2.0, 0.30000001192092896, 0.25]
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny-gen", input="x")
    assert err.value.code == "model_not_embedding"
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="embedder", input="x", dimensions=2)
    assert err.value.param == "dimensions" and err.value.code == "unsupported_parameter"
    with pytest.raises(openai.APIStatusError) as failed:  # one input the model refuses: no answer, no bill
        client.embeddings.create(model="embedder", input=["a", "refuse me", "b"])
    assert failed.value.status_code == 400 and "refused" in failed.value.message
    billed = _billed()
    assert billed[r._request_id] == (4, 0) and billed[floats._request_id] == (2, 0) and len(billed) == 2
