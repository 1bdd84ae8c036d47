"""The Redis limiter on its own (a real Redis: REDIS_URL): admission is EVALSHA alone (no SCRIPT EXISTS round trip
per pipeline), a Redis that lost the script (restart, SCRIPT FLUSH) gets it again, and every limit still holds:
requests per minute, tokens per minute, concurrent requests per tenant, shared by concurrent admissions."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from django.conf import settings

from marketplace.gateway import limits
from marketplace.gateway.limits import PREFIX, RedisLimiter
from marketplace.gateway.protocol import GatewayError
from marketplace.gateway.state import Caller, TenantInfo
from tests.gateway_fixtures import run_async


def _caller(rpm: int = 0, tpm: int = 0, conc: int = 0) -> Caller:
    tenant_id = uuid.uuid4().int % 10**9  # a tenant and key of its own: no state shared with other runs
    tenant = TenantInfo(tenant_id, "t", True, "", False, "", conc)
    prefix = uuid.uuid4().hex[:12]
    return Caller(tenant, prefix, f"key:{prefix}", rpm, tpm)


def _run(test) -> None:
    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL")
    import redis.asyncio as aioredis

    async def main() -> None:
        r = aioredis.Redis.from_url(settings.REDIS_URL)
        limiter = RedisLimiter(r)
        try:
            await test(r, limiter)
        finally:
            await limiter.close()
            await r.aclose()

    run_async(main)  # (its own thread: a browser test leaves Playwright's loop running in this one)


def _code(exc: pytest.ExceptionInfo) -> str:
    return exc.value.code


def test_a_script_redis_lacks_is_loaded_and_no_script_exists_is_sent(monkeypatch):
    # a variant of the script no Redis has seen (SCRIPT FLUSH would empty a shared server's cache for everyone)
    monkeypatch.setattr(limits, "ADMIT", f"{limits.ADMIT}\n-- {uuid.uuid4().hex}")

    async def test(r, limiter):
        assert not (await r.script_exists(limiter._admit.sha))[0]
        caller = _caller(rpm=100)
        await limiter.admit(caller, "a")  # NOSCRIPT -> loaded -> admitted
        await limiter.done(caller, "a", 0)
        assert (await r.script_exists(limiter._admit.sha))[0]
        sent: list[str] = []
        real = r.connection_pool.get_connection

        async def spy(*args, **kwargs):
            conn = await real(*args, **kwargs)
            send = conn.send_packed_command

            async def record(command, *a, **k):
                sent.append(bytes(b"".join(command) if isinstance(command, list) else command).decode(errors="replace"))
                return await send(command, *a, **k)

            conn.send_packed_command = record
            return conn

        r.connection_pool.get_connection = spy
        await limiter.admit(caller, "b")
        assert sent and not any("SCRIPT" in s.upper() and "EXISTS" in s.upper() for s in sent)
        assert any("EVALSHA" in s.upper() for s in sent)

    _run(test)


def test_request_token_and_concurrency_limits_hold_under_concurrent_admissions():
    async def test(r, limiter):
        # 20 concurrent admissions against 5 requests/minute: exactly 5 admitted (they share pipelines)
        caller = _caller(rpm=5)
        results = await asyncio.gather(*(limiter.admit(caller, f"r{i}") for i in range(20)), return_exceptions=True)
        refused = [x for x in results if isinstance(x, GatewayError)]
        assert len(refused) == 15 and {x.code for x in refused} == {"request_rate_limit"}

        # concurrency: 3 in flight at most; one ending lets one more in
        caller = _caller(conc=3)
        results = await asyncio.gather(*(limiter.admit(caller, f"c{i}") for i in range(8)), return_exceptions=True)
        admitted = [f"c{i}" for i, x in enumerate(results) if x is None]
        assert len(admitted) == 3
        assert {x.code for x in results if isinstance(x, GatewayError)} == {"concurrency_limit"}
        await limiter.done(caller, admitted[0], 0)
        await limiter.admit(caller, "again")
        with pytest.raises(GatewayError) as exc:
            await limiter.admit(caller, "one-more")
        assert _code(exc) == "concurrency_limit"

        # tokens: counted when served; once the minute's tokens are reached the next request is refused
        caller = _caller(tpm=100)
        await limiter.admit(caller, "t1")
        await limiter.done(caller, "t1", 150)
        with pytest.raises(GatewayError) as exc:
            await limiter.admit(caller, "t2")
        assert _code(exc) == "token_rate_limit"
        assert await r.zcard(f"{PREFIX}conc:{caller.tenant.id}") == 0  # nothing left in flight

    _run(test)


def test_a_requests_end_reaches_redis_within_defer_s_without_another_admission():
    async def test(r, limiter):
        caller = _caller(tpm=1000, conc=5)
        await limiter.admit(caller, "x")
        conc = f"{PREFIX}conc:{caller.tenant.id}"
        assert await r.zcard(conc) == 1
        minute = int(time.time() // 60)
        await limiter.done(caller, "x", 42)  # nothing awaited: sent with the next pipeline or after DEFER_S
        await asyncio.sleep(limits.DEFER_S + 0.05)
        assert await r.zcard(conc) == 0  # what other gateway processes see
        if int(time.time() // 60) == minute:
            assert int(await r.get(f"{PREFIX}tpm:{caller.key_prefix}:{minute}")) == 42

    _run(test)


def test_close_sends_the_ends_not_yet_sent():
    async def test(r, limiter):
        caller = _caller(conc=5)
        await limiter.admit(caller, "y")
        await limiter.done(caller, "y", 0)
        await limiter.close()
        assert await r.zcard(f"{PREFIX}conc:{caller.tenant.id}") == 0

    _run(test)


def test_the_sink_shares_the_limiters_pipeline_and_a_refused_event_is_not_durable():
    from marketplace.gateway import signing
    from marketplace.gateway.metering import MeteringUnavailable, RedisStreamSink, event

    async def test(r, _own):
        shared = limits.Pipeliner(r)
        limiter = RedisLimiter(r, shared)
        stream = f"tessera:test-shared:{uuid.uuid4().hex[:8]}"
        sink = RedisStreamSink(r, stream, pipeliner=shared)
        pipelines = []
        real = r.pipeline

        def counted(*args, **kwargs):
            pipelines.append(1)
            return real(*args, **kwargs)

        r.pipeline = counted
        caller = _caller(rpm=100, conc=5)
        try:
            e = event("req-1", caller.tenant.id, 7, 3, 4, key=caller.key_prefix)
            await asyncio.gather(limiter.admit(caller, "req-2"), sink.append(e))
            assert len(pipelines) == 1  # the admission and the usage event: one round trip
            assert await r.zcard(f"{PREFIX}conc:{caller.tenant.id}") == 1
            (_id, fields), = await r.xrange(stream)
            opened, reason = signing.keyring().open(fields)
            assert reason is None and opened == e  # signed as the sink's own pipeline signs it
            assert sink.written == 1

            # Redis refuses this XADD (the key is not a stream): that event is not durable (the answer is withheld,
            # 503 metering_unavailable), the admission in the same pipeline is not affected
            await r.set(f"{stream}:wrong", "x")
            refused = RedisStreamSink(r, f"{stream}:wrong", pipeliner=shared)
            admitted, failed = await asyncio.gather(limiter.admit(caller, "req-3"),
                                                    refused.append(event("req-4", caller.tenant.id, 7, 1, 1)),
                                                    return_exceptions=True)
            assert admitted is None and isinstance(failed, MeteringUnavailable)
            assert await r.zcard(f"{PREFIX}conc:{caller.tenant.id}") == 2
        finally:
            r.pipeline = real
            await limiter.close()
            await r.delete(stream, f"{stream}:wrong", f"{PREFIX}conc:{caller.tenant.id}")

    _run(test)
