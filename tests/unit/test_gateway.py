"""The inference gateway in front of simulated slices (their HTTP front: TESSERA_SIM_TRITON_HTTP), with the
official ``openai`` client: routing, auth and tenancy, limits, metering into the database.

The same routes in front of real tritonservers: tests/integration/test_gateway_real.py."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from datetime import timedelta

import openai
import pytest
from django.utils import timezone

from marketplace.gateway import metering
from marketplace.gateway import protocol as p
from marketplace.gateway.limits import LocalLimiter
from marketplace.gateway.metering import SpoolSink
from marketplace.models import Invoice
from marketplace.services import serving
from telemetry.models import UsageEvent
from tenants.roles import Role
from tests.factories import MembershipFactory, make_key
from tests.gateway_fixtures import gateway_deploy, gateway_slice, run_async

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fleet(gateway_fleet):
    return gateway_fleet


def _client(gw, key):
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)


def _raw(gw, path, key=None, body=None, method=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(gw.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def _drain():
    return metering.consume(budget_s=10)


def test_chat_completion_is_served_and_metered_exactly(fleet, gateway_factory):
    gw = gateway_factory()
    client = _client(gw, fleet["key_a"])
    resp = client.chat.completions.create(model="tiny-gen", messages=[{"role": "user", "content": "one two three"}],
                                          max_tokens=5)
    # the prompt the model sees: "user: one two three\nassistant:" (5 words); the model reports its counts
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 5 and resp.usage.total_tokens == 10
    assert resp.choices[0].message.content == "assistant: three two one user:"
    assert resp.choices[0].finish_reason == "length" and resp.model == "tiny-gen"
    _drain()
    ev = UsageEvent.objects.get(tenant=fleet["a"])
    assert resp.id == f"chatcmpl-{ev.event_id}"
    assert (ev.deployment_id, ev.input_tokens, ev.output_tokens, ev.requests) == (fleet["gen"].pk, 5, 5, 1)


def test_completion_and_streaming_with_usage(fleet, gateway_factory):
    gw = gateway_factory()
    client = _client(gw, fleet["key_a"])
    done = client.completions.create(model="tiny-gen", prompt="alpha beta", max_tokens=3)
    assert done.choices[0].text == "beta alpha beta" and done.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "a b c"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "assistant: c b a"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (5, 4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    _drain()
    rows = sorted(UsageEvent.objects.filter(tenant=fleet["a"]).values_list("deployment_id", "input_tokens",
                                                                             "output_tokens"))
    assert rows == sorted([(fleet["gen"].pk, 2, 3), (fleet["chat"].pk, 5, 4)])


def test_models_list_is_the_tenants_own(fleet, gateway_factory):
    gw = gateway_factory()
    assert sorted(m.id for m in _client(gw, fleet["key_a"]).models.list()) == ["tiny-chat", "tiny-gen"]
    assert [m.id for m in _client(gw, fleet["key_b"]).models.list()] == ["secret-model"]


GATEWAY_MODEL_ROUTES = [
    ("GET", "/v1/models/{m}", None),
    ("POST", "/v1/chat/completions", {"model": "{m}", "messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/v1/chat/completions", {"model": "{m}", "messages": [{"role": "user", "content": "x"}], "stream": True}),
    ("POST", "/v1/completions", {"model": "{m}", "prompt": "x"}),
    ("GET", "/v2/models/{m}", None),
    ("GET", "/v2/models/{m}/ready", None),
    ("POST", "/v2/models/{m}/infer", {"inputs": [{"name": "prompt", "shape": [1, 1], "datatype": "BYTES",
                                                  "data": ["x"]}]}),
    ("POST", "/v2/models/{m}/generate", {"prompt": "x"}),
    ("POST", "/v2/models/{m}/generate_stream", {"prompt": "x"}),
]


@pytest.mark.parametrize("method,path,body", GATEWAY_MODEL_ROUTES)
def test_another_tenants_model_is_the_same_404_as_an_unknown_one(fleet, gateway_factory, method, path, body):
    """Every gateway route that names a model: tenant A's key on tenant B's model answers exactly what it answers
    for a model that does not exist (no oracle), and nothing is served or metered."""
    gw = gateway_factory()
    answers = []
    for model in ("secret-model", "no-such-model"):
        b = json.loads(json.dumps(body).replace("{m}", model)) if body is not None else None
        status, raw, _ = _raw(gw, path.replace("{m}", model), fleet["key_a"], b, method=method)
        answers.append((status, raw.decode().replace(model, "M")))
    assert answers[0] == answers[1] and answers[0][0] == 404, answers
    # and tenant B's own key is served on the same route
    b = json.loads(json.dumps(body).replace("{m}", "secret-model")) if body is not None else None
    assert _raw(gw, path.replace("{m}", "secret-model"), fleet["key_b"], b, method=method)[0] == 200
    _drain()
    assert not UsageEvent.objects.filter(tenant=fleet["a"]).exists()


def test_kserve_generate_infer_and_metadata(fleet, gateway_factory):
    gw = gateway_factory()
    status, raw, headers = _raw(gw, "/v2/models/tiny-gen/generate", fleet["key_a"], {"prompt": "x y", "max_tokens": 2})
    assert status == 200 and json.loads(raw)["text"] == "y x" and headers["x-request-id"]
    status, raw, _ = _raw(gw, "/v2/models/tiny-chat/generate_stream", fleet["key_a"], {"prompt": "p q",
                                                                                     "max_tokens": 3})
    events = [json.loads(line[5:]) for line in raw.decode().split("\n\n") if line.startswith("data:")]
    assert status == 200 and [e["text"] for e in events] == ["q", " p", " q"]
    body = {"inputs": [{"name": "prompt", "shape": [1, 1], "datatype": "BYTES", "data": ["m n o"]}]}
    status, raw, _ = _raw(gw, "/v2/models/tiny-gen/infer", fleet["key_a"], body)
    outs = {o["name"]: o["data"] for o in json.loads(raw)["outputs"]}
    assert status == 200 and outs["input_tokens"] == [3]
    status, raw, _ = _raw(gw, "/v2/models/tiny-gen", fleet["key_a"])
    assert status == 200 and json.loads(raw)["name"] == "tiny-gen"
    assert _raw(gw, "/v2/models/tiny-gen/ready", fleet["key_a"])[0] == 200
    _drain()
    got = sorted(UsageEvent.objects.values_list("input_tokens", "output_tokens"))
    assert got == sorted([(2, 2), (2, 3), (3, 16)])


def test_keys_revoked_expired_without_scope_and_tenant_states(fleet, gateway_factory):
    gw = gateway_factory(refresh_s=0.5)
    tenant = fleet["a"]
    key, secret = make_key(tenant, ["inference"])
    _, no_scope = make_key(tenant, ["read"])
    _, expired = make_key(tenant, ["inference"], expires_at=timezone.now() + timedelta(seconds=1))
    gw.refresh()
    chat = {"model": "tiny-gen", "messages": [{"role": "user", "content": "hi"}]}
    assert _raw(gw, "/v1/chat/completions", secret, chat)[0] == 200
    status, raw, _ = _raw(gw, "/v1/chat/completions", no_scope, chat)
    assert status == 403 and json.loads(raw)["error"]["code"] == "insufficient_scope"
    time.sleep(1.1)
    status, raw, _ = _raw(gw, "/v1/chat/completions", expired, chat)
    assert status == 401 and json.loads(raw)["error"]["code"] == "api_key_expired"
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at"])
    deadline = time.monotonic() + 5
    while _raw(gw, "/v1/chat/completions", secret, chat)[0] == 200:
        assert time.monotonic() < deadline, "a revoked key still answered after 5 s"
        time.sleep(0.1)
    status, raw, _ = _raw(gw, "/v1/chat/completions", secret, chat)
    assert status == 401 and json.loads(raw)["error"]["code"] == "api_key_revoked"
    assert _raw(gw, "/v1/chat/completions", "tsk_nope_nope", chat)[0] == 401
    assert _raw(gw, "/v1/chat/completions", None, chat)[0] == 401

    tenant.status, tenant.suspended_reason = "suspended", "unpaid invoice INV-7"
    tenant.save()
    gw.refresh()
    status, raw, _ = _raw(gw, "/v1/chat/completions", fleet["key_a"], chat)
    assert status == 403 and "unpaid invoice INV-7" in json.loads(raw)["error"]["message"]
    tenant.status, tenant.monthly_spend_limit = "active", 10
    tenant.save()
    Invoice.objects.update_or_create(tenant=tenant, period_start=timezone.now().date().replace(day=1), defaults={
        "period_end": timezone.now().date().replace(day=28) + timedelta(days=4), "currency": "USD", "total": 10})
    gw.refresh()
    status, raw, headers = _raw(gw, "/v1/chat/completions", fleet["key_a"], chat)
    error = json.loads(raw)["error"]
    # OpenAI's answer for a spent quota, not retried by its SDKs; Tessera's reason beside it
    assert status == 429 and headers["x-should-retry"] == "false"
    assert (error["type"], error["code"], error["tessera_code"]) == ("insufficient_quota", "insufficient_quota",
                                                                     "spend_limit_reached")
    with pytest.raises(openai.RateLimitError) as quota:
        _client(gw, fleet["key_a"]).chat.completions.create(**chat)
    assert quota.value.code == "insufficient_quota" and quota.value.body["tessera_code"] == "spend_limit_reached"
    status, raw, _ = _raw(gw, "/v2/models/tiny-gen/generate", fleet["key_a"], {"prompt": "a"})
    assert status == 429 and json.loads(raw)["code"] == "spend_limit_reached"


def test_request_and_token_limits_answer_429_with_retry_after(fleet, gateway_factory):
    tenant = fleet["a"]
    _, few = make_key(tenant, ["inference"])
    from tenants.models import ApiKey

    ApiKey.objects.filter(prefix=few.split("_")[1]).update(requests_per_minute=2)
    gw = gateway_factory(limiter=LocalLimiter())
    chat = {"model": "tiny-gen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    minute = int(time.time() // 60)
    statuses = [_raw(gw, "/v1/chat/completions", few, chat) for _ in range(3)]
    if int(time.time() // 60) == minute:  # the three fell in one window
        assert [s for s, _, _ in statuses] == [200, 200, 429]
        assert json.loads(statuses[2][1])["error"]["code"] == "request_rate_limit"
        assert 1 <= int(statuses[2][2]["Retry-After"]) <= 60


def test_load_is_balanced_over_deployments_of_one_name_and_a_dead_one_is_taken_out(fleet, gateway_factory):
    owner = fleet["a_owner"]
    second = gateway_slice(owner, fleet["tiers"]["1g"])
    other = gateway_deploy(owner, second, "tiny-gen", "tiny-gen")
    gw = gateway_factory()
    client = _client(gw, fleet["key_a"])
    # Sequential requests: every pick is a tie (nothing in flight), broken at random. With 8 requests all of
    # them fell on one deployment once in CI (a 1-in-128 chance); with 30 that chance is 1 in 2**29.
    for _ in range(30):
        client.completions.create(model="tiny-gen", prompt="w", max_tokens=1)
    _drain()
    per = {d: UsageEvent.objects.filter(deployment_id=d).count() for d in (fleet["gen"].pk, other.pk)}
    assert sum(per.values()) == 30 and all(per.values()), per
    serving.runtime().kill(serving.spec_for(second.triton_server, second))
    # the dead one is failed over (no answer lost), then taken out; the answers keep coming from the live one
    ok = [client.completions.create(model="tiny-gen", prompt="w", max_tokens=1) for _ in range(10)]
    assert len(ok) == 10
    _drain()
    assert UsageEvent.objects.filter(deployment_id=fleet["gen"].pk).count() == per[fleet["gen"].pk] + 10


def test_spool_sink_without_redis_is_consumed_once(settings, fleet, tmp_path):
    import asyncio

    settings.REDIS_URL = ""
    settings.TESSERA_USAGE_SPOOL_DIR = tmp_path / "spool"
    sink = SpoolSink()

    async def write():
        await sink.start()
        await asyncio.gather(*(sink.append(metering.event(f"gw-{i}", fleet["a"].pk, fleet["gen"].pk, 2, 3))
                               for i in range(50)))
        await sink.close()

    run_async(write)
    assert metering.consume(budget_s=5) == {"processed": 50, "new": 50, "refused": 0}
    assert metering.consume(budget_s=5) == {"processed": 0, "new": 0, "refused": 0}
    assert UsageEvent.objects.count() == 50


def test_protocol_errors_and_binary_counts():
    with pytest.raises(p.GatewayError) as err:
        p.parse_chat(b'{"model": "m", "messages": []}')
    assert err.value.status == 400 and err.value.openai_body()["error"]["param"] == "messages"
    with pytest.raises(p.GatewayError):
        p.parse_completion(b"not json")
    with pytest.raises(p.GatewayError):
        p.parse_chat(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}')
    head = json.dumps({"outputs": [
        {"name": "input_tokens", "datatype": "INT32", "shape": [2, 1], "parameters": {"binary_data_size": 8}},
        {"name": "output_tokens", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": 8}}]}).encode()
    body = head + (3).to_bytes(4, "little") + (4).to_bytes(4, "little") + (9).to_bytes(8, "little")
    assert p.infer_counts(body, len(head)) == (7, 9)
    assert p.infer_counts(b'{"outputs": [{"name": "text", "datatype": "BYTES", "data": ["x"]}]}', None) == (None, None)


def test_portal_model_page_shows_the_endpoint_and_try_it_is_served_by_the_gateway(fleet, gateway_factory, client,
                                                                                 settings):
    from django.urls import reverse

    gw = gateway_factory()
    settings.TESSERA_GATEWAY_INTERNAL_URL, settings.TESSERA_GATEWAY_URL = gw.url, "https://infer.msp.example"
    client.force_login(fleet["a_owner"][1].user)
    body = client.get(reverse("portal:deployment", args=[fleet["gen"].pk])).content.decode()
    assert "https://infer.msp.example/v1" in body and "&quot;model&quot;: &quot;tiny-gen&quot;" in body
    assert "$TESSERA_API_KEY" in body and 'id="try-it"' in body and "latency p50" not in body
    r = client.post(reverse("portal:deployment_try", args=[fleet["gen"].pk]), {"prompt": "hello world",
                                                                             "max_tokens": "3"})
    assert r.status_code == 200 and "assistant: world hello" in r.content.decode()
    _drain()
    ev = UsageEvent.objects.get(deployment=fleet["gen"])
    assert (ev.input_tokens, ev.output_tokens) == (4, 3)
    assert r.context["tried"]["id"] == f"chatcmpl-{ev.event_id}" and ev.latency_ms is not None
    page = client.get(reverse("portal:deployment", args=[fleet["gen"].pk])).content.decode()
    assert "1 requests" in page and f"latency p50 {ev.latency_ms} ms, p95 {ev.latency_ms} ms" in page
    viewer = MembershipFactory(tenant=fleet["a"], role=Role.VIEWER).user
    client.force_login(viewer)
    assert client.post(reverse("portal:deployment_try", args=[fleet["gen"].pk]), {"prompt": "x"}).status_code == 403
    assert 'id="try-it"' not in client.get(reverse("portal:deployment", args=[fleet["gen"].pk])).content.decode()


def test_metered_vs_served_mismatch_opens_one_drift_event_and_shows_in_the_console(fleet, client, operator):
    from django.urls import reverse

    from marketplace.models import DriftEvent
    from telemetry.models import TritonServedHourly, UsageHourly
    from telemetry.services.scrape import check_metering

    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    gen, chat = fleet["gen"], fleet["chat"]
    for dep, metered, served in ((gen, 100, 160), (chat, 200, 202)):  # gen: 60 served and never metered
        UsageHourly.objects.create(tenant=fleet["a"], deployment=dep, hour=hour, requests=metered, events=metered,
                                   input_tokens=metered * 10, output_tokens=metered, updated_at=timezone.now())
        TritonServedHourly.objects.create(tenant=fleet["a"], deployment=dep, hour=hour, requests=served)
    node_id = gen.allocation.node_id
    found = check_metering(node_id)
    assert [r["deployment"] for r in found] == [gen.pk]  # chat is within the 2 % tolerance
    assert check_metering(node_id + 1000) == []  # another node's scrape compares only its own deployments
    check_metering(node_id)  # still off: the open event is not repeated
    (event,) = DriftEvent.objects.filter(kind=DriftEvent.Kind.METERING_MISMATCH)
    assert not event.resolved and event.allocation_id == gen.allocation_id and "(-60)" in event.detail
    client.force_login(operator)
    assert "Metered requests differ" in client.get(reverse("console:overview")).content.decode()
    page = client.get(reverse("console:allocation_metering")).content.decode()
    assert "1 deployment out of tolerance" in page and '<span class="badge warn">-60</span>' in page


def test_the_hot_path_makes_no_database_query(fleet, gateway_factory, monkeypatch):
    """Keys, routes, tenants and limits come from the in-memory snapshot: serving (plain, streamed, KServe) runs
    no SQL in any thread of the process."""
    from django.db.backends import utils

    gw = gateway_factory(refresh_s=3600)  # loaded once at startup, not again during the test
    ran = []
    for name in ("execute", "executemany"):
        original = getattr(utils.CursorWrapper, name)
        monkeypatch.setattr(utils.CursorWrapper, name,
                            lambda self, sql, *a, _o=original, **k: ran.append(sql) or _o(self, sql, *a, **k))
    client = _client(gw, fleet["key_a"])
    for _ in range(5):
        client.chat.completions.create(model="tiny-gen", messages=[{"role": "user", "content": "q"}], max_tokens=2)
    list(client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "q"}],
                                        max_tokens=3, stream=True))
    assert _raw(gw, "/v2/models/tiny-gen/generate", fleet["key_a"], {"prompt": "q"})[0] == 200
    assert _raw(gw, "/v1/chat/completions", fleet["key_b"], {"model": "tiny-gen", "messages": []})[0] == 400
    assert ran == []
    gw.refresh()  # the spy sees queries where there are some: the snapshot's four
    assert len(ran) >= 4


def test_a_vllm_library_model_is_called_with_vllms_tensors():
    from marketplace.services.deployments import LIBRARY_IO

    io = p.ModelIO.from_spec(LIBRARY_IO["vllm"])
    body = p.generate_body(io, p.TextRequest(model="llama", prompt="hi", max_tokens=5, stream=True))
    assert io.decoupled and io.text == "text_output"
    assert body == {"text_input": "hi", "stream": True, "sampling_parameters": '{"max_tokens": 5}'}
    served = p.Served()
    served.add(io, {"text_output": "hello there"})
    assert served.usage("hi") == (1, 2)  # vLLM reports no counts: the words rule


def test_try_it_tokens_are_bound_to_their_tenant_and_cannot_be_forged(fleet, gateway_factory, settings):
    """A hostile tenant with a portal session: its minted token reaches only its own models, an edited token (the
    tenant id swapped) or a stale one is refused, and a client-sent repository secret header gains nothing."""
    from django.core import signing

    from marketplace.gateway.state import TRY_PREFIX, TRY_SALT, mint_try_token

    gw = gateway_factory()
    chat = {"model": "tiny-gen", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    b_token = mint_try_token(fleet["b"].pk, 1)
    assert _raw(gw, "/v1/chat/completions", b_token, chat)[0] == 404  # B's token, A's model name
    assert _raw(gw, "/v1/chat/completions", b_token, {**chat, "model": "secret-model"})[0] == 200
    raw = signing.loads(b_token[len(TRY_PREFIX):], salt=TRY_SALT)
    body = b_token[len(TRY_PREFIX):].split(":", 1)[1]
    forged = TRY_PREFIX + signing.dumps({**raw, "t": fleet["a"].pk}, key="not-the-secret", salt=TRY_SALT)
    assert _raw(gw, "/v1/chat/completions", forged, chat)[0] == 401
    assert _raw(gw, "/v1/chat/completions", TRY_PREFIX + "x" + body, chat)[0] == 401
    settings.TESSERA_GATEWAY_TRY_TTL_S = 1
    time.sleep(2.1)
    status, answer, _ = _raw(gw, "/v1/chat/completions", b_token, {**chat, "model": "secret-model"})
    assert status == 401 and json.loads(answer)["error"]["code"] == "token_expired"
    # the per-server secret is Tessera's: a client's own "tessera-repository-key" header is not forwarded
    req = urllib.request.Request(gw.url + "/v2/models/secret-model/generate", data=b'{"prompt": "x"}', headers={
        "Authorization": f"Bearer {fleet['key_a']}", "tessera-repository-key": "guess"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 404


def test_a_key_past_its_monthly_token_allowance_is_refused_like_a_spent_quota(fleet, gateway_factory):
    from tenants.models import ApiKey

    tenant = fleet["a"]
    _, capped = make_key(tenant, ["inference"])
    prefix = capped.split("_")[1]
    ApiKey.objects.filter(prefix=prefix).update(monthly_token_allowance=12)
    gw = gateway_factory()
    client, other = _client(gw, capped), _client(gw, fleet["key_a"])
    first = client.completions.create(model="tiny-gen", prompt="one two three", max_tokens=5)
    assert first.usage.total_tokens == 8  # under the allowance: served
    _drain()
    gw.refresh()
    client.completions.create(model="tiny-gen", prompt="one two three", max_tokens=5)  # 8 of 12 used: served
    _drain()
    gw.refresh()  # 16 >= 12: this key is refused, the tenant's other keys are not
    with pytest.raises(openai.RateLimitError) as quota:
        client.completions.create(model="tiny-gen", prompt="again", max_tokens=1)
    assert quota.value.code == "insufficient_quota" and quota.value.body["tessera_code"] == "key_allowance_reached"
    assert "12 tokens" in quota.value.body["message"] and quota.value.response.headers["x-should-retry"] == "false"
    assert other.completions.create(model="tiny-gen", prompt="w", max_tokens=1).usage.completion_tokens == 1
    # the tenant's admin raises it: served again at the next refresh
    ApiKey.objects.filter(prefix=prefix).update(monthly_token_allowance=100)
    gw.refresh()
    assert client.completions.create(model="tiny-gen", prompt="w", max_tokens=1).usage.completion_tokens == 1
    _drain()
    assert sum(e.input_tokens + e.output_tokens for e in UsageEvent.objects.filter(api_key=prefix)) == 18
