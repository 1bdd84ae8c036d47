"""Outbound webhooks: events are stored as deliveries (one per endpoint and event), POSTed with an
HMAC-SHA256 signature, retried with backoff on their own queue and workers, and logged.

Signature header: ``X-Tessera-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``.
Receivers recompute it over the raw body and reject old timestamps (replays).

Targets are tenants' choice, so every URL is checked (``netguard``) at registration and again at
every delivery: the host is resolved, each address must be public (or in
TESSERA_WEBHOOK_ALLOW_NETWORKS), and the request connects to that checked address (no second DNS
lookup: no rebinding). Redirects are never followed (a 3xx is a failed attempt). The delivery log
keeps the detail (status code, connection error) for operators; tenants read only the status class
and a generic reason (``last_reason``), so the log cannot be used to probe ports. A refused registration
reads the same whatever the name resolved to (or whether it resolved at all). A tenant registers at most
TESSERA_WEBHOOK_MAX_ENDPOINTS endpoints.

Tenants' endpoints are slow at will, so:

* deliveries run on the ``webhooks`` queue (``QUEUE``), consumed by workers of their own, never
  by the control worker that consumes usage and runs beat's jobs, nor by a node's;
* an attempt has one deadline, TESSERA_WEBHOOK_TIMEOUT_S, for all of it: the name lookup, connecting, TLS,
  sending, the answer's status line and headers, and its body (read up to 64 KiB). Every socket operation
  waits only for what is left of it (``_Deadline``), so an endpoint that sends its headers and then one
  byte a second, or never ends its headers, is given up at the deadline, not kept for as long as it
  dribbles. An answer whose headers were cut short is an error, never a delivery;
* each attempt is claimed before it starts (``attempts`` counted, ``next_attempt_at`` set to when it is
  overdue), and its outcome schedules the next one (backoff from TESSERA_WEBHOOK_BACKOFF_S, doubling).
  An attempt that never records its outcome (its worker was killed, or ran past the task's time limit)
  is queued again by the sweep (beat, every TESSERA_WEBHOOK_SWEEP_INTERVAL_S) once overdue, and counts
  as tried: after TESSERA_WEBHOOK_MAX_ATTEMPTS the delivery ends ``failed`` with a reason, never
  ``pending`` for good. A duplicate message (a redelivery, the sweep racing a retry) finds the
  delivery claimed or not due and does nothing.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import http.client
import io
import json
import logging
import random
import secrets
import socket
import ssl
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from marketplace import enqueue
from marketplace.models import WebhookDelivery, WebhookEndpoint
from marketplace.services import netguard
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.models import Tenant
from tenants.scoping import Principal

log = logging.getLogger("tessera.webhooks")
#: the deliveries' own queue (settings.CELERY_TASK_ROUTES): tenants' endpoints are slow at will, so a delivery
#: never shares a worker with the control queue (usage, beat's jobs) or a node's
QUEUE = "webhooks"
READ_LIMIT = 65536  # of the answer's body; the rest is not read
BACKOFF_MAX_S = 1800.0  # below the broker's visibility timeout (3600 s): a retry waiting in a worker is not redelivered
SWEEP_GRACE_S = 60.0  # a retry this overdue lost its message (or its worker): the sweep queues it again
SWEEP_BATCH = 1000


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
    if tenant is not None:
        _check_endpoint_cap(tenant)  # before the lookup: a tenant at its cap gets no DNS answer out of us
    try:
        netguard.resolve_public(url, timeout=settings.TESSERA_WEBHOOK_TIMEOUT_S)
    except netguard.AddressRefused as exc:
        # The tenant reads the same sentence whatever the name resolved to (an internal address, none, too
        # slowly): the detail would map the MSP's internal names. Operators have it in the diagnostic and the log.
        log.info("webhook URL refused", extra={"tenant": tenant.slug if tenant else None, "detail": str(exc)})
        raise ServiceError(f"this URL cannot receive webhooks: {exc.public}", field="url",
                           diagnostic=f"this URL cannot receive webhooks: {exc}") from None
    with transaction.atomic():
        if tenant is not None:
            Tenant.objects.select_for_update().filter(pk=tenant.pk).values_list("pk", flat=True).first()
            _check_endpoint_cap(tenant)  # again under the tenant's lock: two registrations at once count each other
        return WebhookEndpoint.objects.create(tenant=tenant, url=url, events=sorted(set(events)),
                                              secret=secrets.token_urlsafe(32))


def _check_endpoint_cap(tenant: Tenant) -> None:
    cap = settings.TESSERA_WEBHOOK_MAX_ENDPOINTS
    if WebhookEndpoint.objects.filter(tenant=tenant).count() >= cap:
        raise Conflict(f"a tenant may register at most {cap} webhook endpoints; delete one first", field="url",
                       code="limit")


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
            transaction.on_commit(functools.partial(_enqueue, d.pk))
            out.append(d)
    return out


def _enqueue(delivery_id: int, countdown: float | None = None) -> None:
    enqueue.send(enqueue.DELIVER_WEBHOOK, [delivery_id], QUEUE, countdown=countdown)


# --- one attempt: the HTTP exchange under one deadline ------------------------------------------------------------

class AttemptTimedOut(TimeoutError):
    """The attempt's deadline passed before the exchange was complete."""


