"""Streams the client cuts, and the metering fallback: what is billed is what the gateway wrote.

The upstream is ``tests.stream_upstream.StreamUpstream`` (Triton's ``generate_stream`` framing, held after three
events until the client has gone), so what the gateway wrote before it saw the disconnect is known: three
events. The same against a real tritonserver: tests/integration/test_gateway_real.py; Redis killed mid-stream:
tests/faults/test_stream_metering.py.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

import pytest

from marketplace.gateway import metering, signing
from marketplace.gateway.metering import RedisStreamSink, SpoolSink, UsageSink
from telemetry.models import UsageEvent
from tests.gateway_fixtures import GatewayProcess, run_async
from tests.stream_upstream import StreamUpstream
from tests.worker_process import test_database_url as database_url

pytestmark = pytest.mark.django_db(transaction=True)
# Events the gateway may write after the client's close reached it: the one in hand when it is seen (measured in
# tests/bench/stream_cut.py; README, "Metering").
CUT_BOUND = 1


@pytest.fixture
def upstream(gateway_fleet):
    up = StreamUpstream(hold_after=3).start()
    up.point(gateway_fleet["chat"])  # tiny-chat (and tiny-gen, on the same server) now lead to it
    yield up
    up.stop()


def open_stream(gw, key: str, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_words(s: socket.socket, n: int) -> list[str]:
    """Read the stream's events until they hold ``n`` words of text (OpenAI chunks or Triton's events)."""
    got, words = b"", []
    while len(words) < n:
        data = s.recv(65536)
        assert data, f"the stream ended after {words}"
        got += data
        words = []
        for line in got.split(b"\n")[:-1]:  # whole lines only
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if "choices" in obj:
                choice = obj["choices"][0] if obj["choices"] else {}
                words += (choice.get("text") or (choice.get("delta") or {}).get("content") or "").split()
            else:
                words += str(obj.get("text", "")).split()
    return words


ROUTES = [
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "max_tokens": 1000, "stream": True}),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 1000, "stream": True}),
    ("/v2/models/tiny-chat/generate_stream", {"prompt": "x", "max_tokens": 1000}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=["completions", "chat", "kserve"])
def test_a_cut_stream_cancels_the_upstream_and_bills_what_was_written(gateway_fleet, gateway_factory, upstream,
                                                                       path, body):
    gw = gateway_factory()
    s = open_stream(gw, gateway_fleet["key_a"], path, body)
    words = read_words(s, 3)
    s.close()  # the client leaves after three words, while the model is between two tokens
    # the upstream request is dropped at once, not when its next token comes (it would wait for release())
    assert upstream.cancelled.wait(20), "the upstream request was not cancelled when the client left"
    upstream.release()
    assert upstream.finished.wait(20) and upstream.sent == 3
    assert words == ["w1", "w2", "w3"]
    assert metering.consume(budget_s=10)["new"] == 1
    ev = UsageEvent.objects.get(tenant=gateway_fleet["a"])
    assert ev.deployment_id == gateway_fleet["chat"].pk
    assert 3 <= ev.output_tokens <= 3 + CUT_BOUND, ev.output_tokens


def test_a_cut_stream_under_the_production_server(gateway_fleet, upstream, settings, tmp_path):
    """The same under ``manage.py gateway`` (uvloop and httptools: their transport is not asyncio's)."""
    settings.TESSERA_USAGE_STREAM = f"tessera:test-usage:{uuid.uuid4().hex[:8]}"
    settings.TESSERA_USAGE_SPOOL_DIR = tmp_path / "spool"
    env = {**os.environ, "DATABASE_URL": database_url(), "REDIS_URL": settings.REDIS_URL,
           "TESSERA_USAGE_STREAM": settings.TESSERA_USAGE_STREAM, "TESSERA_USAGE_SPOOL_DIR": str(tmp_path / "spool"),
           "SECRET_KEY": settings.SECRET_KEY, "TESSERA_GATEWAY_REFRESH_S": "0.5", "LOG_FORMAT": "text",
           "LOG_LEVEL": "WARNING"}
    gw = GatewayProcess(env, tmp_path).start()
    try:
        s = open_stream(gw, gateway_fleet["key_a"], *ROUTES[1])
        assert read_words(s, 3) == ["w1", "w2", "w3"]
        s.close()
        assert upstream.cancelled.wait(20), "the upstream request was not cancelled when the client left"
        upstream.release(held=True)
        upstream.reset()
        s = open_stream(gw, gateway_fleet["key_a"], "/v1/completions",  # the next one on a fresh upstream
                        {"model": "tiny-chat", "prompt": "x", "max_tokens": 2, "stream": True})
        got = b""
        while not got.endswith(b"\r\n0\r\n\r\n"):
            data = s.recv(65536)
            assert data, got[-300:]
            got += data
        s.close()
        assert b"data: [DONE]" in got
    finally:
        gw.stop()
    assert metering.consume(budget_s=10)["new"] == 2
    assert sorted(UsageEvent.objects.values_list("output_tokens", flat=True)) == [2, 3]
    if settings.REDIS_URL:
        import redis

        redis.Redis.from_url(settings.REDIS_URL).delete(settings.TESSERA_USAGE_STREAM)


def test_a_stream_read_whole_is_billed_whole(gateway_fleet, gateway_factory, upstream):
    upstream.release()
    gw = gateway_factory()
    s = open_stream(gw, gateway_fleet["key_a"], "/v1/completions",
                    {"model": "tiny-chat", "prompt": "x", "max_tokens": 40, "stream": True})
    got = b""
    while not got.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of the chunked body
        data = s.recv(65536)
        assert data, got[-300:]
        got += data
    s.close()
    assert got.count(b'"text":" w') == 40 and b"data: [DONE]" in got and b"error" not in got
    assert not upstream.cancelled.is_set() and upstream.sent == 40
    metering.consume(budget_s=10)
    assert UsageEvent.objects.get(tenant=gateway_fleet["a"]).output_tokens == 40


class HangingSink(UsageSink):
    """A sink whose store never answers (a Redis behind a network that drops packets)."""

    async def _write(self, events):
        import asyncio

        await asyncio.Event().wait()


def test_a_stream_the_sink_does_not_answer_for_ends_with_an_error_event_and_is_kept_in_the_fallback(
        gateway_fleet, gateway_factory, upstream, tmp_path):
    upstream.release()
    fallback = tmp_path / "fallback"
    gw = gateway_factory(sink=HangingSink(), fallback=SpoolSink(fallback))
    s = open_stream(gw, gateway_fleet["key_a"], "/v1/chat/completions",
                    {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                     "stream": True})
    got = b""
    while not got.endswith(b"\r\n0\r\n\r\n"):
        data = s.recv(65536)
        assert data, got[-300:]
        got += data
    s.close()
    events = [json.loads(line[6:]) for line in got.split(b"\n") if line.startswith(b"data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices")) == \
        " w1 w2 w3 w4 w5 w6"
    assert events[-1]["error"]["code"] == "metering_unavailable" and b"[DONE]" not in got
    (kept,) = fallback.glob("*.jsonl")
    (line,) = kept.read_bytes().splitlines()
    e, reason = signing.keyring().open(signing.spool_fields(line))
    assert reason is None
    assert (e["id"], e["t"], e["d"], e["i"], e["o"]) == (events[0]["id"].removeprefix("chatcmpl-"),
                                                         gateway_fleet["a"].pk, gateway_fleet["chat"].pk, 5, 6)


def test_the_fallback_is_replayed_once_and_a_changed_line_is_not_billed(settings, gateway_fleet, tmp_path):
    """What a gateway kept in its fallback (Redis down) goes to the stream as it was signed, once per line even
    when replayed again (a gateway killed before saving its offset); a line changed in the folder is refused."""
    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL")
    import uuid

    import redis.asyncio as aioredis

    settings.TESSERA_USAGE_STREAM = f"tessera:test-usage:{uuid.uuid4().hex[:8]}"
    d = tmp_path / "fallback"
    a, dep = gateway_fleet["a"].pk, gateway_fleet["chat"].pk
    events = [metering.event(f"fb-{i}", a, dep, 5, 3 + i) for i in range(3)]

    async def keep():
        sink = SpoolSink(d)
        await sink.start()
        for e in events:
            await sink.append(e)
        await sink.close()

    async def replay():
        r = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            return await RedisStreamSink(r).replay(d)
        finally:
            await r.aclose()

    run_async(keep)
    (spooled,) = d.glob("*.jsonl")
    assert run_async(replay) == 3
    assert run_async(replay) == 0  # its offset is saved: nothing appended twice
    spooled.with_suffix(".offset").unlink()  # as if killed between the append and saving the offset
    assert run_async(replay) == 3
    assert metering.consume(budget_s=10) == {"processed": 6, "new": 3, "refused": 0}
    assert sorted(UsageEvent.objects.values_list("event_id", "output_tokens")) == [("fb-0", 3), ("fb-1", 4),
                                                                                   ("fb-2", 5)]
    # a tenant (or anyone) who could write to the folder: a bigger bill, a made-up event
    lines = spooled.read_bytes().split(b"\n")[:-1]
    changed = json.loads(lines[0])
    changed["e"] = changed["e"].replace('"o":3', '"o":3000').replace("fb-0", "fb-x")
    spooled.write_bytes(json.dumps(changed).encode() + b"\n" + b'{"e": "{\\"id\\": \\"fb-y\\"}"}\n')
    spooled.with_suffix(".offset").unlink()
    assert run_async(replay) == 2
    assert metering.consume(budget_s=10) == {"processed": 2, "new": 0, "refused": 2}
    assert UsageEvent.objects.count() == 3
    import redis

    r = redis.Redis.from_url(settings.REDIS_URL)
    r.delete(settings.TESSERA_USAGE_STREAM, metering.dead_letter_stream())
