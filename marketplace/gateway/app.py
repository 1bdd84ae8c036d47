"""The gateway's ASGI application: a plain ASGI callable (no framework on the hot path), served by uvicorn.

Routes (``model`` is the tenant's deployment name, or the name of a LoRA adapter deployed with a vLLM library
model: see ``state``):

- OpenAI-compatible: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/chat/completions``,
  ``POST /v1/completions`` (``stream: true`` as server-sent events, ``stream_options.include_usage``),
  ``POST /v1/embeddings`` (models that declare an ``embedding`` output); errors in OpenAI's error JSON.
- KServe v2 / Triton: ``GET /v2/models/{model}`` (metadata), ``GET /v2/models/{model}/ready``,
  ``POST /v2/models/{model}/infer``, ``POST /v2/models/{model}/generate``, ``POST .../generate_stream``;
  errors in KServe's JSON. ``GET /v2/health/live`` and ``/v2/health/ready`` are the gateway's own health.

Every answer carries ``x-request-id``: the id of the usage event the request made.

Streams (server-sent events) are written one event at a time through a small send buffer (``_bound_sends``), so
the gateway runs at most that far ahead of what the client's TCP stack took. A client that goes away cancels
the upstream request at once (its response is closed: Triton sees the connection drop) and the request is
metered for the events written before the disconnect was seen. A stream whose usage event cannot be appended
to the sink once its text has gone out is kept in the local fallback (``metering``: replayed into the stream
once Redis is back) and ends with an error event, ``metering_unavailable``, instead of its end.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from . import protocol
from . import upstream as upstream_mod
from .limits import Limiter, LocalLimiter, Pipeliner, RedisLimiter
from .metering import FALLBACK_REPLAY_S, MeteringUnavailable, RedisStreamSink, SpoolSink, UsageSink, event, fallback_dir
from .protocol import GatewayError, Served, TextRequest
from .state import Caller, Loader, Tables, Upstream, mark_used

log = logging.getLogger("tessera.gateway")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
JSON = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
STREAM_METER_TIMEOUT_S = 2.0  # a stream's event not in Redis by then goes to the local fallback
STREAM_SNDBUF = 4096  # a stream's socket send buffer (SO_SNDBUF; Linux doubles it for its bookkeeping)


_started: contextvars.ContextVar[float] = contextvars.ContextVar("started")
EMBEDDING_CONCURRENCY = 8  # generate requests in flight at once for one /v1/embeddings request's inputs


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Gateway:
    def __init__(self, *, tables: Tables | None = None, sink: UsageSink | None = None,
                 limiter: Limiter | None = None, refresh_s: float | None = None, max_body: int | None = None,
                 timeout_s: float | None = None, fallback: SpoolSink | None = None) -> None:
        from django.conf import settings

        self.tables = tables or Tables()
        self.sink, self.limiter = sink, limiter
        self.fallback = fallback  # a stream's event the sink did not take (with Redis; replayed into it)
        self._replayer: asyncio.Task | None = None
        self.refresh_s = settings.TESSERA_GATEWAY_REFRESH_S if refresh_s is None else refresh_s
        self.max_body = max_body or settings.TESSERA_GATEWAY_MAX_BODY
        self.client = upstream_mod.Client(timeout_s or settings.TESSERA_GATEWAY_UPSTREAM_TIMEOUT_S)
        self._redis: Any = None
        self._refresher: asyncio.Task | None = None
        self._loader: Loader | None = None  # keeps what it read between refreshes: each reads only what changed
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = False

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def startup(self) -> None:
        from django.conf import settings

        self.loop = asyncio.get_running_loop()
        if settings.REDIS_URL and (self.sink is None or self.limiter is None):
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError

            # Enough connections for every request in flight: redis-py's pool raises past its size. A pooled
            # connection Redis closed (a restart) is retried once on a new one instead of failing the request.
            self._redis = aioredis.Redis.from_url(settings.REDIS_URL, max_connections=4096,
                                                  retry=Retry(NoBackoff(), 1),
                                                  retry_on_error=[RedisConnectionError])
        # one pipeline for the limiter and the sink: a request's admission and another's usage event, queued
        # while a round trip is in flight, go together in the next one
        shared = Pipeliner(self._redis) if self._redis is not None and self.sink is None and self.limiter is None \
            else None
        if self.sink is None:
            self.sink = RedisStreamSink(self._redis, pipeliner=shared) if self._redis is not None else SpoolSink()
        if self.limiter is None:
            self.limiter = RedisLimiter(self._redis, shared) if self._redis is not None else LocalLimiter()
        await self.sink.start()
        if isinstance(self.sink, RedisStreamSink):
            if self.fallback is None:
                try:
                    self.fallback = SpoolSink(fallback_dir())
                except OSError as exc:  # no gateway that could serve a stream it cannot meter
                    raise RuntimeError(f"the usage fallback folder cannot be created ({exc}): set "
                                       "TESSERA_USAGE_SPOOL_DIR to a folder the gateway can write") from exc
            await self.fallback.start()
            self._replayer = asyncio.create_task(self._replay_loop(self.sink, self.fallback))
        await self.client.start()
        if self.refresh_s > 0:
            await self.refresh()
            self._refresher = asyncio.create_task(self._refresh_loop())
        self.started = True

    async def shutdown(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self._replayer is not None:
            self._replayer.cancel()
        if self.sink is not None:
            await self.sink.close()
        if self.fallback is not None:
            await self.fallback.close()
        if self.limiter is not None:
            await self.limiter.close()
        await self.client.close()
        if self._redis is not None:
            await self._redis.aclose()

    async def refresh(self) -> None:
        used, self.tables.used_keys = self.tables.used_keys, set()
        if self._loader is None:
            self._loader = Loader()
        snap = await asyncio.to_thread(_load, self._loader, used)
        self.tables.replace(snap)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # keep serving from the last snapshot
                log.error("gateway refresh failed; serving from the last snapshot", extra={"error": str(exc)})

    async def _replay_loop(self, sink: RedisStreamSink, fallback: SpoolSink) -> None:
        """The fallback's events into the stream, as soon as Redis takes them (and what a previous process left)."""
        while True:
            try:
                await sink.replay(fallback.dir, writing=fallback.writing)
            except Exception as exc:  # Redis still down: the lines stay, next round
                log.warning("usage fallback not replayed yet", extra={"error": str(exc)})
            await asyncio.sleep(FALLBACK_REPLAY_S)

    # --- ASGI -----------------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if not self.started:
            await self.startup()
        _started.set(time.perf_counter())
        path, method = scope["path"], scope["method"]
        openai = path.startswith("/v1/")
        rid = uuid.uuid4().hex
        try:
            await self._route(scope, receive, send, path, method, rid)
        except GatewayError as err:
            await _send_error(send, err, openai, rid)
        except Exception:
            log.exception("gateway error", extra={"path": path, "request_id": rid})
            await _send_error(send, GatewayError(500, "internal_error", "The gateway failed on this request.",
                                                 kind="server_error"), openai, rid)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope, receive, send, path: str, method: str, rid: str) -> None:
        parts = path.strip("/").split("/")
        if parts[:2] == ["v2", "health"] and len(parts) == 3 and method == "GET":
            ok = parts[2] == "live" or self.tables.ready
            await _send(send, 200 if ok else 503, b"", [], rid)
            return
        if path in ("/healthz", "/health"):  # unauthenticated: nothing about other tenants or the fleet's size
            await _send(send, 200 if self.tables.ready else 503, _dumps({"ready": self.tables.ready}), JSON, rid)
            return
        if path == "/openapi.json" and method == "GET":
            from django.conf import settings

            from .openapi import document

            await _send(send, 200, _dumps(document(settings.TESSERA_GATEWAY_URL)), JSON, rid)
            return
        headers = dict(scope["headers"])
        caller = self.tables.authenticate(_header(headers, b"authorization"))
        if parts[0] == "v1":
            if parts[1:] == ["models"] and method == "GET":
                await self._list_models(send, caller, rid)
            elif len(parts) == 3 and parts[1] == "models" and method == "GET":
                await self._one_model(send, caller, parts[2], rid)
            elif parts[1:] == ["chat", "completions"] and method == "POST":
                req = protocol.parse_chat(await _body(receive, self.max_body))
                await self._text(receive, send, caller, req, rid)
            elif parts[1:] == ["completions"] and method == "POST":
                req = protocol.parse_completion(await _body(receive, self.max_body))
                await self._text(receive, send, caller, req, rid)
            elif parts[1:] == ["embeddings"] and method == "POST":
                await self._embeddings(send, caller, protocol.parse_embeddings(await _body(receive, self.max_body)),
                                       rid)
            else:
                raise _not_found(path, method)
            return
        if parts[0] == "v2" and len(parts) >= 3 and parts[1] == "models":
            model, action = parts[2], "/".join(parts[3:])
            if action == "" and method == "GET":
                await self._passthrough_get(send, caller, model, f"/v2/models/{model}", rid)
            elif action == "ready" and method == "GET":
                await self._ready(send, caller, model, rid)
            elif action == "infer" and method == "POST":
                await self._infer(receive, send, caller, model, headers, rid)
            elif action in ("generate", "generate_stream") and method == "POST":
                await self._generate(receive, send, caller, model, action == "generate_stream", rid)
            else:
                raise _not_found(path, method)
            return
        raise _not_found(path, method)

    # --- models ---------------------------------------------------------------------------------------------
    async def _list_models(self, send: Send, caller: Caller, rid: str) -> None:
        data = [_model_object(n, caller) for n in self.tables.models(caller.tenant.id)]
        await _send(send, 200, _dumps({"object": "list", "data": data}), JSON, rid)

    async def _one_model(self, send: Send, caller: Caller, name: str, rid: str) -> None:
        self._routes(caller, name)
        await _send(send, 200, _dumps(_model_object(name, caller)), JSON, rid)

    def _routes(self, caller: Caller, name: str) -> list[Upstream]:
        ups = self.tables.routes(caller.tenant.id, name)
        if not ups:
            raise protocol.unknown_model(name)
        return ups

    async def _passthrough_get(self, send: Send, caller: Caller, model: str, path: str, rid: str) -> None:
        up = upstream_mod.pick(self._routes(caller, model))
        status, body = await self.client.json(up, "GET", path.replace(f"/v2/models/{model}", f"/v2/models/{up.name}"))
        if status == 404:
            raise upstream_mod.unavailable(model)
        await _send(send, status, _dumps(body), JSON, rid)

    async def _ready(self, send: Send, caller: Caller, model: str, rid: str) -> None:
        for up in sorted(self._routes(caller, model), key=lambda u: u.ejected_until):
            try:
                resp = await self.client.request(up, "GET", f"/v2/models/{up.name}/ready")
                resp.release()
            except GatewayError:
                continue
            if resp.status == 200:
                await _send(send, 200, b"", [], rid)
                return
        raise upstream_mod.unavailable(model)

    # --- admission and accounting ---------------------------------------------------------------------------
    async def _serve(self, caller: Caller, model: str, rid: str,
                     work: Callable[[Upstream], Awaitable[int]]) -> None:
        """Admit, pick the least busy deployment, run ``work`` (it returns the tokens served), release."""
        ups = self._routes(caller, model)
        assert self.limiter is not None
        await self.limiter.admit(caller, rid)
        tokens, tried = 0, []
        try:
            while True:
                up = upstream_mod.pick([u for u in ups if u not in tried] or ups)
                tried.append(up)
                up.outstanding += 1
                try:
                    tokens = await work(up)
                    return
                except GatewayError as err:
                    # Nothing was served (no connection, or the server is not up): fail over once to another
                    # deployment of the name, if there is one.
                    if err.code != "model_unavailable" or len(tried) > 1 or len(ups) < 2:
                        raise
                finally:
                    up.outstanding -= 1
        finally:
            await self.limiter.done(caller, rid, tokens)

    async def _meter(self, caller: Caller, up: Upstream, rid: str, n_in: int, n_out: int) -> None:
        assert self.sink is not None
        try:
            ms = (time.perf_counter() - _started.get(time.perf_counter())) * 1000
            await self.sink.append(event(rid, caller.tenant.id, up.deployment_id, n_in, n_out, ms=ms,
                                         adapter=up.adapter, key=caller.key_prefix))
        except MeteringUnavailable:
            raise GatewayError(503, "metering_unavailable", "The request could not be recorded for billing, so its "
                               "answer is withheld; retry shortly.", kind="server_error",
                               headers={"Retry-After": "1"}) from None

    async def _meter_sent(self, caller: Caller, up: Upstream, rid: str, n_in: int, n_out: int) -> GatewayError | None:
        """A stream's event, once its text has gone out (it cannot be withheld any more): into the sink, else
        (Redis down, or no answer within STREAM_METER_TIMEOUT_S) into the local fallback, which is replayed into
        the sink once it is back. Returns the error the stream must end with (None: metered as usual)."""
        assert self.sink is not None
        ms = (time.perf_counter() - _started.get(time.perf_counter())) * 1000
        e = event(rid, caller.tenant.id, up.deployment_id, n_in, n_out, ms=ms, adapter=up.adapter,
                  key=caller.key_prefix)
        appended = asyncio.ensure_future(self.sink.append(e))
        appended.add_done_callback(_retrieved)  # a late failure after the timeout is not logged as unretrieved
        try:
            await asyncio.wait_for(asyncio.shield(appended), STREAM_METER_TIMEOUT_S)
            return None
        except (MeteringUnavailable, TimeoutError) as exc:  # a late append and the fallback: one id, billed once
            reason = str(exc) or "timed out"
        try:
            if self.fallback is None:
                raise MeteringUnavailable("no fallback")
            await self.fallback.append(e)
            log.warning("stream metered into the local fallback", extra={"request_id": rid, "error": reason})
        except MeteringUnavailable as exc:
            log.error("stream served and NOT metered", extra={"request_id": rid, "tenant": caller.tenant.id,
                                                              "deployment": up.deployment_id, "input_tokens": n_in,
                                                              "output_tokens": n_out, "error": str(exc)})
        return GatewayError(503, "metering_unavailable", "The metering service did not record this answer, so the "
                            "stream ends here without its end; the gateway keeps the usage of what was sent and "
                            "records it when the service is back. Retry shortly.", kind="server_error")

    # --- text generation (OpenAI) ---------------------------------------------------------------------------
    async def _text(self, receive: Receive, send: Send, caller: Caller, req: TextRequest, rid: str) -> None:
        async def work(up: Upstream) -> int:
            body = protocol.generate_body(up.io, req, up.adapter)
            if req.stream:
                return await self._text_stream(receive, send, caller, up, req, body, rid)
            served = await self._text_once(up, req, body)
            n_in, n_out = served.usage(req.prompt)
            await self._meter(caller, up, rid, n_in, n_out)
            obj = protocol.completion_object(req, rid, served.text, n_in, n_out,
                                             protocol.finish_reason(req, served, n_out))
            await _send(send, 200, _dumps(obj), JSON, rid)
            return n_in + n_out

        await self._serve(caller, req.model, rid, work)

    async def _text_once(self, up: Upstream, req: TextRequest, body: dict[str, Any]) -> Served:
        served = Served(stops=req.stop)
        if not up.io.decoupled:
            status, out = await self.client.json(up, "POST", f"/v2/models/{up.name}/generate", body)
            _check_model_answer(req.model, status, out)
            served.add(up.io, out)
            served.flush()
            return served
        async for chunk in self._chunks(up, req.model, body):
            served.add(up.io, chunk)
            if served.stopped:  # a stop sequence: nothing after it is read, sent or billed
                break
        served.flush()
        return served

    async def _chunks(self, up: Upstream, model: str, body: dict[str, Any], gone: _Disconnect | None = None):
        """The upstream's stream events. ``gone``: the client's disconnect closes the upstream response at once
        (the pending read ends; Triton sees the connection drop and cancels the request) and ends the events."""
        resp = await self.client.request(up, "POST", f"/v2/models/{up.name}/generate_stream", body=_dumps(body),
                                         headers={"Content-Type": "application/json"})
        if gone is not None:
            gone.on_gone(resp.close)
        try:
            if resp.status != 200:
                raw = await resp.read()
                try:
                    out = json.loads(raw)
                except ValueError:
                    out = {"error": raw.decode("utf-8", "replace")[:500]}
                _check_model_answer(model, resp.status, out)
            buffer = bytearray()
            try:
                async for data in resp.content.iter_any():
                    buffer.extend(data)
                    for i, chunk in enumerate(protocol.parse_sse_lines(buffer)):
                        if gone is not None:
                            if i:  # several events in one read: let the loop see a disconnect meanwhile
                                await asyncio.sleep(0)
                            if gone.happened:
                                return
                        _check_model_answer(model, 200, chunk)
                        yield chunk
            except (aiohttp.ClientError, TimeoutError):
                if gone is not None and gone.happened:
                    return
                raise upstream_mod.unavailable(model) from None  # cut mid-stream: what was sent is metered
        finally:
            resp.close()

    async def _text_stream(self, receive: Receive, send: Send, caller: Caller, up: Upstream, req: TextRequest,
                           body: dict[str, Any], rid: str) -> int:
        served, created, started = Served(stops=req.stop), int(time.time()), False
        gone, unbound = _Disconnect(receive, send), _nothing
        try:
            async for chunk in self._chunks(up, req.model, body, gone):
                if not started:
                    await _start_stream(send, rid)
                    unbound = _bound_sends(send)
                    started = True
                    if req.chat:
                        await _chunk(send, protocol.chunk_object(req, rid, created, text="", role=True))
                if gone.happened:  # counted: only what was written before the disconnect was seen
                    break
                piece = served.add(up.io, chunk)
                if piece:
                    await _chunk(send, protocol.chunk_object(req, rid, created, text=piece))
                if served.stopped:
                    break
        except GatewayError as err:
            if not started:
                raise
            served_in, served_out = served.usage(req.prompt)
            failed = await self._meter_sent(caller, up, rid, served_in, served_out)
            await _chunk(send, (failed or err).openai_body())  # the stream already began: the error is its last event
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return served_in + served_out
        finally:
            gone.stop()
            unbound()
        held = "" if gone.happened else served.flush()  # text held back in case it began a stop sequence
        n_in, n_out = served.usage(req.prompt)
        failed = None
        if not started:
            await self._meter(caller, up, rid, n_in, n_out)  # nothing sent yet: withheld (503) if not durable
            await _start_stream(send, rid)
        else:
            failed = await self._meter_sent(caller, up, rid, n_in, n_out)  # durable before the end is sent
            if gone.happened:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return n_in + n_out
        if held:
            await _chunk(send, protocol.chunk_object(req, rid, created, text=held))
        if failed is not None:  # the text went out, its end does not: the error is the last event
            await _chunk(send, failed.openai_body())
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return n_in + n_out
        await _chunk(send, protocol.chunk_object(req, rid, created,
                                                 finish=protocol.finish_reason(req, served, n_out)))
        if req.include_usage:
            await _chunk(send, protocol.chunk_object(req, rid, created, usage=protocol.usage_block(n_in, n_out),
                                                     no_choices=True))
        await send({"type": "http.response.body", "body": protocol.sse("[DONE]"), "more_body": False})
        return n_in + n_out

    # --- embeddings (OpenAI) ---------------------------------------------------------------------------------
    async def _embeddings(self, send: Send, caller: Caller, req: protocol.EmbeddingRequest, rid: str) -> None:
        async def work(up: Upstream) -> int:
            bodies = [protocol.embedding_body(up.io, req.model, text) for text in req.inputs]
            gate = asyncio.Semaphore(EMBEDDING_CONCURRENCY)

            async def one(body: dict[str, Any]) -> dict[str, Any]:
                async with gate:
                    status, out = await self.client.json(up, "POST", f"/v2/models/{up.name}/generate", body)
                _check_model_answer(req.model, status, out)
                return out

            tasks = [asyncio.ensure_future(one(b)) for b in bodies]
            try:
                outs = await asyncio.gather(*tasks)
            except BaseException:  # one input failed (or the request is cancelled): the others are not waited for
                for task in tasks:
                    task.cancel()
                raise
            results = [protocol.embedding_result(up.io, req.model, out, text)
                       for out, text in zip(outs, req.inputs, strict=True)]
            n_in = sum(n for _, n in results)
            await self._meter(caller, up, rid, n_in, 0)
            await _send(send, 200, _dumps(protocol.embedding_object(req, [v for v, _ in results], n_in)), JSON, rid)
            return n_in

        await self._serve(caller, req.model, rid, work)

    # --- KServe v2 / Triton ---------------------------------------------------------------------------------
    async def _generate(self, receive: Receive, send: Send, caller: Caller, model: str, stream: bool,
                        rid: str) -> None:
        body, text = protocol.parse_generate(await _body(receive, self.max_body), model, stream)

        async def work(up: Upstream) -> int:
            prompt = text.prompt if text is not None else ""
            sent = protocol.select_adapter(body, up.adapter, model) if up.io.sampling else body
            if not stream and not up.io.decoupled:
                status, out = await self.client.json(up, "POST", f"/v2/models/{up.name}/generate", sent)
                _check_model_answer(model, status, out, kserve=True)
                served = Served()
                served.add(up.io, out)
                n_in, n_out = served.usage(prompt) if up.io.generative else _reported(served)
                await self._meter(caller, up, rid, n_in, n_out)
                await _send(send, 200, _dumps(out), JSON, rid)
                return n_in + n_out
            return await self._generate_stream(receive, send, caller, up, model, sent, prompt, stream, rid)

        await self._serve(caller, model, rid, work)

    async def _generate_stream(self, receive, send, caller, up, model, body, prompt, stream, rid) -> int:
        served, started, gone, unbound = Served(), False, _Disconnect(receive, send), _nothing
        merged: dict[str, Any] = {}
        error: GatewayError | None = None
        try:
            async for chunk in self._chunks(up, model, body, gone):
                if stream:
                    if not started:
                        await _start_stream(send, rid)
                        unbound = _bound_sends(send)
                        started = True
                    if gone.happened:  # counted: only what was written before the disconnect was seen
                        break
                    served.add(up.io, chunk)
                    await _chunk(send, chunk)
                else:
                    served.add(up.io, chunk)
                    merged.update({k: v for k, v in chunk.items() if k != (up.io.text or "")})
        except GatewayError as err:
            if not started:
                raise
            error = err
        finally:
            gone.stop()
            unbound()
        n_in, n_out = served.usage(prompt) if up.io.generative else _reported(served)
        if started:
            failed = await self._meter_sent(caller, up, rid, n_in, n_out)
            if (failed or error) is not None and not gone.happened:
                await _chunk(send, (failed or error).kserve_body())  # type: ignore[union-attr]
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return n_in + n_out
        await self._meter(caller, up, rid, n_in, n_out)  # nothing sent yet: withheld (503) if not durable
        if stream:
            await _start_stream(send, rid)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            if up.io.text:
                merged[up.io.text] = served.text
            await _send(send, 200, _dumps(merged), JSON, rid)
        return n_in + n_out

    async def _infer(self, receive: Receive, send: Send, caller: Caller, model: str, headers: dict[bytes, bytes],
                     rid: str) -> None:
        raw = await _body(receive, self.max_body)
        forward = {"Content-Type": _header(headers, b"content-type") or "application/json"}
        head_len = _header(headers, b"inference-header-content-length")
        if head_len:
            forward["Inference-Header-Content-Length"] = head_len

        async def work(up: Upstream) -> int:
            if up.adapter is not None:  # the adapter is selected in a generate body; infer tensors are not rewritten
                raise protocol.bad_request(
                    f"'{model}' is a LoRA adapter: call it with /v1/chat/completions, /v1/completions "
                    f"or /v2/models/{model}/generate.", param="model", code="adapter_needs_generate")
            resp = await self.client.request(up, "POST", f"/v2/models/{up.name}/infer", body=raw, headers=forward)
            try:
                data = await resp.read()
            finally:
                resp.release()
            out_headers = [(b"content-type", resp.headers.get("Content-Type", "application/json").encode())]
            length = resp.headers.get("Inference-Header-Content-Length")
            if length:
                out_headers.append((b"inference-header-content-length", length.encode()))
            if resp.status == 404:
                raise upstream_mod.unavailable(model)
            if resp.status != 200:
                await _send(send, resp.status, data, out_headers, rid)
                return 0
            n_in, n_out = protocol.infer_counts(data, int(length) if length else None)
            n_in, n_out = n_in or 0, n_out or 0
            await self._meter(caller, up, rid, n_in, n_out)
            await _send(send, 200, data, out_headers, rid)
            return n_in + n_out

        await self._serve(caller, model, rid, work)