class IncompleteAnswer(http.client.HTTPException):
    """The answer's headers were cut short (the connection closed before the blank line that ends them)."""


class _Deadline:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; AttemptTimedOut once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise AttemptTimedOut(f"no complete answer within {self.seconds:g} s")
        return left


class _DeadlineReader(io.RawIOBase):
    """The answer's bytes, read through the socket reader http.client opened (which keeps the socket open until
    the answer is closed): each read waits only for what is left of the attempt's deadline. A plain per-read
    timeout would let an endpoint that sends a byte a second keep the attempt for as long as it likes."""

    def __init__(self, raw, sock: socket.socket, deadline: _Deadline):
        super().__init__()
        self._raw, self._sock, self._deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self._sock.settimeout(self._deadline.left())
        try:
            return self._raw.readinto(buffer)
        except TimeoutError:
            self._deadline.left()  # past the deadline: AttemptTimedOut
            raise

    def close(self) -> None:
        self._raw.close()
        super().close()


class _HeadWatch:
    """http.client's reader, recording the last line read: the headers ended only if it was a blank line."""

    def __init__(self, raw: io.BufferedReader):
        self._raw = raw
        self.last_line = b""

    def readline(self, limit: int = -1) -> bytes:
        self.last_line = self._raw.readline(limit)
        return self.last_line

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


class _Response(http.client.HTTPResponse):
    def __init__(self, sock: socket.socket, *args, deadline: _Deadline, **kwargs):
        super().__init__(sock, *args, **kwargs)
        raw = self.fp.detach()  # http.client's socket reader, under ours, which bounds every read by the deadline
        self._head = _HeadWatch(io.BufferedReader(_DeadlineReader(raw, sock, deadline)))
        self.fp = self._head  # type: ignore[assignment]

    def begin(self) -> None:
        super().begin()
        if self._head.last_line not in (b"\r\n", b"\n"):
            raise IncompleteAnswer("the answer's headers never ended: the connection closed first")


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to one already-checked address; the Host header stays the URL's host. Every step waits only
    for what is left of the attempt's deadline."""

    def __init__(self, host: str, port: int, address: str, deadline: _Deadline):
        super().__init__(host, port, timeout=deadline.seconds)
        self._address, self._deadline = address, deadline
        self.response_class = functools.partial(_Response, deadline=deadline)  # type: ignore[assignment]

    def _open(self) -> socket.socket:
        sock = socket.create_connection((self._address, self.port), self._deadline.left())
        sock.settimeout(self._deadline.left())  # sending the request (small: the kernel's buffer takes it)
        return sock

    def connect(self):
        self.sock = self._open()


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    default_port = http.client.HTTPS_PORT

    def connect(self):
        sock = self._open()
        # the handshake as a whole is bounded by the socket's timeout (CPython's ssl module counts it as one
        # deadline); the certificate is checked for the URL's host
        self.sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.sock.settimeout(self._deadline.left())


