"""Single sign-on's rule (tenants.sso.sign_in) without a browser: who may enter and what they become; the
provider's origin in the sign-out form's CSP; SSO off answers 404 and shows no button; an operator sets a tenant's
SSO e-mail domain (normalized, one tenant's only). Through a real provider and a browser: tests/browser/test_sso.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import sso
from tenants.models import AuditEvent, Invitation, Membership, Tenant, User
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db


def _invite(tenant, email, role="member", days=3):
    return Invitation.objects.create(tenant=tenant, email=email, role=role,
                                     token_hash=f"{abs(hash((email, days))):064x}"[:64],
                                     expires_at=timezone.now() + timedelta(days=days))


def test_who_enters_and_as_what(settings):
    settings.TESSERA_OIDC_OPERATOR_GROUP = "ops"
    acme = TenantFactory(slug="acme", sso_email_domain="acme.example")
    other = TenantFactory(slug="other")
    op = sso.sign_in({"email": "Boss@MSP.example", "email_verified": True, "groups": ["ops", "x"]})
    assert op.email == "boss@msp.example" and op.is_operator and not op.has_usable_password()
    dev = sso.sign_in({"email": "dev@acme.example", "groups": []})
    assert [(m.tenant, m.role) for m in Membership.objects.filter(user=dev)] == [(acme, "member")]
    _invite(other, "dev@acme.example", role="admin")
    _invite(other, "late@else.example", days=-1)  # expired: admits nobody
    sso.sign_in({"email": "dev@acme.example"})
    assert {(m.tenant.slug, m.role) for m in Membership.objects.filter(user=dev)} == {("acme", "member"),
                                                                                     ("other", "admin")}
    for claims, why in (({"email": "late@else.example"}, "No tenant admits"),
                        ({"email": "dev@acme.example", "email_verified": False}, "not verified"),
                        ({"name": "no mail"}, "did not give an e-mail")):
        with pytest.raises(sso.Refused, match=why):
            sso.sign_in(claims)
    assert not User.objects.filter(email="late@else.example").exists()
    User.objects.filter(pk=dev.pk).update(is_active=False)
    with pytest.raises(sso.Refused, match="disabled"):
        sso.sign_in({"email": "dev@acme.example"})
    # the provider drops the operator from the group: no longer one at the next sign-in; a local one stays
    assert not sso.sign_in({"email": "boss@msp.example", "groups": ["x"]}).is_operator
    local = User.objects.create_superuser(email="root@msp.example", password="pw-Secret-123")
    assert sso.sign_in({"email": "root@msp.example", "groups": []}).is_operator
    assert AuditEvent.objects.filter(action="user.sso_login").count() == 5
    assert AuditEvent.objects.filter(action="user.sso_login", detail__operator_revoked=True).count() == 1
    assert local.is_staff


def test_sso_off_has_no_button_and_no_route(client, settings):
    settings.OIDC_RP_CLIENT_ID = ""
    assert 'id="sso"' not in client.get("/login/").content.decode()
    assert client.get("/oidc/authenticate/").status_code == 404
    assert client.get("/oidc/callback/?code=x&state=y").status_code == 404
    assert "form-action 'self';" in client.get("/login/")["Content-Security-Policy"] + ";"


def test_sso_on_lets_the_sign_out_form_reach_the_provider(client, settings):
    settings.OIDC_RP_CLIENT_ID, settings.TESSERA_OIDC_PROVIDER_NAME = "tessera", "Okta"
    settings.TESSERA_OIDC_END_SESSION_ENDPOINT = "https://id.example.com:8443/oauth2/logout?x=1"
    page = client.get("/login/")
    assert "Sign in with Okta" in page.content.decode()
    assert "form-action 'self' https://id.example.com:8443" in page["Content-Security-Policy"]


def test_an_operator_sets_a_tenants_sso_domain(world, operator, as_user, members_a):
    op = as_user(operator)
    r = op.patch("/api/v1/tenants/alpha/", {"sso_email_domain": " @Alpha.Example "}, format="json")
    assert r.status_code == 200 and r.json()["sso_email_domain"] == "alpha.example", r.content
    for bad, status in (("not a domain", 400), ("alpha.example", 200)):
        assert op.patch("/api/v1/tenants/alpha/", {"sso_email_domain": bad}, format="json").status_code == status
    r = op.patch("/api/v1/tenants/bravo/", {"sso_email_domain": "alpha.example"}, format="json")
    assert r.status_code == 409 and Tenant.objects.get(slug="bravo").sso_email_domain == "", r.content
    from tenants.roles import Role

    r = as_user(members_a[Role.OWNER]).patch("/api/v1/tenants/alpha/", {"sso_email_domain": "evil.example"},
                                             format="json")
    assert r.status_code == 403 and Tenant.objects.get(slug="alpha").sso_email_domain == "alpha.example"


def test_the_sign_in_redirect_never_leads_off_site(client, settings):
    """A crafted link (?next= another host, an internal address) cannot make the sign-in end there."""
    settings.OIDC_RP_CLIENT_ID, settings.OIDC_RP_CLIENT_SECRET = "tessera", "secret"
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = "https://id.example.com/authorize"
    settings.OIDC_OP_TOKEN_ENDPOINT = "https://id.example.com/token"
    settings.OIDC_OP_USER_ENDPOINT = "https://id.example.com/userinfo"
    settings.OIDC_OP_JWKS_ENDPOINT = "https://id.example.com/jwks"
    for target in ("https://evil.example/", "http://169.254.169.254/latest/meta-data/", "//127.0.0.1:6379/"):
        r = client.get("/oidc/authenticate/", {"next": target})
        assert r.status_code == 302 and r["Location"].startswith("https://id.example.com/authorize?")
        assert client.session.get("oidc_login_next") is None, target
    client.get("/oidc/authenticate/", {"next": "/portal/keys/"})
    assert client.session.get("oidc_login_next") == "/portal/keys/"


def test_an_invitation_to_another_address_is_not_taken_by_sso():
    other = TenantFactory(slug="other")
    _invite(other, "victim@else.example", role="owner")
    with pytest.raises(sso.Refused, match="No tenant admits"):
        sso.sign_in({"email": "attacker@else.example", "email_verified": True})
    assert Invitation.objects.get(email="victim@else.example").accepted_at is None
    assert not Membership.objects.filter(tenant=other).exists()