def _load(loader: Loader, used: set[str]):
    """In a worker thread: its own database connection, closed after (one connection per refresh, none held)."""
    from django.db import connection

    try:
        mark_used(used)
        return loader.load()
    finally:
        connection.close()


def _reported(served: Served) -> tuple[int, int]:
    return served.input_tokens or 0, served.output_tokens or 0


def _check_model_answer(model: str, status: int, out: Any, *, kserve: bool = False) -> None:
    """Triton answers some failures with 200 and an ``error`` key (generate on a decoupled model)."""
    error = out.get("error") if isinstance(out, dict) else None
    if status == 200 and not error:
        return
    message = str(error or f"status {status}")
    if status == 404 or status in (502, 503, 504):
        raise upstream_mod.unavailable(model)  # a route to a model its server no longer has: reloading
    if 400 <= status < 500 or (status == 200 and error):
        raise GatewayError(400, "model_rejected_request", f"The model '{model}' refused the request: {message}")
    raise GatewayError(502, "model_error", f"The model '{model}' failed: {message}", kind="server_error")


def _model_object(name: str, caller: Caller) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": caller.tenant.slug}


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None


def _not_found(path: str, method: str) -> GatewayError:
    return GatewayError(404, "not_found", f"No route {method} {path}.")


async def _body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayError(499, "client_closed", "The client closed the connection.")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, "body_too_large", f"The request body is larger than {limit:,} bytes.")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]], rid: str,
                extra: dict[str, str] | None = None) -> None:
    h = [*headers, (b"x-request-id", rid.encode()), (b"content-length", str(len(body)).encode())]
    for k, v in (extra or {}).items():
        h.append((k.lower().encode(), v.encode()))
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, err: GatewayError, openai: bool, rid: str) -> None:
    body = err.openai_body() if openai else err.kserve_body()
    try:
        await _send(send, err.status, _dumps(body), JSON, rid, err.headers)
    except RuntimeError:  # the response had already started (a stream): nothing more can be said
        pass


