"""LoRA adapters at the gateway: each adapter deployed with a vLLM library model is a model name of its own, sent to
its base deployment with ``lora_name`` selected as Triton's vLLM backend reads it, metered with the adapter's name
and rated as its own invoice line. Simulated slices (their HTTP front answers the vLLM backend's protocol)."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import openai
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from marketplace.gateway import metering
from marketplace.hardware import model_repo as mr
from marketplace.hardware import sim_http
from marketplace.models import LibraryModel, ModelDeployment
from marketplace.services import deployments
from marketplace.services import models as model_svc
from telemetry.models import UsageEvent, UsageHourly
from tests.billing_reference import rated_lines
from tests.factories import make_key, validated
from tests.gateway_fixtures import gateway_slice, gateway_tenant
from tests.unit.test_gateway import _raw
from tests.unit.test_lora import ADAPTER

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lora_fleet(sim_http_on, h100_node, tiers):
    alpha, bravo = gateway_tenant("alpha"), gateway_tenant("bravo")
    base = LibraryModel.objects.get(key="llama-3.1-8b-instruct")
    adapters = [validated(model_svc.upload_adapter(alpha[1], alpha[0], name, base,
                                                   SimpleUploadedFile("a.tar.gz", mr.archive_bytes(ADAPTER))))
                for name in ("sql", "chat")]
    a = gateway_slice(alpha, tiers["7g"])
    dep = deployments.deploy(alpha[1], a, "tuned", library_model=base, context=4096, adapters=adapters)
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    _, key_a = make_key(alpha[0], ["inference"])
    _, key_b = make_key(bravo[0], ["inference"])
    return {"a": alpha[0], "dep": dep, "key_a": key_a, "key_b": key_b}


def _served_loras():
    return [x for front in sim_http._FRONTS.values() for x in front.backend.served_loras]


def test_adapters_are_models_of_their_tenant_only(lora_fleet, gateway_factory):
    gw = gateway_factory()
    mine = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=lora_fleet["key_a"], max_retries=0, timeout=30)
    assert sorted(m.id for m in mine.models.list()) == ["chat", "sql", "tuned"]
    theirs = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=lora_fleet["key_b"], max_retries=0, timeout=30)
    assert [m.id for m in theirs.models.list()] == []
    for path, body in (("/v1/chat/completions", {"model": "{m}", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/models/{m}", None), ("/v2/models/{m}/generate_stream", {"text_input": "x"})):
        answers = []
        for model in ("sql", "no-such-model"):
            b = json.loads(json.dumps(body).replace("{m}", model)) if body else None
            status, raw, _ = _raw(gw, path.replace("{m}", model), lora_fleet["key_b"], b,
                                  method="POST" if body else "GET")
            answers.append((status, raw.decode().replace(model, "M")))
        assert answers[0] == answers[1] and answers[0][0] == 404, (path, answers)
    assert _served_loras() == []
    assert metering.consume(budget_s=10)["new"] == 0


def test_adapter_is_served_by_its_base_metered_and_invoiced_as_its_own_line(lora_fleet, gateway_factory):
    gw = gateway_factory()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=lora_fleet["key_a"], max_retries=0, timeout=30)
    r = client.completions.create(model="sql", prompt="one two three", max_tokens=4)
    assert r.model == "sql" and r.choices[0].text == "three two one three"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 4)  # vLLM reports no counts: the words rule
    client.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "a b"}], max_tokens=2)
    status, raw, _ = _raw(gw, "/v2/models/chat/generate_stream", lora_fleet["key_a"],
                          {"text_input": "x y", "sampling_parameters": json.dumps({"max_tokens": 5})})
    assert status == 200 and raw.count(b"data:") == 5
    assert _served_loras() == [("tuned", "sql"), ("tuned", None), ("tuned", "chat")]
    # a caller cannot pick an adapter by itself (it would be metered as another line)
    status, raw, _ = _raw(gw, "/v2/models/tuned/generate_stream", lora_fleet["key_a"],
                          {"text_input": "x", "parameters": {"lora_name": "sql"}})
    assert status == 400 and b"lora_name" in raw
    status, raw, _ = _raw(gw, "/v2/models/sql/infer", lora_fleet["key_a"], {"inputs": []})
    assert status == 400 and b"adapter_needs_generate" in raw
    assert len(_served_loras()) == 3

    metering.consume(budget_s=10)
    events = sorted(UsageEvent.objects.filter(tenant=lora_fleet["a"]).values_list(
        "adapter", "deployment_id", "input_tokens", "output_tokens"))
    dep = lora_fleet["dep"].pk
    assert events == [("", dep, 4, 2), ("chat", dep, 2, 5), ("sql", dep, 3, 4)]
    assert sorted(UsageHourly.objects.values_list("adapter", "input_tokens", "output_tokens")) == [
        ("", 4, 2), ("chat", 2, 5), ("sql", 3, 4)]

    now = timezone.now()
    lines = [(d.description, d.quantity) for d, _ in rated_lines(lora_fleet["a"], now - timedelta(days=1),
                                                                         now + timedelta(hours=1))
             if d.deployment_id == dep]
    million = Decimal(1_000_000)
    assert sorted(lines) == sorted([
        ("LoRA adapter chat of tuned on h100-7g: input tokens (per 1M)", 2 / million),
        ("LoRA adapter chat of tuned on h100-7g: output tokens (per 1M)", 5 / million),
        ("LoRA adapter sql of tuned on h100-7g: input tokens (per 1M)", 3 / million),
        ("LoRA adapter sql of tuned on h100-7g: output tokens (per 1M)", 4 / million),
        ("tuned on h100-7g: input tokens (per 1M)", 4 / million),
        ("tuned on h100-7g: output tokens (per 1M)", 2 / million)])
