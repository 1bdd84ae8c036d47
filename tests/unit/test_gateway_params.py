"""OpenAI request fields at the gateway: each one reaches the model (vLLM's sampling_parameters, a model's declared
input tensors) or is refused with 400 naming it; ``stop`` is honoured by the gateway whatever the backend, and only
the text sent is billed. Simulated slices (their HTTP front); the same against real tritonservers:
tests/integration/test_gateway_real.py."""

from __future__ import annotations

import json

import openai
import pytest

from marketplace.gateway import metering
from marketplace.gateway import protocol as p
from marketplace.hardware import sim_http
from marketplace.models import LibraryModel, ModelDeployment
from marketplace.services import deployments
from marketplace.services.deployments import LIBRARY_IO
from telemetry.models import UsageEvent
from tests.factories import make_key
from tests.gateway_fixtures import gateway_slice, gateway_tenant
from tests.unit.test_gateway import _raw

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
PYTHON_SAMPLER = p.ModelIO.from_spec({
    "inputs": [{"name": "prompt", "data_type": "TYPE_STRING"}, {"name": "max_tokens", "data_type": "TYPE_INT32"},
               {"name": "temperature", "data_type": "TYPE_FP32"}, {"name": "random_seed", "data_type": "TYPE_UINT64"},
               {"name": "top_k", "data_type": "TYPE_INT32"}],
    "outputs": [{"name": "text"}]})


def _refused(parse, body):
    with pytest.raises(p.GatewayError) as err:
        parse(json.dumps(body).encode())
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("logprobs", True), ("top_logprobs", 2),
    ("logit_bias", {"50256": -100}), ("user", "u-1"), ("parallel_tool_calls", True), ("no_such_field", 1),
    ("best_of", 2), ("echo", True), ("suffix", "x"), ("lora_name", "sql")])
def test_a_field_the_gateway_cannot_deliver_is_refused_naming_it(field, value):
    parse = p.parse_completion if field in ("best_of", "echo", "suffix") else p.parse_chat
    body = {**CHAT, "prompt": "x"} if parse is p.parse_completion else dict(CHAT)
    body.pop("messages") if parse is p.parse_completion else None
    err = _refused(parse, {**body, field: value})
    assert err.code == "unsupported_parameter" and err.param == field and f"'{field}'" in err.message


def test_null_and_the_no_op_defaults_are_what_the_gateway_does_anyway():
    req = p.parse_chat(json.dumps({**CHAT, "tools": [], "logprobs": False, "response_format": {"type": "text"},
                                   "logit_bias": {}, "user": None, "temperature": None, "n": None}).encode())
    assert req.sampling == {} and req.stop == ()
    assert p.parse_completion(b'{"model": "m", "prompt": "x", "echo": false, "best_of": 1}').prompt == "x"
    assert _refused(p.parse_completion, {"model": "m", "prompt": "x", "logprobs": 0}).param == "logprobs"  # 0: one
    assert _refused(p.parse_chat, {**CHAT, "n": 2}).param == "n"


def test_message_fields_other_than_role_and_content_are_refused():
    err = _refused(p.parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}]})
    assert err.param == "messages[0].name" and err.code == "unsupported_parameter"
    err = _refused(p.parse_chat, {"model": "m", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]})
    assert err.param == "messages[1].tool_calls"


@pytest.mark.parametrize("field,value", [("temperature", 2.5), ("temperature", "0"), ("top_p", -0.1),
                                         ("seed", 1.5), ("stop", []), ("stop", ["a", "b", "c", "d", "e"]),
                                         ("stop", [""]), ("stop", 3), ("stop", "x" * 257),
                                         ("presence_penalty", True)])
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    assert _refused(p.parse_chat, {**CHAT, field: value}).param == field