#: what a tenant reads about a failed attempt (operators read `last_error`)
REASONS = {
    "refused": f"the endpoint's address is not allowed: {netguard.NOT_PUBLIC}",
    "redirect": "the endpoint answered a redirect; redirects are not followed",
    "http": "the endpoint answered an error status",
    "unreachable": "the endpoint could not be reached",
    "timeout": "the endpoint did not answer completely in time",
    "invalid": "the endpoint's answer was not a complete HTTP response",
    "lost": "the delivery attempt did not finish",
}


def post(url: str, body: bytes, headers: dict[str, str], timeout: float | None = None
         ) -> tuple[int | None, str, str]:
    """POST once to a checked address, all of it (lookup, connect, TLS, request, answer) within `timeout` seconds
    (default TESSERA_WEBHOOK_TIMEOUT_S). Returns (status code or None, operator detail, reason key)."""
    deadline = _Deadline(settings.TESSERA_WEBHOOK_TIMEOUT_S if timeout is None else timeout)
    try:
        target = netguard.resolve_public(url, timeout=deadline.left())
    except netguard.AddressRefused as exc:
        return None, f"refused: {exc}"[:500], "refused"
    except AttemptTimedOut as exc:
        return None, f"{exc} (resolving the host)"[:500], "timeout"
    cls = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    conn = cls(target.host, target.port, target.addresses[0], deadline)
    try:
        conn.request("POST", target.path, body=body, headers={**headers, "Connection": "close"})
        resp = conn.getresponse()
        resp.read(READ_LIMIT)
        code = resp.status
    except TimeoutError as exc:  # AttemptTimedOut, or the deadline reached inside connect or the TLS handshake
        return None, f"no complete answer within {deadline.seconds:g} s ({type(exc).__name__}: {exc})"[:500], \
            "timeout"
    except http.client.HTTPException as exc:  # before OSError: RemoteDisconnected is both
        return None, f"{type(exc).__name__}: {exc}"[:500], "invalid"
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}"[:500], "unreachable"
    finally:
        conn.close()
    if 200 <= code < 300:
        return code, "", ""
    if 300 <= code < 400:
        return code, f"HTTP {code} redirect (not followed)", "redirect"
    return code, f"HTTP {code}", "http"


# --- deliveries: claimed attempts, backoff, the sweep ---------------------------------------------------------------

def backoff_s(attempt: int) -> float:
    """Seconds between attempt `attempt` (1-based) and the next: TESSERA_WEBHOOK_BACKOFF_S doubled per attempt, at
    most BACKOFF_MAX_S, less up to half of it at random (deliveries failing together do not retry together)."""
    full = min(settings.TESSERA_WEBHOOK_BACKOFF_S * 2 ** (attempt - 1), BACKOFF_MAX_S)
    return full * (1 - random.random() / 2)  # jitter, not a secret


