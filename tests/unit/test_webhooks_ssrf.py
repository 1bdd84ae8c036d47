"""Webhooks are no SSRF or port-scan tool: internal addresses are refused at registration and at every
delivery (resolved once, connected to the checked address), redirects are not followed, tenants read a
status class and a generic reason, and a deleted endpoint's pending retry ends quietly."""

from __future__ import annotations

import http.server
import socket
import threading
from unittest import mock

import pytest

from marketplace import tasks
from marketplace.models import WebhookDelivery, WebhookEndpoint
from marketplace.services import netguard, webhooks
from tenants.errors import ServiceError
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory

pytestmark = pytest.mark.django_db
REAL_GETADDRINFO = socket.getaddrinfo

INTERNAL = [
    "http://127.0.0.1:8000/x", "http://localhost/x", "http://10.1.2.3/", "http://172.16.0.1/", "http://192.168.1.1/",
    "http://169.254.169.254/latest/meta-data/", "http://100.64.0.1/", "http://0.0.0.0/", "http://224.0.0.1/",
    "http://[::1]/", "http://[fe80::1]/", "http://[fc00::1]/", "http://[::ffff:127.0.0.1]/",
    "http://[fd00:ec2::254]/", "http://[64:ff9b::a00:1]/", "http://[ff02::1]/",
]


class _Rx(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, dict]] = []
    status = 200

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append((self.path, dict(self.headers)))
        self.send_response(type(self).status)
        if 300 <= type(self).status < 400:
            self.send_header("Location", "/internal/admin")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def rx():
    _Rx.seen, _Rx.status = [], 200
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Rx)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port, _Rx
    server.shutdown()


def resolving(mapping):
    """getaddrinfo where the named hosts resolve to the given addresses (others: the real resolver)."""
    def fake(host, port, *a, **kw):
        if host in mapping:
            ip = mapping[host]() if callable(mapping[host]) else mapping[host]
            fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
            return [(fam, socket.SOCK_STREAM, 6, "", (ip, port))]
        return REAL_GETADDRINFO(host, port, *a, **kw)
    return mock.patch.object(netguard.socket, "getaddrinfo", fake)


@pytest.fixture
def owner_t(db):
    tenant = TenantFactory(slug="acme")
    return tenant, MembershipFactory(tenant=tenant, role=Role.OWNER).user


@pytest.mark.parametrize("url", INTERNAL)
def test_internal_targets_are_refused_at_registration(owner_t, as_user, url):
    tenant, owner = owner_t
    r = as_user(owner).post("/api/v1/webhooks/", {"tenant": tenant.slug, "url": url,
                                                   "events": ["invoice.finalized"]}, format="json")
    assert r.status_code == 400, (url, r.content)
    assert "url" in r.json()
    assert not WebhookEndpoint.objects.exists()


def test_a_name_resolving_to_an_internal_address_is_refused(owner_t):
    tenant, owner = owner_t
    with resolving({"hooks.evil.example": "10.0.0.7"}), pytest.raises(ServiceError) as err:
        webhooks.create_endpoint(principal_for_user(owner), tenant=tenant, url="https://hooks.evil.example/x",
                                 events=["invoice.finalized"])
    assert err.value.field == "url" and "10.0.0.7" not in err.value.message
    assert "10.0.0.7 is a private address" in err.value.diagnostic  # the operators' detail
    assert not WebhookEndpoint.objects.exists()


def _delivery(url):
    ep = WebhookEndpoint.objects.create(tenant=None, url=url, secret="s", events=["invoice.finalized"])
    return WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="k", payload={"a": 1})


def test_dns_rebinding_after_registration_is_refused_at_delivery(owner_t, rx, settings):
    settings.TESSERA_WEBHOOK_MAX_ATTEMPTS = 1
    port, seen = rx
    tenant, owner = owner_t
    answers = iter(["93.184.216.34", "127.0.0.1"])  # public at registration, loopback at delivery
    with resolving({"rebind.example": lambda: next(answers)}):
        ep = webhooks.create_endpoint(principal_for_user(owner), tenant=tenant, url=f"http://rebind.example:{port}/h",
                                      events=["invoice.finalized"])
        d = WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="k", payload={})
        assert webhooks.deliver(d.pk) == "failed"
    d.refresh_from_db()
    assert "loopback" in d.last_error and d.last_status_code is None
    assert seen.seen == []


def test_delivery_connects_to_the_checked_address_with_the_urls_host(settings, rx):
    settings.TESSERA_WEBHOOK_ALLOW_NETWORKS = ["127.0.0.1/32"]  # an MSP's deliberate internal target
    port, seen = rx
    d = _delivery(f"http://hooks.internal.example:{port}/in?x=1")
    with resolving({"hooks.internal.example": "127.0.0.1"}):
        assert webhooks.deliver(d.pk) == "delivered"
    path, headers = seen.seen[0]
    assert path == "/in?x=1" and headers["Host"] == f"hooks.internal.example:{port}"
    assert headers["X-Tessera-Signature"].startswith("t=")


def test_redirects_are_not_followed(settings, rx):
    settings.TESSERA_WEBHOOK_ALLOW_NETWORKS = ["127.0.0.1/32"]
    port, seen = rx
    seen.status = 302
    d = _delivery(f"http://127.0.0.1:{port}/hook")
    assert webhooks.deliver(d.pk) == "pending"  # retried later
    assert [p for p, _ in seen.seen] == ["/hook"]  # /internal/admin never requested
    d.refresh_from_db()
    assert d.status == "pending" and d.last_status_code == 302 and "redirect" in d.last_reason


def test_tenants_read_a_status_class_and_a_generic_reason(settings, owner_t, as_user, operator):
    tenant, owner = owner_t
    settings.TESSERA_WEBHOOK_ALLOW_NETWORKS = ["127.0.0.1/32"]
    settings.TESSERA_WEBHOOK_MAX_ATTEMPTS = 1
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()  # a closed port: "connection refused"
    ep = WebhookEndpoint.objects.create(tenant=tenant, url=f"http://127.0.0.1:{closed}/", secret="s",
                                        events=["invoice.finalized"])
    d = WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="k", payload={})
    webhooks.deliver(d.pk)
    mine = as_user(owner).get(f"/api/v1/webhooks/{ep.pk}/deliveries/").json()["results"][0]
    assert mine["last_status_code"] is None and mine["last_status_class"] is None
    assert mine["last_error"] == webhooks.REASONS["unreachable"]
    assert "refused" not in mine["last_error"].lower()
    ops = as_user(operator).get(f"/api/v1/webhooks/{ep.pk}/deliveries/").json()["results"][0]
    assert "ConnectionRefused" in ops["last_error"]
    WebhookDelivery.objects.filter(pk=d.pk).update(last_status_code=503, last_reason=webhooks.REASONS["http"])
    mine = as_user(owner).get(f"/api/v1/webhooks/{ep.pk}/deliveries/").json()["results"][0]
    assert mine["last_status_class"] == "5xx" and mine["last_status_code"] is None


def test_deleting_an_endpoint_with_a_pending_retry_does_not_crash_the_task(owner_t, as_user):
    tenant, owner = owner_t
    ep = WebhookEndpoint.objects.create(tenant=tenant, url="https://hooks.example.com/", secret="s",
                                        events=["invoice.finalized"])
    d = WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="k", payload={})
    assert as_user(owner).delete(f"/api/v1/webhooks/{ep.pk}/").status_code == 204
    result = tasks.deliver_webhook.apply(args=[d.pk])
    assert result.successful() and result.result == "gone"