def test_vllm_gets_every_sampling_field_and_stop_in_sampling_parameters():
    io = p.ModelIO.from_spec(LIBRARY_IO["vllm"])
    req = p.parse_chat(json.dumps({**CHAT, "temperature": 0, "top_p": 0.5, "seed": 7, "frequency_penalty": 1,
                                   "presence_penalty": -1, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2,
                                   "stop": "END", "max_tokens": 9}).encode())
    params = json.loads(p.generate_body(io, req)["sampling_parameters"])
    assert params == {"max_tokens": 9, "temperature": 0.0, "top_p": 0.5, "seed": 7, "frequency_penalty": 1.0,
                      "presence_penalty": -1.0, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2,
                      "stop": ["END"]}
    with_adapter = json.loads(p.generate_body(io, req, "sql")["sampling_parameters"])
    assert with_adapter == {**params, "lora_name": "sql"}


def test_other_models_get_the_fields_they_declare_as_inputs_in_their_type_and_refuse_the_rest():
    req = p.parse_completion(b'{"model": "m", "prompt": "x", "temperature": 0, "seed": 5, "top_k": 2}')
    body = p.generate_body(PYTHON_SAMPLER, req)
    assert body == {"prompt": "x", "temperature": 0.0, "random_seed": 5, "top_k": 2}
    assert isinstance(body["temperature"], float)
    with pytest.raises(p.GatewayError) as err:
        p.generate_body(PYTHON_SAMPLER, p.parse_completion(b'{"model": "m", "prompt": "x", "top_p": 0.9}'))
    assert err.value.param == "top_p" and "random_seed" in err.value.message  # names what the model takes
    with pytest.raises(p.GatewayError) as err:
        p.generate_body(p.ModelIO(), p.parse_completion(b'{"model": "tiny", "prompt": "x", "temperature": 1}'))
    assert err.value.status == 400 and err.value.param == "temperature"


def _served(pieces, stops, counts=None):
    io = p.ModelIO(output_count="output_tokens" if counts else None)
    served, sent = p.Served(stops=tuple(stops)), []
    for i, piece in enumerate(pieces):
        sent.append(served.add(io, {"text": piece, **({"output_tokens": counts[i]} if counts else {})}))
        if served.stopped:
            break
    sent.append(served.flush())
    return served, sent


def test_stop_cuts_before_the_first_stop_sequence_even_across_pieces():
    served, sent = _served(["c b a", " c b a"], ["a"])
    assert served.text == "c b " and served.stopped and "".join(sent) == "c b "
    served, sent = _served(["one tw", "o EN", "D three"], ["END", "zzz"])
    assert served.text == "one two " and sent == ["one tw", "o ", "", ""]  # "EN" held back, then cut
    served, sent = _served(["x E", "Nd"], ["END"])
    assert served.text == "x ENd" and not served.stopped and sent == ["x ", "ENd", ""]  # held, then sent after all
    served, _ = _served(["a b", " c"], ["b", "a"])
    assert served.text == ""  # the earliest stop sequence wins


def test_a_cut_answer_bills_the_tokens_of_the_text_sent():
    # one answer of 6 tokens and 11 characters, cut after 4: 6 * 4 // 11 = 2 tokens (the words rule agrees)
    served, _ = _served(["c b a c b a"], ["a"], counts=[6])
    assert served.usage("a b c") == (3, 2) and served.output_tokens == 6
    # streamed with running counts: the pieces before the cut count whole, the cut piece by its kept share
    served, _ = _served(["aa", "bbbb", "ccSTOP", "dd"], ["STOP"], counts=[1, 3, 5, 6])
    assert served.usage("x")[1] == 3 + (5 - 3) * 2 // 6
    served, _ = _served(["no stop here"], ["STOP"], counts=[4])
    assert served.usage("x")[1] == 4  # not cut: what the model reported
    served, _ = _served(["a STOP"], ["STOP"])
    assert served.usage("x")[1] == 1  # no counts: words of the text sent


@pytest.fixture
def fleet(gateway_fleet):
    return gateway_fleet


