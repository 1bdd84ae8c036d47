"""Outbound webhooks: events are stored as deliveries (one per endpoint and event), POSTed with an
HMAC-SHA256 signature, retried with backoff by a Celery task, and logged.

Signature header: ``X-Tessera-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``.
Receivers recompute it over the raw body and reject old timestamps (replays).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
import urllib.error
import urllib.request

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from marketplace.models import WebhookDelivery, WebhookEndpoint
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
    if not url.startswith(("https://", "http://")):
        raise ServiceError("must be an http(s) URL", field="url")
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
            transaction.on_commit(lambda d=d: _enqueue(d))
            out.append(d)
    return out


def _enqueue(delivery: WebhookDelivery) -> None:
    from marketplace import tasks  # noqa: PLC0415

    tasks.deliver_webhook.apply_async(args=[delivery.pk], queue="control")


def deliver(delivery_id: int, *, final_attempt: bool = False) -> str:
    d = WebhookDelivery.objects.select_related("endpoint").get(pk=delivery_id)
    if d.status != WebhookDelivery.Status.PENDING:
        return d.status
    body = json.dumps(d.payload, sort_keys=True, separators=(",", ":")).encode()
    req = urllib.request.Request(d.endpoint.url, data=body, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "Tessera-Webhooks/1",
        "X-Tessera-Event": d.event, "X-Tessera-Delivery": str(d.pk),
        "X-Tessera-Signature": sign(d.endpoint.secret, body, int(time.time())),
    })
    code, error = None, ""
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310 - operator-configured URL
            code = resp.status
    except urllib.error.HTTPError as exc:
        code, error = exc.code, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        error = str(getattr(exc, "reason", exc))[:500]
    ok = code is not None and 200 <= code < 300
    status = WebhookDelivery.Status.DELIVERED if ok else (
        WebhookDelivery.Status.FAILED if final_attempt else WebhookDelivery.Status.PENDING)
    WebhookDelivery.objects.filter(pk=d.pk).update(
        attempts=d.attempts + 1, last_status_code=code, last_error=error, status=status,
        delivered_at=timezone.now() if ok else None)
    if not ok and not final_attempt:
        raise DeliveryFailed(f"delivery {d.pk} to {d.endpoint.url}: {error or code}")
    return status
