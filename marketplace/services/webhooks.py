"""Outbound webhooks: events are stored as deliveries (one per endpoint and event), POSTed with an
HMAC-SHA256 signature, retried with backoff by a Celery task, and logged.

Signature header: ``X-Tessera-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``.
Receivers recompute it over the raw body and reject old timestamps (replays).

Targets are tenants' choice, so every URL is checked (``netguard``) at registration and again at
every delivery: the host is resolved, each address must be public (or in
TESSERA_WEBHOOK_ALLOW_NETWORKS), and the request connects to that checked address (no second DNS
lookup: no rebinding). Redirects are never followed (a 3xx is a failed attempt). The delivery log
keeps the detail (status code, connection error) for operators; tenants read only the status class
and a generic reason (``last_reason``), so the log cannot be used to probe ports.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import http.client
import json
import logging
import secrets
import socket
import ssl
import time

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from marketplace import enqueue
from marketplace.models import WebhookDelivery, WebhookEndpoint
from marketplace.services import netguard
from tenants.errors import Forbidden, ServiceError
from tenants.models import Tenant
from tenants.scoping import Principal

log = logging.getLogger("tessera.webhooks")
TIMEOUT_S = 10


class DeliveryFailed(Exception):
    pass


def sign(secret: str, body: bytes, ts: int) -> str:
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={ts},v1={mac}"


def verify(secret: str, body: bytes, header: str, tolerance_s: int = 300, now: float | None = None) -> bool:
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        ts = int(parts["t"])
    except (ValueError, KeyError):
        return False
    if abs((now or time.time()) - ts) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, body, ts), header)


def create_endpoint(principal: Principal, *, tenant: Tenant | None, url: str, events: list[str]) -> WebhookEndpoint:
    if tenant is None and not principal.can("operate"):
        raise Forbidden("only operators create MSP-wide webhooks")
    if tenant is not None and not principal.can("manage_tenant", tenant.pk):
        raise Forbidden("only owners and admins manage the tenant's webhooks")
    bad = [e for e in events if e not in WebhookEndpoint.EVENTS]
    if not events or bad:
        raise ServiceError(f"choose events from {', '.join(WebhookEndpoint.EVENTS)}", field="events")
    try:
        netguard.resolve_public(url)
    except netguard.AddressRefused as exc:
        raise ServiceError(f"this URL cannot receive webhooks: {exc}", field="url") from None
    return WebhookEndpoint.objects.create(tenant=tenant, url=url, events=sorted(set(events)),
                                          secret=secrets.token_urlsafe(32))


def emit(tenant: Tenant, event: str, key: str, data: dict) -> list[WebhookDelivery]:
    """Queue one delivery per subscribed endpoint (the tenant's and the MSP's); idempotent per key."""
    body = {"event": event, "key": key, "created_at": timezone.now().isoformat(), "data": data}
    out = []
    for ep in WebhookEndpoint.objects.filter(Q(tenant=tenant) | Q(tenant__isnull=True), active=True):
        if event not in ep.events:
            continue
        d, created = WebhookDelivery.objects.get_or_create(endpoint=ep, event=event, event_key=key,
                                                           defaults={"payload": body})
        if created:
            transaction.on_commit(functools.partial(_enqueue, d))
            out.append(d)
    return out


def _enqueue(delivery: WebhookDelivery) -> None:
    enqueue.send(enqueue.DELIVER_WEBHOOK, [delivery.pk], "control")


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to one already-checked address; the Host header stays the URL's host."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self):
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self):
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # certificate checked for the host


#: what a tenant reads about a failed attempt (operators read `last_error`)
REASONS = {
    "refused": "the endpoint's address is not allowed (loopback, private, link-local, multicast or metadata)",
    "redirect": "the endpoint answered a redirect; redirects are not followed",
    "http": "the endpoint answered an error status",
    "unreachable": "the endpoint could not be reached",
}


def post(url: str, body: bytes, headers: dict[str, str], timeout: float = TIMEOUT_S) -> tuple[int | None, str, str]:
    """POST once to a checked address. Returns (status code or None, operator detail, reason key)."""
    try:
        target = netguard.resolve_public(url)
    except netguard.AddressRefused as exc:
        return None, f"refused: {exc}"[:500], "refused"
    cls = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    conn = cls(target.host, target.port, target.addresses[0], timeout)
    try:
        conn.request("POST", target.path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read(65536)
        code = resp.status
    except (OSError, http.client.HTTPException) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:500], "unreachable"
    finally:
        conn.close()
    if 200 <= code < 300:
        return code, "", ""
    if 300 <= code < 400:
        return code, f"HTTP {code} redirect (not followed)", "redirect"
    return code, f"HTTP {code}", "http"


def deliver(delivery_id: int, *, final_attempt: bool = False) -> str:
    d = WebhookDelivery.objects.select_related("endpoint").filter(pk=delivery_id).first()
    if d is None:  # the endpoint (and its deliveries) was deleted while a retry was pending
        log.info("webhook delivery gone", extra={"delivery": delivery_id})
        return "gone"
    if d.status != WebhookDelivery.Status.PENDING:
        return d.status
    body = json.dumps(d.payload, sort_keys=True, separators=(",", ":")).encode()
    code, error, reason = post(d.endpoint.url, body, {
        "Content-Type": "application/json", "User-Agent": "Tessera-Webhooks/1",
        "X-Tessera-Event": d.event, "X-Tessera-Delivery": str(d.pk),
        "X-Tessera-Signature": sign(d.endpoint.secret, body, int(time.time())),
    })
    ok = code is not None and 200 <= code < 300
    status = WebhookDelivery.Status.DELIVERED if ok else (
        WebhookDelivery.Status.FAILED if final_attempt else WebhookDelivery.Status.PENDING)
    WebhookDelivery.objects.filter(pk=d.pk).update(
        attempts=d.attempts + 1, last_status_code=code, last_error=error, last_reason=REASONS.get(reason, ""),
        status=status, delivered_at=timezone.now() if ok else None)
    if not ok and not final_attempt:
        raise DeliveryFailed(f"delivery {d.pk} to {d.endpoint.url}: {error or code}")
    return status
