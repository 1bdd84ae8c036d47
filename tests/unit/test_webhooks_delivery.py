"""Webhooks that cannot hurt anyone else (issue 30, item 4), in-process: one deadline for a whole attempt, an answer
whose headers never ended is no delivery, claimed attempts with backoff that end `failed` with a reason (a lost
attempt too), the sweep, the cap on endpoints per tenant, registration errors that never tell what a name resolves
to, and the queue the deliveries go to. The real-worker version (a slow-loris endpoint while usage keeps flowing) is
tests/integration/test_webhooks_worker.py."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from datetime import timedelta
from unittest import mock

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from marketplace import enqueue
from marketplace.models import WebhookDelivery, WebhookEndpoint
from marketplace.services import netguard, webhooks
from tenants.errors import Conflict, ServiceError
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory
from tests.webhook_servers import Endpoint

pytestmark = pytest.mark.django_db
REAL_GETADDRINFO = socket.getaddrinfo


@pytest.fixture
def loopback(settings):
    settings.TESSERA_WEBHOOK_ALLOW_NETWORKS = ["127.0.0.1/32"]  # the misbehaving endpoints are on loopback
    started: list[Endpoint] = []

    def serve(behave: str, interval: float = 0.2) -> Endpoint:
        started.append(Endpoint(behave, interval).start())
        return started[-1]

    yield serve
    for ep in started:
        ep.stop()


def timed_post(url: str, timeout: float):
    t0 = time.monotonic()
    code, detail, reason = webhooks.post(url, b"{}", {"Content-Type": "application/json"}, timeout=timeout)
    return code, detail, reason, time.monotonic() - t0


# --- one deadline for the whole attempt ------------------------------------------------------------------------------

@pytest.mark.parametrize("behave", ["slow_body", "endless_headers", "silent"])
def test_a_dribbling_or_silent_endpoint_is_given_up_at_the_deadline(loopback, behave):
    """Headers then a byte every 0.2 s (slow-loris), a header line every 0.2 s, or nothing: each read finishes
    in time, but the attempt as a whole ends at its 1 s deadline, as a timeout, never as a delivery."""
    ep = loopback(behave)
    code, detail, reason, took = timed_post(ep.url, timeout=1.0)
    assert (code, reason) == (None, "timeout"), detail
    assert 0.9 <= took < 1.6, took
    assert "within 1 s" in detail
    deadline = time.monotonic() + 2
    while ep.connections[0].closed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ep.connections[0].closed is not None  # the connection was closed, not left hanging


def test_an_answer_whose_headers_were_cut_short_is_not_a_delivery(loopback):
    ep = loopback("cut_headers")
    code, detail, reason, took = timed_post(ep.url, timeout=5.0)
    assert (code, reason) == (None, "invalid") and "headers never ended" in detail
    assert took < 2


@pytest.mark.parametrize("behave", ["ok", "big_body"])
def test_a_complete_answer_is_delivered_without_waiting_for_the_endpoint_to_close(loopback, behave):
    """Keep-alive endpoints (the connection left open after a whole answer, or a body far past what is read)."""
    ep = loopback(behave)
    code, detail, reason, took = timed_post(ep.url, timeout=5.0)
    assert (code, reason, detail) == (200, "", "")
    assert took < 2
    assert b"Connection: close" in ep.connections[0].received


@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1: (server context, a client context that trusts it)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
def test_https_checks_the_certificate_and_bounds_the_handshake(loopback, certificate):
    server, trusting = certificate
    tls = Endpoint("ok", tls=server).start()
    try:
        code, detail, reason, _ = timed_post(tls.url, timeout=5.0)
        assert (code, reason) == (None, "unreachable") and "CERTIFICATE_VERIFY_FAILED" in detail  # not trusted
        with mock.patch.object(webhooks.ssl, "create_default_context", lambda: trusting):
            code, detail, reason, took = timed_post(tls.url, timeout=5.0)
        assert (code, reason, detail) == (200, "", "") and took < 2
    finally:
        tls.stop()
    silent = loopback("silent")  # takes the connection, never answers the TLS hello
    code, detail, reason, took = timed_post(silent.url.replace("http:", "https:"), timeout=1.0)
    assert (code, reason) == (None, "timeout") and 0.9 <= took < 1.6, detail


def test_a_slow_name_lookup_counts_against_the_deadline():
    def slow(host, port, *a, **kw):
        time.sleep(3)
        return REAL_GETADDRINFO("127.0.0.1", port, *a, **kw)

    with mock.patch.object(netguard.socket, "getaddrinfo", slow):
        code, detail, reason, took = timed_post("http://slow-dns.example/hook", timeout=0.5)
    assert (code, reason) == (None, "refused") and "did not resolve within" in detail
    assert took < 1.0


# --- attempts: claimed, retried with backoff, given up with a reason ------------------------------------------------

def _delivery(url: str, tenant=None) -> WebhookDelivery:
    ep = WebhookEndpoint.objects.create(tenant=tenant, url=url, secret="s", events=["invoice.finalized"])
    return WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="k", payload={"a": 1})


def _make_due(d: WebhookDelivery) -> None:
    WebhookDelivery.objects.filter(pk=d.pk).update(next_attempt_at=timezone.now())


def test_a_slow_endpoint_is_retried_with_backoff_and_ends_failed_with_a_reason(
        loopback, settings, django_capture_on_commit_callbacks):
    settings.TESSERA_WEBHOOK_TIMEOUT_S, settings.TESSERA_WEBHOOK_MAX_ATTEMPTS = 0.5, 3
    settings.TESSERA_WEBHOOK_BACKOFF_S = 10
    d = _delivery(loopback("slow_body").url)
    sent = []
    with mock.patch.object(enqueue, "send", lambda *a, **kw: sent.append((a, kw))):
        for attempt in (1, 2):
            with django_capture_on_commit_callbacks(execute=True):
                assert webhooks.deliver(d.pk) == "pending"
            d.refresh_from_db()
            assert d.attempts == attempt and d.last_reason == webhooks.REASONS["timeout"]
            wait = (d.next_attempt_at - timezone.now()).total_seconds()
            full = 10 * 2 ** (attempt - 1)  # doubling, less up to half at random
            assert full / 2 - 1 <= wait <= full, wait
            (name, args, queue), kw = sent[-1]
            assert (name, args, queue) == (enqueue.DELIVER_WEBHOOK, [d.pk], "webhooks")
            assert full / 2 - 1 <= kw["countdown"] <= full
            assert webhooks.deliver(d.pk) == "not due"  # a duplicate message does nothing
            _make_due(d)
        with django_capture_on_commit_callbacks(execute=True):
            assert webhooks.deliver(d.pk) == "failed"
    d.refresh_from_db()
    assert d.status == "failed" and d.attempts == 3 and d.next_attempt_at is None
    assert d.last_reason == webhooks.REASONS["timeout"] and d.last_error.startswith("gave up after 3 attempts")
    assert len(sent) == 2  # no retry after the last attempt
    assert webhooks.deliver(d.pk) == "failed"


def test_an_attempt_that_never_reports_back_is_swept_and_counts(settings):
    """Its worker was SIGKILLed, or the task's hard time limit killed it, mid-attempt: the claim counted it and set
    when it is overdue; the sweep queues it again then; without tries left it ends failed, never pending for good."""
    settings.TESSERA_WEBHOOK_MAX_ATTEMPTS = 2
    d = _delivery("http://hooks.example.com/h")
    for _ in range(2):  # two attempts claimed, then their worker died
        assert webhooks._claim(d.pk)[1] in (1, 2)
        assert webhooks.deliver(d.pk) == "not due"  # the redelivered message: the attempt may still be running
        with mock.patch.object(enqueue, "send") as send:
            assert webhooks.sweep(grace_s=0) == 0  # not overdue yet
            WebhookDelivery.objects.filter(pk=d.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=61))
            assert webhooks.sweep() == 1
        send.assert_called_once_with(enqueue.DELIVER_WEBHOOK, [d.pk], "webhooks", countdown=None)
    assert webhooks.deliver(d.pk) == "failed"
    d.refresh_from_db()
    assert d.status == "failed" and d.attempts == 2 and d.last_reason == webhooks.REASONS["lost"]
    assert "did not report back" in d.last_error
    with mock.patch.object(enqueue, "send") as send:
        assert webhooks.sweep(grace_s=0) == 0
    send.assert_not_called()


def test_the_sweep_queues_pending_deliveries_from_before_the_deadline_existed():
    d = _delivery("http://hooks.example.com/h")
    WebhookDelivery.objects.filter(pk=d.pk).update(next_attempt_at=None)
    with mock.patch.object(enqueue, "send") as send:
        assert webhooks.sweep() == 1
    send.assert_called_once_with(enqueue.DELIVER_WEBHOOK, [d.pk], "webhooks", countdown=None)


def test_backoff_doubles_up_to_half_an_hour(settings):
    settings.TESSERA_WEBHOOK_BACKOFF_S = 5
    for attempt, full in [(1, 5), (2, 10), (4, 40), (9, 1280), (10, 1800), (30, 1800)]:
        waits = [webhooks.backoff_s(attempt) for _ in range(50)]
        assert all(full / 2 <= w <= full for w in waits), (attempt, min(waits), max(waits))


# --- registration: a cap per tenant, errors that say nothing about DNS ------------------------------------------------

@pytest.fixture
def owner(db):
    tenant = TenantFactory(slug="acme")
    return tenant, principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)


def resolving(mapping):
    def fake(host, port, *a, **kw):
        if host not in mapping:
            return REAL_GETADDRINFO(host, port, *a, **kw)
        answer = mapping[host]
        if answer == "nxdomain":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if answer == "slow":
            time.sleep(2)
            answer = "10.9.9.9"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer, port))]
    return mock.patch.object(netguard.socket, "getaddrinfo", fake)


def test_a_refused_url_reads_the_same_whatever_its_name_resolved_to(owner, settings):
    """An internal name, a name that does not resolve, one whose lookup is too slow, one resolving to the metadata
    service, an internal literal address: one message, naming no address. Operators read the detail."""
    settings.TESSERA_WEBHOOK_TIMEOUT_S = 0.5
    tenant, p = owner
    names = {"db.corp.example": "10.20.30.40", "nowhere.example": "nxdomain", "slowdns.example": "slow",
             "meta.example": "169.254.169.254", "lo.example": "127.0.0.1"}
    urls = [f"https://{host}/hook" for host in names] + ["http://10.20.30.40/hook", "http://[::1]/hook"]
    messages, diagnostics = set(), []
    with resolving(names):
        for url in urls:
            with pytest.raises(ServiceError) as err:
                webhooks.create_endpoint(p, tenant=tenant, url=url, events=["invoice.finalized"])
            assert err.value.field == "url" and err.value.status_code == 400
            messages.add(err.value.message)
            diagnostics.append(err.value.diagnostic)
    assert messages == {f"this URL cannot receive webhooks: {netguard.NOT_PUBLIC}"}
    for leak in ("10.20.30.40", "169.254", "127.0.0.1", "::1", "private", "loopback", "resolve within", "not known"):
        assert all(leak not in m for m in messages), leak
    assert "10.20.30.40 is a private address" in diagnostics[0] and "does not resolve" in diagnostics[1]
    assert "did not resolve within 0.5 s" in diagnostics[2] and "metadata" in diagnostics[3]
    assert not WebhookEndpoint.objects.exists()


def test_the_api_answer_to_a_refused_url_names_no_address(owner, as_user):
    tenant, _p = owner
    user = tenant.memberships.get(role=Role.OWNER).user
    answers = []
    with resolving({"db.corp.example": "10.20.30.40", "nowhere.example": "nxdomain"}):
        for host in ("db.corp.example", "nowhere.example"):
            r = as_user(user).post("/api/v1/webhooks/", {"tenant": "acme", "url": f"https://{host}/h",
                                                         "events": ["invoice.finalized"]}, format="json")
            assert r.status_code == 400
            answers.append(r.json())
    assert answers[0] == answers[1] and "10.20.30.40" not in str(answers[0])


def test_a_tenant_registers_at_most_the_cap_of_endpoints(owner, settings, as_user, operator):
    settings.TESSERA_WEBHOOK_MAX_ENDPOINTS = 2
    tenant, p = owner
    events = ["invoice.finalized"]
    with resolving({"hooks.example.com": "93.184.216.34"}):
        for i in range(2):
            webhooks.create_endpoint(p, tenant=tenant, url=f"https://hooks.example.com/{i}", events=events)
        with pytest.raises(Conflict, match="at most 2 webhook endpoints"):
            webhooks.create_endpoint(p, tenant=tenant, url="https://hooks.example.com/3", events=events)
        user = tenant.memberships.get(role=Role.OWNER).user
        r = as_user(user).post("/api/v1/webhooks/", {"tenant": "acme", "url": "https://hooks.example.com/4",
                                                     "events": ["invoice.finalized"]}, format="json")
        assert r.status_code == 409 and "at most 2" in str(r.json())
        other = TenantFactory(slug="other")
        op = principal_for_user(operator)
        webhooks.create_endpoint(op, tenant=other, url="https://hooks.example.com/o", events=["invoice.finalized"])
        for i in range(3):  # the MSP's own endpoints are the operators' to manage
            webhooks.create_endpoint(op, tenant=None, url=f"https://hooks.example.com/m{i}",
                                     events=["invoice.finalized"])
    assert WebhookEndpoint.objects.filter(tenant=tenant).count() == 2


# --- the queue ------------------------------------------------------------------------------------------------------

def test_deliveries_and_their_sweep_go_to_the_webhooks_queue_never_the_control_queue(
        owner, django_capture_on_commit_callbacks):
    tenant, _p = owner
    WebhookEndpoint.objects.create(tenant=tenant, url="https://hooks.example.com/", secret="s",
                                   events=["invoice.finalized"])
    with mock.patch.object(enqueue, "send") as send, django_capture_on_commit_callbacks(execute=True):
        webhooks.emit(tenant, "invoice.finalized", "invoice:1", {})
    assert send.call_args.args[2] == "webhooks"
    routes = django_settings.CELERY_TASK_ROUTES
    assert routes["tessera.deliver_webhook"] == routes["tessera.sweep_webhooks"] == {"queue": "webhooks"}
    beat = django_settings.CELERY_BEAT_SCHEDULE
    assert beat["sweep-webhooks"]["task"] == "tessera.sweep_webhooks"
    assert beat["sweep-webhooks"]["options"]["queue"] == "webhooks"
    assert beat["consume-usage"]["options"]["queue"] == "control"
    from marketplace.celery import app

    assert app.amqp.router.route({}, "tessera.deliver_webhook")["queue"].name == "webhooks"
