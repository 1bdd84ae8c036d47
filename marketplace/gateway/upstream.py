"""Calls to the slices' Triton servers: one pooled aiohttp session, least-outstanding balancing, ejection.

aiohttp's client is the upstream because it was measured here: httpx was 9x slower at 32 connections. The
session asks upstream for ``identity`` encoding (aiohttp asks for gzip by default, which Triton would then
spend CPU on). Every request carries the server's secret header (all of Triton's APIs are restricted).

Balancing: of a model's ready deployments, the one with the fewest requests in flight from this process
(ties broken at random). A deployment whose server refused a connection or answered 5xx twice in a row is
taken out for ``EJECT_S`` seconds and put back after; when every deployment is out, the least recently
ejected is tried anyway rather than refusing outright.
"""

from __future__ import annotations

import random
import time
from typing import Any

import aiohttp

from .protocol import GatewayError
from .state import Upstream

EJECT_S = 5.0
EJECT_AFTER_FAILURES = 2


def pick(ups: list[Upstream], now: float | None = None) -> Upstream:
    now = time.monotonic() if now is None else now
    healthy = [u for u in ups if u.ejected_until <= now]
    if not healthy:
        return min(ups, key=lambda u: u.ejected_until)
    least = min(u.outstanding for u in healthy)
    return random.choice([u for u in healthy if u.outstanding == least])


def failed(up: Upstream) -> None:
    up.failures += 1
    if up.failures >= EJECT_AFTER_FAILURES:
        up.ejected_until = time.monotonic() + EJECT_S
        up.failures = 0


def succeeded(up: Upstream) -> None:
    up.failures = 0
    up.ejected_until = 0.0


def unavailable(name: str) -> GatewayError:
    return GatewayError(503, "model_unavailable", f"The model '{name}' is not answering right now; retry shortly.",
                        kind="server_error", headers={"Retry-After": "1"})


class Client:
    def __init__(self, timeout_s: float) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=512, keepalive_timeout=60, ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _headers(self, up: Upstream, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Accept-Encoding": "identity", **up.headers}
        if extra:
            h.update(extra)
        return h

    async def request(self, up: Upstream, method: str, path: str, *, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """Send; the caller reads and releases the response. Connection errors become 503 and count against
        the upstream's health; so do 5xx answers other than a model's own error (500 from a model is the
        model's answer, passed through)."""
        if self.session is None:
            await self.start()
        assert self.session is not None
        try:
            resp = await self.session.request(method, up.base_url + path, data=body,
                                              headers=self._headers(up, headers))
        except (aiohttp.ClientError, TimeoutError, OSError):
            failed(up)
            raise unavailable(up.name) from None
        if resp.status in (502, 503, 504):
            failed(up)
        else:
            succeeded(up)
        return resp

    async def json(self, up: Upstream, method: str, path: str, payload: dict[str, Any] | None = None
                   ) -> tuple[int, Any]:
        import json

        body = json.dumps(payload, separators=(",", ":")).encode() if payload is not None else None
        resp = await self.request(up, method, path, body=body,
                                  headers={"Content-Type": "application/json"} if body is not None else None)
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            failed(up)
            raise unavailable(up.name) from None
        finally:
            resp.release()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, {"error": raw.decode("utf-8", "replace")[:500]}
