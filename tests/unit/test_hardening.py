"""Hardening: API rate limits, login lockout, deploy settings, Content-Security-Policy, audit log."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

from tenants import lockout
from tenants.models import AuditEvent
from tenants.roles import Role
from tests.factories import UserFactory

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-Secret-123"


# --- throttling -------------------------------------------------------------------------------

def test_api_key_rate_limit_gives_429_with_retry_after_and_spares_other_keys(world, as_key, settings):
    settings.TESSERA_API_RATE = "3/min"
    api = as_key(world["secret_a"])
    for _ in range(3):
        assert api.get("/api/v1/me/").status_code == 200
    r = api.get("/api/v1/me/")
    assert r.status_code == 429
    assert int(r["Retry-After"]) > 0
    assert as_key(world["secret_b"]).get("/api/v1/me/").status_code == 200  # another key: own bucket


def test_usage_ingest_has_its_own_scope(world, as_key, settings, usage_key):
    settings.TESSERA_API_RATE = "100/min"
    settings.TESSERA_USAGE_INGEST_RATE = "2/min"
    api = as_key(usage_key)
    for _ in range(2):
        assert api.post("/api/v1/usage/events/", {"tenant": "alpha", "events": []}).status_code != 429
    assert api.post("/api/v1/usage/events/", {"tenant": "alpha", "events": []}).status_code == 429
    assert api.get("/api/v1/me/").status_code == 200  # reads are counted separately


def test_session_users_are_limited_per_user(members_a, as_user, settings):
    settings.TESSERA_API_RATE = "2/min"
    api = as_user(members_a[Role.OWNER])
    assert [api.get("/api/v1/me/").status_code for _ in range(3)] == [200, 200, 429]
    assert as_user(members_a[Role.VIEWER]).get("/api/v1/me/").status_code == 200


# --- login lockout ----------------------------------------------------------------------------

@pytest.fixture
def person(db):
    return UserFactory(email="pat@alpha.example")


def _login(client, path, email, password, ip="10.0.0.1"):
    return client.post(path, {"username": email, "password": password}, REMOTE_ADDR=ip)


@pytest.mark.parametrize("path", ["/login/", "/admin/login/"])
def test_lockout_after_max_failures_refuses_even_the_right_password(person, settings, path):
    settings.TESSERA_LOGIN_MAX_FAILURES = 5
    settings.TESSERA_LOGIN_LOCKOUT_MINUTES = 15
    if path.startswith("/admin/"):
        person.is_staff = True
        person.save()
    client = Client()
    for _ in range(4):
        r = _login(client, path, person.email, "wrong")
        assert r.status_code == 200 and "Too many failed" not in r.content.decode()
    r = _login(client, path, person.email, "wrong")  # the fifth failure locks
    assert "Too many failed sign-in attempts" in r.content.decode()
    r = _login(client, path, person.email, PASSWORD)
    assert r.status_code == 200 and "Too many failed sign-in attempts" in r.content.decode()
    assert "_auth_user_id" not in client.session
    # Another address is not locked out.
    r = _login(Client(), path, person.email, PASSWORD, ip="10.0.0.2")
    assert r.status_code == 302
    # Once the lock expires (cache entry gone) the right password works again.
    lockout.reset(person.email, "10.0.0.1")
    assert _login(Client(), path, person.email, PASSWORD).status_code == 302


def test_success_resets_the_failure_count(person, settings):
    settings.TESSERA_LOGIN_MAX_FAILURES = 3
    for _ in range(2):
        _login(Client(), "/login/", person.email, "wrong")
    assert _login(Client(), "/login/", person.email, PASSWORD).status_code == 302
    for _ in range(2):
        _login(Client(), "/login/", person.email, "wrong")
    assert not lockout.is_locked(person.email, "10.0.0.1")


def test_unknown_emails_are_counted_too(db, settings):
    settings.TESSERA_LOGIN_MAX_FAILURES = 2
    for _ in range(2):
        _login(Client(), "/login/", "nobody@example.com", "x")
    assert lockout.is_locked("Nobody@Example.com", "10.0.0.1")


# --- production settings ----------------------------------------------------------------------

def test_check_deploy_is_clean_with_production_settings(tmp_path):
    inherited = {k: v for k, v in os.environ.items() if k != "DJANGO_ALLOW_ASYNC_UNSAFE"}  # set by browser tests
    env = {**inherited, "DEBUG": "0", "TESSERA_SECURE": "1", "SECRET_KEY": secrets.token_urlsafe(64),
           "ALLOWED_HOSTS": "tessera.example.com", "TESSERA_VAR_DIR": str(tmp_path),
           "DJANGO_SETTINGS_MODULE": "marketplace.settings"}
    code = ("import django; django.setup(); from django.core.management import call_command; "
            "call_command('check', deploy=True, fail_level='WARNING')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_secure_settings_off_by_default(settings):
    assert settings.TESSERA_SECURE is False or os.environ.get("TESSERA_SECURE")
    assert settings.X_FRAME_OPTIONS == "DENY" and settings.SESSION_COOKIE_HTTPONLY


# --- Content-Security-Policy ------------------------------------------------------------------

SCRIPT = re.compile(r"<script\b([^>]*)>", re.I)
INLINE_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.I)


def _check_csp(response):
    csp = response["Content-Security-Policy"]
    assert "'unsafe-inline'" not in csp.split("script-src", 1)[1].split(";", 1)[0]
    assert "object-src 'none'" in csp and "frame-ancestors 'none'" in csp
    nonce = re.search(r"'nonce-([^']+)'", csp).group(1)
    html = response.content.decode()
    for attrs in SCRIPT.findall(html):
        if "src=" in attrs or 'type="application/json"' in attrs:
            continue
        assert f'nonce="{nonce}"' in attrs, f"inline <script{attrs}> without the nonce"
    assert not INLINE_HANDLER.search(html), INLINE_HANDLER.search(html).group(0)
    return nonce


def test_csp_header_and_no_inline_scripts_without_nonce(world, operator, h100_node):
    anon = Client()
    _check_csp(anon.get("/login/"))
    op = Client()
    op.force_login(operator)
    pages = ["/console/", "/console/tenants/", f"/console/tenants/{world['a'].pk}/", "/console/allocations/",
             "/console/invoices/", "/charts/mig-slots/"]
    nonces = set()
    for url in pages:
        r = op.get(url)
        assert r.status_code == 200, url
        nonces.add(_check_csp(r))
    assert len(nonces) == len(pages)  # a fresh nonce per request
    r = op.get("/charts/mig-slots/")
    nonce = _check_csp(r)
    assert f'<script nonce="{nonce}">' in r.content.decode()
    owner = Client()
    owner.force_login(world["a"].memberships.get(role=Role.OWNER).user)
    for url in ["/portal/", "/portal/catalog/", "/portal/slices/", "/portal/usage/", "/portal/keys/",
                "/portal/members/", "/portal/invoices/"]:
        r = owner.get(url)
        assert r.status_code == 200, url
        _check_csp(r)


def test_api_docs_need_no_inline_script(operator):
    c = Client()
    c.force_login(operator)
    r = c.get("/api/docs/")
    assert r.status_code == 200
    _check_csp(r)
    assert c.get("/api/docs/?script=").status_code == 200  # the init script, from 'self'


# --- audit log --------------------------------------------------------------------------------

def test_service_actions_are_audited_and_scoped(world, operator, members_a, as_user):
    api = as_user(operator)
    assert api.post(f"/api/v1/tenants/{world['a'].slug}/suspend/", {"reason": "unpaid"}).status_code == 200
    assert api.post(f"/api/v1/tenants/{world['a'].slug}/activate/").status_code == 200
    owner = as_user(members_a[Role.OWNER])
    r = owner.post("/api/v1/api-keys/", {"tenant": "alpha", "name": "ci", "scopes": ["read"]})
    assert r.status_code == 201
    prefix = r.json()["prefix"]
    assert owner.post(f"/api/v1/api-keys/{r.json()['id']}/revoke/").status_code == 200

    ev = AuditEvent.objects.get(action="tenant.suspend")
    assert ev.actor == f"user:{operator.email}" and ev.actor_user == operator
    assert ev.tenant == world["a"] and ev.detail == {"reason": "unpaid"}
    created = AuditEvent.objects.get(action="api_key.create")
    assert created.target == f"key:{prefix}" and created.actor == f"user:{members_a[Role.OWNER].email}"

    # Owners see their tenant's events only; the invitation to bravo (made by the operator) is not there.
    rows = owner.get("/api/v1/audit/").json()["results"]
    assert rows and {row["tenant"] for row in rows} == {"alpha"}
    assert any(row["action"] == "api_key.create" for row in rows)
    assert owner.get("/api/v1/audit/", {"action": "tenant.suspend"}).json()["results"][0]["detail"] == {
        "reason": "unpaid"}
    # Operators see everything, including bravo's.
    tenants_seen = {row["tenant"] for row in as_user(operator).get("/api/v1/audit/").json()["results"]}
    assert {"alpha", "bravo"} <= tenants_seen
    # Members, viewers and API keys do not read the audit log; nobody writes it through the API.
    assert as_user(members_a[Role.MEMBER]).get("/api/v1/audit/").status_code == 403
    assert as_user(members_a[Role.ADMIN]).get("/api/v1/audit/").status_code == 200
    assert as_user(operator).post("/api/v1/audit/", {}).status_code == 405


def test_audit_row_rolls_back_with_the_action(world, operator):
    from tenants import services
    from tenants.errors import Conflict
    from tenants.scoping import principal_for_user

    op = principal_for_user(operator)
    services.suspend_tenant(op, world["b"], "x")
    with pytest.raises(Conflict):
        services.suspend_tenant(op, world["b"], "again")
    assert AuditEvent.objects.filter(action="tenant.suspend", tenant=world["b"]).count() == 1