def deliver(delivery_id: int) -> str:
    """One attempt of a delivery, if it is due (task tessera.deliver_webhook). Returns its status afterwards
    ("pending", "delivered", "failed"), "gone", or "not due" (a duplicate message: nothing done)."""
    claimed = _claim(delivery_id)
    if isinstance(claimed, str):
        return claimed
    d, attempt = claimed
    body = json.dumps(d.payload, sort_keys=True, separators=(",", ":")).encode()
    code, error, reason = post(d.endpoint.url, body, {
        "Content-Type": "application/json", "User-Agent": "Tessera-Webhooks/1",
        "X-Tessera-Event": d.event, "X-Tessera-Delivery": str(d.pk),
        "X-Tessera-Signature": sign(d.endpoint.secret, body, int(time.time())),
    })
    ok = code is not None and 200 <= code < 300
    final = attempt >= settings.TESSERA_WEBHOOK_MAX_ATTEMPTS
    now = timezone.now()
    if ok:
        status, due = WebhookDelivery.Status.DELIVERED, None
    elif final:
        status, due = WebhookDelivery.Status.FAILED, None
        error = f"gave up after {attempt} attempts; the last: {error or code}"
    else:
        status, due = WebhookDelivery.Status.PENDING, backoff_s(attempt)
    recorded = WebhookDelivery.objects.filter(pk=d.pk, status=WebhookDelivery.Status.PENDING, attempts=attempt).update(
        last_status_code=code, last_error=error[:500], last_reason=REASONS.get(reason, ""), status=status,
        delivered_at=now if ok else None, next_attempt_at=None if due is None else now + timedelta(seconds=due))
    if not recorded:  # deleted meanwhile, or this attempt overran its claim and a later one took over
        return "superseded" if WebhookDelivery.objects.filter(pk=d.pk).exists() else "gone"
    if due is not None:
        log.info("webhook attempt failed, retrying", extra={"delivery": d.pk, "attempt": attempt, "in_s": round(due, 1),
                                                           "error": error[:200]})
        transaction.on_commit(functools.partial(_enqueue, d.pk, due))
    elif not ok:
        log.warning("webhook delivery failed", extra={"delivery": d.pk, "attempts": attempt, "error": error[:200]})
    return status


def _claim(delivery_id: int) -> tuple[WebhookDelivery, int] | str:
    """Lock the delivery and, if it is due, count the attempt about to be made and set when it will be overdue
    (its deadline plus the backoff: if its worker dies, the sweep queues the next one about when a failed attempt
    would have). A delivery whose last claimed attempt never reported back and had no tries left fails here."""
    now = timezone.now()
    with transaction.atomic():
        d = (WebhookDelivery.objects.select_for_update(of=("self",)).select_related("endpoint")
             .filter(pk=delivery_id).first())
        if d is None:  # the endpoint (and its deliveries) was deleted while a retry was pending
            log.info("webhook delivery gone", extra={"delivery": delivery_id})
            return "gone"
        if d.status != WebhookDelivery.Status.PENDING:
            return d.status
        if d.next_attempt_at is not None and d.next_attempt_at > now:
            return "not due"
        if d.attempts >= settings.TESSERA_WEBHOOK_MAX_ATTEMPTS:
            detail = (f"gave up after {d.attempts} attempts; the last did not report back (its worker was "
                      f"stopped or it ran past its time limit)")
            WebhookDelivery.objects.filter(pk=d.pk).update(
                status=WebhookDelivery.Status.FAILED, next_attempt_at=None, last_status_code=None,
                last_error=detail, last_reason=REASONS["lost"])
            log.warning("webhook delivery failed", extra={"delivery": d.pk, "attempts": d.attempts, "error": detail})
            return WebhookDelivery.Status.FAILED
        attempt = d.attempts + 1
        overdue = now + timedelta(seconds=settings.TESSERA_WEBHOOK_TIMEOUT_S + backoff_s(attempt))
        WebhookDelivery.objects.filter(pk=d.pk).update(attempts=attempt, next_attempt_at=overdue)
    return d, attempt


def sweep(grace_s: float | None = None) -> int:
    """Beat (tessera.sweep_webhooks, on the webhooks queue): queue again every pending delivery overdue by more
    than `grace_s` (default: SWEEP_GRACE_S, or the sweep's interval if shorter): its retry message was lost, or
    the worker of its attempt was killed. A retry merely running late is queued twice at worst, and the second
    message finds it claimed. Returns how many were queued."""
    if grace_s is None:
        grace_s = min(SWEEP_GRACE_S, settings.TESSERA_WEBHOOK_SWEEP_INTERVAL_S)
    cutoff = timezone.now() - timedelta(seconds=grace_s)
    due = list(WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING)
               .filter(Q(next_attempt_at__lte=cutoff) | Q(next_attempt_at__isnull=True))
               .order_by("next_attempt_at").values_list("pk", flat=True)[:SWEEP_BATCH])
    for pk in due:
        _enqueue(pk)
    if due:
        log.info("overdue webhook deliveries queued again", extra={"deliveries": len(due)})
    return len(due)
