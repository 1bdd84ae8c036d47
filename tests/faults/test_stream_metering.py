"""Redis killed in the middle of a stream: the stream ends with an error event, never as a whole unbilled answer,
and what it sent is billed once Redis is back (the gateway's local fallback, replayed), exactly once.

A gateway in this process (uvicorn in a thread) on a private redis-server (conftest.PrivateRedis: AOF, fsync
always), in front of ``tests.stream_upstream.StreamUpstream``, which holds the stream after three events while
the test kills Redis, then sends the rest.
"""

from __future__ import annotations

import json
import uuid

import pytest

from marketplace.gateway import metering, signing
from telemetry.models import UsageEvent
from tests.faults.conftest import needs_real_services
from tests.stream_upstream import StreamUpstream
from tests.unit.test_gateway_streams import open_stream, read_words
from tests.worker_process import wait_for

pytestmark = [needs_real_services, pytest.mark.django_db(transaction=True)]
BODY = {"model": "tiny-chat", "prompt": "x", "max_tokens": 10, "stream": True}


def read_to_end(s) -> bytes:
    got = b""
    while not got.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
        data = s.recv(65536)
        assert data, f"the connection broke without the stream's end: {got[-500:]!r}"
        got += data
    return got


def events_of(raw: bytes) -> list:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
            for line in raw.split(b"\n") if line.startswith(b"data: ")]


def test_redis_killed_mid_stream_ends_it_with_an_error_event_and_bills_it_once_redis_is_back(
        private_redis, settings, gateway_fleet, gateway_factory, tmp_path):
    settings.REDIS_URL = private_redis.url  # the gateway's sink, limits and this process's consumer
    up = StreamUpstream(hold_after=3).start()
    try:
        up.point(gateway_fleet["chat"])
        gw = gateway_factory()
        settings.TESSERA_USAGE_STREAM = f"tessera:test-usage:{uuid.uuid4().hex[:8]}"  # after the factory's own
        gw.app.sink.stream = settings.TESSERA_USAGE_STREAM
        key = gateway_fleet["key_a"]

        s = open_stream(gw, key, "/v1/completions", BODY)
        head = read_words(s, 3)
        private_redis.kill9()  # Redis dies while the stream is being served ...
        up.release()  # ... and the model sends the rest
        raw = read_to_end(s)
        s.close()
    finally:
        up.stop()
    events = events_of(raw)
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    assert head == ["w1", "w2", "w3"]
    assert text.split()[-7:] == [f"w{i}" for i in range(4, 11)]  # the text went out before the metering ...
    assert events[-1] == {"error": {"message": events[-1]["error"]["message"], "type": "server_error",
                                    "param": None, "code": "metering_unavailable"}}  # ... and the end did not
    assert "[DONE]" not in events
    assert not any(e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices"))

    # kept in the gateway's fallback, signed like a stream entry
    (kept,) = (tmp_path / "spool" / metering.FALLBACK).glob("*.jsonl")
    (line,) = kept.read_bytes().splitlines()
    e, reason = signing.keyring().open(signing.spool_fields(line))
    assert reason is None and (e["id"], e["t"], e["d"], e["o"]) == (
        events[0]["id"].removeprefix("cmpl-"), gateway_fleet["a"].pk, gateway_fleet["chat"].pk, 10)
    assert not UsageEvent.objects.exists()

    private_redis.start()  # Redis is back (from its AOF): the gateway replays its fallback into the stream
    r = private_redis.client()
    wait_for(lambda: r.xlen(settings.TESSERA_USAGE_STREAM) >= 1, 30, "the fallback replayed into the stream")
    assert metering.consume(budget_s=10) == {"processed": 1, "new": 1, "refused": 0}
    ev = UsageEvent.objects.get()
    assert (ev.event_id, ev.tenant_id, ev.deployment_id, ev.output_tokens) == (e["id"], gateway_fleet["a"].pk,
                                                                             gateway_fleet["chat"].pk, 10)
    # the file is replayed to its end (its saved offset; deleted once the gateway has rotated to a new one)
    assert int(kept.with_suffix(".offset").read_text()) == kept.stat().st_size
    assert r.xlen(settings.TESSERA_USAGE_STREAM) == 0  # consumed: nothing appended twice
    assert metering.consume(budget_s=2) == {"processed": 0, "new": 0, "refused": 0}