async def _start_stream(send: Send, rid: str) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [*SSE_HEADERS, (b"x-request-id", rid.encode())]})


async def _chunk(send: Send, obj: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": protocol.sse(obj), "more_body": True})


def _nothing() -> None:
    return None


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _bound_sends(send: Send) -> Callable[[], None]:
    """Keep a stream's writes close to what the client takes: a small socket send buffer (``STREAM_SNDBUF``) and
    no buffering in the server's transport beyond one event (each ``send`` then waits for the previous events to
    reach the socket). The transport is uvicorn's (its ``send`` is a method of the request's cycle, which holds
    it); under another server nothing changes. Returns what puts the connection's buffers back (a keep-alive
    connection's next answer may be a large one); the kernel keeps the size it had, no longer tuned up."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        return _nothing
    try:
        sock = transport.get_extra_info("socket")
        before = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) if sock is not None else None
        transport.set_write_buffer_limits(high=0)
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
    except (AttributeError, OSError, ValueError) as exc:  # a transport without these: the usual buffers
        log.debug("stream send buffer not bounded", extra={"error": str(exc)})
        return _nothing

    def restore() -> None:  # never raises: it runs before the stream is metered
        try:
            if transport.is_closing():
                return
            transport.set_write_buffer_limits()
            if sock is not None and before:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, before // 2)  # Linux doubles what it is given
        except (AttributeError, OSError, ValueError, RuntimeError):  # closed meanwhile (uvloop: RuntimeError)
            pass

    return restore


class _Disconnect:
    """Watches ``receive`` for the client going away during a stream; ``on_gone`` callbacks run at once.
    ``happened`` also reads uvicorn's own flag (set as the connection is lost, before the watcher runs)."""

    def __init__(self, receive: Receive, send: Send | None = None) -> None:
        self._seen = False
        self._cycle = getattr(send, "__self__", None)
        self._callbacks: list[Callable[[], Any]] = []
        self._task = asyncio.create_task(self._watch(receive))

    @property
    def happened(self) -> bool:
        return self._seen or getattr(self._cycle, "disconnected", False) is True

    def on_gone(self, callback: Callable[[], Any]) -> None:
        self._callbacks.append(callback)

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._seen = True
                for callback in self._callbacks:
                    callback()
                return

    def stop(self) -> None:
        self._task.cancel()


def build() -> Gateway:
    return Gateway()
