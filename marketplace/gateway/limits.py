"""Limits every gateway process shares: requests and tokens per key per minute, concurrent requests per tenant.

Windows are fixed UTC minutes. Admission is one Lua script (EVALSHA: one Redis command): it refuses when the
tenant already has ``max_concurrent`` requests in flight, when the key's tokens this minute already reached
its limit, or when this request would exceed the key's requests this minute; otherwise it counts the request
and records it as in flight. Tokens are known only once the answer is served, so they are added after it: a
request admitted under the token limit may take the key past it, and the next ones wait for the next minute.
An in-flight entry is removed when its request ends (with its tokens: in the next pipeline this process sends,
ahead of the admissions in it, and within ``DEFER_S`` when none comes sooner); one left by a killed gateway
expires after ``stale_s()``: the longest a request may take upstream (``TESSERA_GATEWAY_UPSTREAM_TIMEOUT_S``) plus 30 s.
Refusals are HTTP 429 with ``Retry-After`` (seconds to the next minute, or 1 for concurrency). Requests that
arrive while a Redis round trip is in flight share the next pipeline; Redis away is a 503 ``limits_unavailable``.

Without Redis (the demo) ``LocalLimiter`` applies the same rules within the one gateway process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .protocol import GatewayError
from .state import Caller

log = logging.getLogger("tessera.gateway")

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
#: a request's end (in flight no more, its tokens) reaches Redis with the next admission, or within this
DEFER_S = 0.005
PREFIX = "tessera:gw:"

ADMIT = """
local now_ms = tonumber(ARGV[4])
local conc = tonumber(ARGV[3])
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms - tonumber(ARGV[6]) * 1000)
  if redis.call('ZCARD', KEYS[3]) >= conc then return 3 end
end
local tpm = tonumber(ARGV[2])
if tpm > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= tpm then return 2 end
local rpm = tonumber(ARGV[1])
if rpm > 0 then
  local n = redis.call('INCR', KEYS[1])
  if n == 1 then redis.call('EXPIRE', KEYS[1], 120) end
  if n > rpm then return 1 end
end
if conc > 0 then
  redis.call('ZADD', KEYS[3], now_ms, ARGV[5])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[6]))
