"""A stand-in for a Triton server's ``generate_stream`` that the test drives (not a test module).

``StreamUpstream`` answers ``POST /v2/models/<name>/generate_stream`` with ``max_tokens`` server-sent events in
Triton's framing (``{"text", "input_tokens", "output_tokens"}``, the running count), like the simulated slices'
HTTP front, but it can hold the stream after ``hold_after`` events until the test calls ``release()`` and it
records what a real server would see: how many events it wrote and whether the gateway dropped the request
(``cancelled``: its connection closed before the last event). ``point(deployment)`` makes the gateway's route
to that deployment (its Triton server's address and port, as the gateway reads them) lead here.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web

from marketplace.models import TritonServer
from tests.gateway_fixtures import free_port


class StreamUpstream:
    def __init__(self, *, hold_after: int | None = None, pace_s: float = 0.005, poll_s: float = 0.01) -> None:
        self.hold_after, self.pace_s, self.poll_s = hold_after, pace_s, poll_s
        self.port = free_port()
        self._release = threading.Event()
        self.reset()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()

    def start(self) -> StreamUpstream:
        self._thread.start()
        assert self._ready.wait(10), "the stream upstream did not start"
        return self

    def reset(self) -> None:
        """Forget the last request (one request at a time)."""
        self.sent = 0
        self.dropped_at: float | None = None  # time.monotonic() when the drop was seen (within poll_s or pace_s)
        self.cancelled = threading.Event()
        self.finished = threading.Event()  # the stream ended, by its last event or by a cancel

    def release(self, held: bool = False) -> None:
        """Let a held stream go on (``held``: hold the next one again)."""
        self._release.set()
        if held:
            self.finished.wait(30)
            self._release.clear()

    def point(self, deployment) -> None:
        TritonServer.objects.filter(allocation_id=deployment.allocation_id).update(address="127.0.0.1",
                                                                                http_port=self.port)

    def stop(self) -> None:
        self._release.set()
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v2/models/{name}/generate_stream", self._stream)
        self._runner = web.AppRunner(app, handle_signals=False)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    @staticmethod
    def _dropped(request: web.Request) -> bool:
        return request.transport is None or request.transport.is_closing()

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                if i == self.hold_after:  # a model between two tokens (a long step, a tool call): nothing to read
                    while not self._release.is_set() and not self._dropped(request):
                        await asyncio.sleep(self.poll_s)
                if self._dropped(request):
                    self.dropped_at = time.monotonic()
                    self.cancelled.set()
                    break
                event = {"model_name": request.match_info["name"], "text": f" w{i + 1}", "input_tokens": 5,
                         "output_tokens": i + 1}
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.sent += 1
                await asyncio.sleep(self.pace_s)  # 0: as fast as the connection takes them
            else:
                await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.dropped_at = time.monotonic()
            self.cancelled.set()
            raise
        finally:
            self.finished.set()
        return resp