def _client(gw, key):
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_stop_is_honoured_by_the_gateway_and_only_what_was_sent_is_billed(fleet, gateway_factory):
    gw = gateway_factory()
    client = _client(gw, fleet["key_a"])
    r = client.completions.create(model="tiny-gen", prompt="a b c", max_tokens=6, stop=["a"])
    assert r.choices[0].text == "c b " and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 2
    stream = client.chat.completions.create(model="tiny-chat", max_tokens=8, stream=True, stop="one",
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "one two"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    # the model would say "two one two one ..."; the stop sequence and everything after it are not sent
    assert text == "assistant: two " and finish == ["stop"]
    assert chunks[-1].usage.completion_tokens == 2
    plain = client.completions.create(model="tiny-gen", prompt="a b c", max_tokens=6)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 6
    metering.consume(budget_s=10)
    billed = {e.event_id: e.output_tokens for e in UsageEvent.objects.all()}
    assert billed[r.id.removeprefix("cmpl-")] == 2 and billed[chunks[0].id.removeprefix("chatcmpl-")] == 2
    assert billed[plain.id.removeprefix("cmpl-")] == 6


def test_fields_a_model_cannot_take_are_refused_before_anything_is_served(fleet, gateway_factory):
    gw = gateway_factory()
    client = _client(gw, fleet["key_a"])
    for kwargs in ({"temperature": 0}, {"top_p": 0.5}, {"seed": 1},
                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
                   {"response_format": {"type": "json_object"}}, {"logprobs": True}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-gen", messages=[{"role": "user", "content": "x"}], **kwargs)
        (field,) = kwargs
        assert err.value.code == "unsupported_parameter" and err.value.param == field and field in str(err.value)
    assert metering.consume(budget_s=10)["new"] == 0  # nothing served, nothing billed


@pytest.fixture
def vllm_fleet(sim_http_on, h100_node, tiers):
    alpha = gateway_tenant("alpha")
    a = gateway_slice(alpha, tiers["7g"])
    dep = deployments.deploy(alpha[1], a, "llama", library_model=LibraryModel.objects.get(
        key="llama-3.1-8b-instruct"), context=4096)
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    _, key = make_key(alpha[0], ["inference"])
    return {"key": key}


def _served_sampling():
    return [x for front in sim_http._FRONTS.values() for x in front.backend.served_sampling]


def test_a_vllm_model_is_sampled_as_the_tenant_asked(vllm_fleet, gateway_factory):
    gw = gateway_factory()
    client = _client(gw, vllm_fleet["key"])
    r = client.completions.create(model="llama", prompt="a b c", max_tokens=6, temperature=0, top_p=0.9, seed=3,
                                  stop=["a"], extra_body={"top_k": 5})
    assert r.choices[0].text == "c b " and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 2
    assert _served_sampling() == [("llama", {"max_tokens": 6, "temperature": 0.0, "top_p": 0.9, "seed": 3,
                                             "top_k": 5, "stop": ["a"]})]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt="x", logprobs=2)
    assert err.value.param == "logprobs"
    status, raw, _ = _raw(gw, "/v1/completions", vllm_fleet["key"], {"model": "llama", "prompt": "x",
                                                                     "guided_json": {}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "guided_json"
    assert len(_served_sampling()) == 1


def test_the_openapi_document_states_the_supported_fields_and_the_quota_answer():
    from openapi_spec_validator import validate

    from marketplace.gateway.openapi import document

    doc = document("http://gw")
    validate(doc)
    for path in ("/v1/chat/completions", "/v1/completions"):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert "unsupported_parameter" in body["description"] and "402" not in op["responses"]
        assert body["properties"]["temperature"]["maximum"] == 2 and "random_seed" in body["properties"]["seed"][
            "description"]
        assert body["properties"]["stop"]["anyOf"][2]["maxItems"] == p.MAX_STOPS
        assert body["properties"]["logprobs"]["enum"] == [False, None]
        assert "insufficient_quota" in op["responses"]["429"]["description"]
    error = doc["paths"]["/v1/completions"]["post"]["responses"]["429"]["content"]["application/json"]["schema"]
    assert "tessera_code" in error["properties"]["error"]["properties"]


def test_embeddings_requests_and_answers():
    req = p.parse_embeddings(b'{"model": "e", "input": ["a b", "c"], "encoding_format": "base64", "user": null}')
    assert (req.inputs, req.base64) == (["a b", "c"], True)
    assert p.parse_embeddings(b'{"model": "e", "input": "x"}').inputs == ["x"]
    for body, param in (({"input": [1, 2]}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"),
                        ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": "x", "user": "u"}, "user"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
        assert _refused(p.parse_embeddings, {"model": "e", **body}).param == param
    io = p.ModelIO.from_spec({"inputs": [{"name": "prompt"}], "outputs": [{"name": "embedding"},
                                                                          {"name": "input_tokens"}]})
    assert p.embedding_body(io, "e", "a b") == {"prompt": "a b"}
    for other in (p.ModelIO(), p.ModelIO.from_spec(LIBRARY_IO["vllm"])):
        with pytest.raises(p.GatewayError) as err:
            p.embedding_body(other, "m", "x")
        assert err.value.code == "model_not_embedding"
    assert p.embedding_result(io, "e", {"embedding": [[1, 0.5]], "input_tokens": [7]}, "a b") == ([1.0, 0.5], 7)
    assert p.embedding_result(io, "e", {"embedding": [0.5]}, "a b c")[1] == 3  # no count: the words rule
    with pytest.raises(p.GatewayError) as err:
        p.embedding_result(io, "e", {"text": "no vector"}, "x")
    assert err.value.status == 502
    answer = p.embedding_object(req, [[1.0, -2.5], [0.25, 0.0]], 3)
    assert answer["data"][0]["embedding"] == "AACAPwAAIMA="  # little-endian float32 1.0, -2.5
    assert answer["usage"] == {"prompt_tokens": 3, "total_tokens": 3} and answer["data"][1]["index"] == 1
    from openapi_spec_validator import validate

    from marketplace.gateway.openapi import document

    doc = document()
    validate(doc)
    assert "embedding" in doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["description"]


def test_a_tensorrtllm_library_model_gets_the_sampling_fields_its_ensemble_declares(catalog):
    from marketplace import fit
    from marketplace.hardware.triton import parse_model_config
    from marketplace.services import models as model_svc

    io = p.ModelIO.from_spec(LIBRARY_IO["tensorrtllm"])
    assert io.generative and not io.decoupled and io.max_tokens == "max_tokens"
    req = p.parse_completion(json.dumps({"model": "qwen", "prompt": "x", "max_tokens": 4, "temperature": 0,
                                         "top_p": 0.9, "seed": 11, "top_k": 3, "repetition_penalty": 1.1,
                                         "stop": "\n"}).encode())
    body = p.generate_body(io, req)
    assert body == {"text_input": "x", "max_tokens": 4, "temperature": 0.0, "top_p": 0.9, "random_seed": 11,
                    "top_k": 3, "repetition_penalty": 1.1}  # stop: the gateway's (cut), not the engine's
    with pytest.raises(p.GatewayError) as err:
        p.generate_body(io, p.parse_completion(b'{"model": "qwen", "prompt": "x", "min_p": 0.1}'))
    assert err.value.param == "min_p"
    served = p.Served()
    served.add(io, {"text_output": ["four words of text"]})  # its text output has shape [-1]
    assert served.text == "four words of text"
    # the ensemble Tessera writes declares those inputs (optional) and feeds them to the engine's
    m = LibraryModel.objects.get(key="qwen2.5-7b-instruct")
    m.backend = "tensorrtllm"
    files = model_svc.library_files("qwen", m, fit.fit(model_svc.library_shape(m), 40448, context=4096,
                                                       concurrency=4), concurrency=4)
    ens = parse_model_config(files["qwen/config.pbtxt"])
    dtype = ens.input[0].DESCRIPTOR.fields_by_name["data_type"].enum_type.values_by_number
    declared = {t.name: (dtype[t.data_type].name, t.optional) for t in ens.input}
    assert {n: d for n, (d, _) in declared.items()} == {t["name"]: t["data_type"] for t in
                                                         LIBRARY_IO["tensorrtllm"]["inputs"]}
    assert all(optional for n, (_, optional) in declared.items() if n not in ("text_input", "max_tokens"))
    llm_step = next(s for s in ens.ensemble_scheduling.step if s.model_name == "qwen-llm")
    assert llm_step.input_map["runtime_top_p"] == "top_p" and llm_step.input_map["random_seed"] == "random_seed"
    llm = parse_model_config(files["qwen-llm/config.pbtxt"])
    assert {"runtime_top_p", "runtime_top_k", "temperature", "random_seed"} <= {t.name for t in llm.input}
