"""Single sign-on through the browser against a REAL OpenID Connect provider (django-oauth-toolkit's, its own
Django project in a second process: tests/oidc_provider): an operator mapped by the provider's group claim lands
in the console, a tenant user admitted by e-mail domain or by invitation lands in the portal, logout ends the
provider's session too, a disabled account and a stranger are refused, and an operator the provider dropped from
the group loses the console at the next sign-in."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from tenants.models import Invitation, Membership, User
from tenants.sso import OPERATOR_GROUP
from tests.factories import TenantFactory
from tests.gateway_fixtures import free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "idp-Secret-123"
USERS = [("ops", "ops@msp.example", ["tessera-operators"]), ("dev", "dev@acme.example", ["engineering"]),
         ("guest", "guest@elsewhere.example", []), ("stranger", "nobody@nowhere.example", []),
         ("gone", "gone@acme.example", []), ("exop", "exop@msp.example", [])]

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def provider(live_server, tmp_path, settings):
    port = free_port()
    config = {"users": [{"username": u, "email": e, "password": PASSWORD, "groups": g} for u, e, g in USERS],
              "client": {"id": "tessera-test", "secret": "s3cret-for-tests",
                         "redirect_uri": f"{live_server.url}/oidc/callback/",
                         "post_logout_redirect_uri": f"{live_server.url}/login/"}}
    (tmp_path / "oidc.json").write_text(json.dumps(config))
    proc = subprocess.Popen([sys.executable, "-m", "tests.oidc_provider.serve", str(port), str(tmp_path / "oidc.json")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=(tmp_path / "provider.log").open("w"), text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip() == "ready", f"the provider did not start: {(tmp_path / 'provider.log').read_text()[-3000:]}"
        base = f"http://127.0.0.1:{port}/o"
        settings.OIDC_RP_CLIENT_ID, settings.OIDC_RP_CLIENT_SECRET = "tessera-test", "s3cret-for-tests"
        settings.OIDC_OP_AUTHORIZATION_ENDPOINT = f"{base}/authorize/"
        settings.OIDC_OP_TOKEN_ENDPOINT = f"{base}/token/"
        settings.OIDC_OP_USER_ENDPOINT = f"{base}/userinfo/"
        settings.OIDC_OP_JWKS_ENDPOINT = f"{base}/.well-known/jwks.json"
        settings.TESSERA_OIDC_END_SESSION_ENDPOINT = f"{base}/logout/"
        settings.TESSERA_OIDC_PROVIDER_NAME = "Acme ID"
        yield {"url": f"http://127.0.0.1:{port}", "log": tmp_path / "provider.log"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _sso(page, live_server, username):
    page.goto(f"{live_server.url}/login/")
    page.click("#sso")
    page.fill("#idp-user", username)
    page.fill("#idp-password", PASSWORD)
    page.click("#idp-submit")
    page.wait_for_load_state("networkidle")
    return page


def test_operators_and_tenant_users_sign_in_through_the_provider(provider, live_server, page, shot):
    acme = TenantFactory(slug="acme", name="Acme", sso_email_domain="acme.example")
    other = TenantFactory(slug="else", name="Elsewhere")
    Invitation.objects.create(tenant=other, email="guest@elsewhere.example", role="admin", token_hash="x" * 64,
                              expires_at=timezone.now() + timedelta(days=3))
    page.goto(f"{live_server.url}/login/")
    assert page.locator("#sso").inner_text() == "Sign in with Acme ID"
    shot(page, "sso-login")

    _sso(page, live_server, "ops")
    assert "/console/" in page.url, page.url
    ops = User.objects.get(email="ops@msp.example")
    assert ops.is_operator and ops.groups.filter(name=OPERATOR_GROUP).exists() and not ops.has_usable_password()
    shot(page, "sso-operator-console")
    page.click("form.who button[type=submit]")  # logout: Tessera's, then the provider's, back to Tessera's sign-in
    page.wait_for_url(f"{live_server.url}/login/**")
    page.goto(f"{live_server.url}/console/")
    assert "/login/" in page.url  # signed out of Tessera
    page.goto(f"{live_server.url}/login/")
    page.click("#sso")
    assert page.locator("#idp-user").is_visible()  # and of the provider: it asks again

    page.fill("#idp-user", "dev")
    page.fill("#idp-password", PASSWORD)
    page.click("#idp-submit")
    page.wait_for_load_state("networkidle")
    assert "/portal/" in page.url, page.url
    dev = User.objects.get(email="dev@acme.example")
    assert not dev.is_operator and Membership.objects.get(user=dev).tenant == acme  # by e-mail domain, a member
    assert Membership.objects.get(user=dev).role == "member"
    shot(page, "sso-tenant-portal")
    page.click("form.who button[type=submit]")
    page.wait_for_url(f"{live_server.url}/login/**")

    _sso(page, live_server, "guest")
    assert "/portal/" in page.url, page.url
    guest = Membership.objects.get(user__email="guest@elsewhere.example")
    assert (guest.tenant, guest.role) == (other, "admin")  # by invitation, with its role
    assert Invitation.objects.get(email="guest@elsewhere.example").accepted_by == guest.user


def test_the_disabled_the_stranger_and_the_dropped_operator_are_refused(provider, live_server, page, shot):
    TenantFactory(slug="acme", name="Acme", sso_email_domain="acme.example")
    User.objects.create_user(email="gone@acme.example", is_active=False)
    _sso(page, live_server, "gone")
    assert "/login/" in page.url and "gone@acme.example is disabled" in page.content()
    shot(page, "sso-disabled-refused")
    assert not Membership.objects.filter(user__email="gone@acme.example").exists()

    page.context.clear_cookies()
    _sso(page, live_server, "stranger")
    assert "/login/" in page.url and "No tenant admits nobody@nowhere.example" in page.content()
    assert not User.objects.filter(email="nobody@nowhere.example").exists()

    exop = User.objects.create_user(email="exop@msp.example", is_staff=True)
    from tenants.sso import _operator_group

    exop.groups.add(_operator_group())
    assert User.objects.get(pk=exop.pk).is_operator
    page.context.clear_cookies()
    _sso(page, live_server, "exop")  # the provider no longer lists the operators' group
    exop = User.objects.get(pk=exop.pk)
    assert not exop.is_operator and not exop.is_staff
    assert "/portal/" in page.url, page.url  # signed in (an existing account), as a tenant user
    assert page.goto(f"{live_server.url}/console/").status == 403