end
return 0
"""


def _refusal(kind: int, caller: Caller, now: float) -> GatewayError:
    retry = str(max(1, math.ceil(60 - now % 60)))
    if kind == 3:
        return GatewayError(429, "concurrency_limit", f"Too many requests in flight for this tenant (at most "
                            f"{caller.tenant.max_concurrent}); retry when one finishes.", kind="rate_limit_error",
                            headers={"Retry-After": "1"})
    if kind == 2:
        return GatewayError(429, "token_rate_limit", f"This key used its {caller.tokens_per_minute:,} tokens for "
                            f"this minute; retry after {retry} s.", kind="rate_limit_error",
                            headers={"Retry-After": retry})
    return GatewayError(429, "request_rate_limit", f"This key sent its {caller.requests_per_minute:,} requests for "
                        f"this minute; retry after {retry} s.", kind="rate_limit_error", headers={"Retry-After": retry})


def stale_s() -> int:
    from django.conf import settings

    return int(settings.TESSERA_GATEWAY_UPSTREAM_TIMEOUT_S) + 30


def _who(caller: Caller) -> str:
    return caller.key_prefix or caller.subject


class Limiter(ABC):
    @abstractmethod
    async def admit(self, caller: Caller, request_id: str) -> None:
        """Raise a 429 GatewayError, or count the request as admitted and in flight."""

    @abstractmethod
    async def done(self, caller: Caller, request_id: str, tokens: int) -> None:
        """The request ended having served ``tokens``."""

    async def close(self) -> None:  # noqa: B027 - optional
        pass


class Pipeliner:
    """Redis commands of requests that arrive while a round trip is in flight go together in the next pipeline
    (one write, one read, however many requests): the per-request round trips were most of the gateway's CPU.
    The gateway's limiter and its usage sink share one (``RedisStreamSink(pipeliner=...)``): under load a
    request's admission and another's usage event go in the same round trip.

    Commands nobody waits for (``defer``: a request's end) are not a round trip of their own: they go first in the
    next pipeline, so any later admission of this process sees them, and at most ``DEFER_S`` after they were
    queued when no admission comes sooner."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._queue: list[tuple[Any, int, asyncio.Future | None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _started(self) -> asyncio.Event:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._loop())
        assert self._wake is not None
        return self._wake

    async def run(self, add: Any, n: int) -> list[Any]:
        """``add(pipe)`` queues ``n`` commands; returns their results (raises the first error among them)."""
        wake = self._started()
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((add, n, fut))
        wake.set()
        return await fut

    def defer(self, add: Any, n: int) -> None:
        """``add(pipe)`` queues ``n`` commands sent with the next pipeline, within ``DEFER_S``; errors are logged."""
        wake = self._started()
        self._queue.append((add, n, None))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(DEFER_S, wake.set)

    async def flush(self) -> None:
        if self._queue:
            await self.run(lambda pipe: None, 0)

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if not batch:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for add, _n, _fut in batch:
                add(pipe)
            try:
                results = await pipe.execute(raise_on_error=False)
            except Exception as exc:  # every waiter learns the round trip failed
                for _add, _n, fut in batch:
                    if fut is None:
                        log.warning("gateway limits not updated after a request", extra={"error": str(exc)})
                    elif not fut.done():
                        fut.set_exception(exc)
                continue
            i = 0
            for _add, n, fut in batch:
                part, i = results[i:i + n], i + n
                error = next((r for r in part if isinstance(r, Exception)), None)
                if fut is None:
                    if error is not None:
                        log.warning("gateway limits not updated after a request", extra={"error": str(error)})
                    continue
                if fut.done():
                    continue
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(part)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None


class RedisLimiter(Limiter):
    def __init__(self, redis: Any, pipeliner: Pipeliner | None = None) -> None:
        self.redis = redis
        self._admit = redis.register_script(ADMIT)
        self._pipe = pipeliner or Pipeliner(redis)

    async def close(self) -> None:
        try:  # requests' ends not yet sent
            await self._pipe.flush()
        except REDIS_DOWN as exc:
            log.warning("gateway limits not updated at shutdown", extra={"error": str(exc)})
        self._pipe.close()

    @staticmethod
    def _keys(caller: Caller, minute: int) -> list[str]:
        who = _who(caller)
        return [f"{PREFIX}rpm:{who}:{minute}", f"{PREFIX}tpm:{who}:{minute}", f"{PREFIX}conc:{caller.tenant.id}"]

    async def admit(self, caller: Caller, request_id: str) -> None:
        now = time.time()
        keys = self._keys(caller, int(now // 60))
        args = [caller.requests_per_minute, caller.tokens_per_minute, caller.tenant.max_concurrent, int(now * 1000),
                request_id, stale_s()]

        def add(pipe: Any) -> None:
            # EVALSHA alone: a pipeline given the script (pipe.scripts) asks SCRIPT EXISTS first, one more round
            # trip on every pipeline; where Redis lacks the script (a restart, SCRIPT FLUSH) it is loaded and the
            # admission retried once
            pipe.evalsha(self._admit.sha, len(keys), *keys, *args)

        try:
            try:
                (verdict,) = await self._pipe.run(add, 1)
            except NoScriptError:
                await self.redis.script_load(ADMIT)
                (verdict,) = await self._pipe.run(add, 1)
            verdict = int(verdict)
        except REDIS_DOWN:
            raise GatewayError(503, "limits_unavailable", "The gateway cannot check this key's limits right now; "
                               "retry shortly.", kind="server_error", headers={"Retry-After": "1"}) from None
        if verdict:
            raise _refusal(verdict, caller, now)

    async def done(self, caller: Caller, request_id: str, tokens: int) -> None:
        now = time.time()
        _rpm, tpm, conc = self._keys(caller, int(now // 60))

        def add(pipe: Any) -> None:
            pipe.zrem(conc, request_id)
            if tokens:
                pipe.incrby(tpm, tokens)
                pipe.expire(tpm, 120)

        # the answer has gone out: nothing waits for this (if it fails, the in-flight entry expires after stale_s())
        self._pipe.defer(add, 3 if tokens else 1)


class LocalLimiter(Limiter):
    """The same rules within one process (the demo has one gateway process and no Redis)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.tokens: dict[tuple[str, int], int] = defaultdict(int)
        self.inflight: dict[int, set[str]] = defaultdict(set)

    async def admit(self, caller: Caller, request_id: str) -> None:
        now = time.time()
        minute, who = int(now // 60), _who(caller)
        for key in [k for k in self.requests if k[1] < minute - 1]:
            self.requests.pop(key, None)
            self.tokens.pop(key, None)
        if caller.tenant.max_concurrent and len(self.inflight[caller.tenant.id]) >= caller.tenant.max_concurrent:
            raise _refusal(3, caller, now)
        if caller.tokens_per_minute and self.tokens[(who, minute)] >= caller.tokens_per_minute:
            raise _refusal(2, caller, now)
        self.requests[(who, minute)] += 1
        if caller.requests_per_minute and self.requests[(who, minute)] > caller.requests_per_minute:
            raise _refusal(1, caller, now)
        self.inflight[caller.tenant.id].add(request_id)

    async def done(self, caller: Caller, request_id: str, tokens: int) -> None:
        self.inflight[caller.tenant.id].discard(request_id)
        self.tokens[(_who(caller), int(time.time() // 60))] += tokens
