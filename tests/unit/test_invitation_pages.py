"""The invitation link: the e-mail's absolute link, the page for each kind of invitee (new person,
existing account, signed in as the invitee or as someone else), and the pages for expired, used,
revoked and unknown links."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user
from django.test import Client
from django.utils import timezone

from tenants import services
from tenants.models import AuditEvent, Invitation, Membership, User
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

GOOD_PW = "plum-Harbor-47-lantern"
LINK = re.compile(r"(https?://[^\s/]+)/invitations/([\w-]+)/")


@pytest.fixture
def owner(members_a):
    owner = members_a[Role.OWNER]
    owner.full_name = "Olive Owner"
    owner.save(update_fields=["full_name"])
    return owner


@pytest.fixture
def invite(owner, tenant_a):
    def make(email="new.person@example.com", role=Role.BILLING):
        inv, token = services.invite(principal_for_user(owner), tenant=tenant_a, email=email, role=role, send=False)
        return inv, token, f"/invitations/{token}/"
    return make


def signup(client, url, name="New Person", pw=GOOD_PW, pw2=None):
    return client.post(url, {"action": "signup", "full_name": name, "password": pw,
                             "password2": pw if pw2 is None else pw2})


# --- the e-mail ---------------------------------------------------------------------------------

def test_email_has_an_absolute_link_from_the_inviting_request(owner, tenant_a, mailoutbox, settings,
                                                              django_capture_on_commit_callbacks):
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "portal.msp.example"]
    c = Client()
    c.force_login(owner)
    with django_capture_on_commit_callbacks(execute=True):
        r = c.post("/portal/members/invite/", {"email": "Guest@Example.com", "role": "member"},
                   HTTP_HOST="portal.msp.example")
    assert r.status_code == 302
    mail = mailoutbox[-1]
    assert mail.to == ["guest@example.com"] and tenant_a.name in mail.subject
    base, token = LINK.search(mail.body).groups()
    assert base == "http://portal.msp.example"
    assert "Olive Owner" in mail.body and "Member" in mail.body
    assert token not in mail.body.replace(f"/invitations/{token}/", "")  # the token only inside the link
    inv = Invitation.objects.get(email="guest@example.com")
    assert inv.token_hash != token and len(token) >= 40  # only the hash is stored; 256 random bits
    assert Client().get(f"/invitations/{token}/").status_code == 200


def test_a_forged_host_never_becomes_the_link(owner, tenant_a, mailoutbox, django_capture_on_commit_callbacks):
    """A tenant admin inviting through a request with a Host the site does not serve (a phishing domain) never
    gets that host into the e-mail: the request is refused, or the link keeps the site's own address."""
    c = Client()
    c.force_login(owner)
    with django_capture_on_commit_callbacks(execute=True):
        r = c.post("/portal/members/invite/", {"email": "victim@example.com", "role": "member"},
                   HTTP_HOST="evil.example", HTTP_X_FORWARDED_HOST="evil.example")
    sent = [m for m in mailoutbox if "victim@example.com" in m.to]
    assert r.status_code in (302, 400)
    assert all("evil.example" not in m.body for m in sent)
    assert r.status_code == 400 or sent  # refused, or sent with a safe link


def test_site_url_setting_wins_over_the_request(owner, tenant_a, mailoutbox, settings,
                                                django_capture_on_commit_callbacks):
    settings.TESSERA_SITE_URL = "https://tessera.msp.example"
    api = Client()
    api.force_login(owner)
    with django_capture_on_commit_callbacks(execute=True):
        r = api.post("/api/v1/invitations/", {"tenant": "alpha", "email": "x@example.com"},
                     content_type="application/json", HTTP_HOST="127.0.0.1")
    assert r.status_code == 201
    assert LINK.search(mailoutbox[-1].body).group(1) == "https://tessera.msp.example"


# --- a new person -------------------------------------------------------------------------------

def test_new_person_sees_the_invitation_and_a_signup_form(invite, tenant_a):
    _, _, url = invite()
    r = Client().get(url)
    body = r.content.decode()
    assert r.status_code == 200
    assert tenant_a.name in body and "Olive Owner (owner@alpha.example)" in body and "Billing" in body
    assert 'id="signup-form"' in body and "new.person@example.com" in body
    assert 'id="signin-form"' not in body
    assert r["Cache-Control"].startswith("max-age=0") and "no-store" in r["Cache-Control"]


def test_new_person_sets_a_password_joins_and_lands_in_the_portal(invite, tenant_a):
    inv, _, url = invite()
    c = Client()
    r = signup(c, url)
    assert r.status_code == 302 and r["Location"] == "/portal/?tenant=alpha"
    user = User.objects.get(email="new.person@example.com")
    assert user.full_name == "New Person" and user.check_password(GOOD_PW)
    assert Membership.objects.get(user=user).role == Role.BILLING
    inv.refresh_from_db()
    assert inv.status == "accepted" and inv.accepted_by == user
    assert get_user(c) == user  # signed in
    assert set(AuditEvent.objects.filter(tenant=tenant_a, actor="user:new.person@example.com")
               .values_list("action", flat=True)) == {"invitation.accept", "user.sign_up"}
    home = c.get(r["Location"])
    assert home.status_code == 200 and "Welcome to Alpha" in home.content.decode()


@pytest.mark.parametrize("name,pw,pw2,field", [
    ("New Person", "short1", None, "password"),           # too short
    ("New Person", "password123", None, "password"),      # common
    ("New Person", "83920183749", None, "password"),      # only digits
    ("New Person", "new.person@example.com", None, "password"),  # like the e-mail
    ("New Person", GOOD_PW, GOOD_PW + "x", "password2"),  # not repeated right
    ("", GOOD_PW, None, "full_name"),
])
def test_bad_signup_changes_nothing(invite, name, pw, pw2, field):
    inv, _, url = invite()
    r = signup(Client(), url, name, pw, pw2)
    assert r.status_code == 400
    assert 'class="errorlist"' in r.content.decode() and 'id="signup-form"' in r.content.decode()
    assert not User.objects.filter(email="new.person@example.com").exists()
    inv.refresh_from_db()
    assert inv.status == "pending"


def test_double_submit_joins_once(invite):
    inv, _, url = invite()
    first, second = Client(), Client()
    assert signup(first, url).status_code == 302
    again = signup(second, url)  # the second of two clicks, without the first answer's session
    assert again.status_code == 410 and "already been used" in again.content.decode()
    assert signup(first, url).status_code == 302  # the one who joined is sent on to the portal
    assert User.objects.filter(email="new.person@example.com").count() == 1
    assert Membership.objects.filter(tenant=inv.tenant, user__email="new.person@example.com").count() == 1


def test_signup_when_an_account_was_made_meanwhile_is_refused(invite):
    _, token, url = invite()
    page = Client()
    assert 'id="signup-form"' in page.get(url).content.decode()
    UserFactory(email="new.person@example.com")
    r = signup(page, url)  # the page said sign up; the account exists now
    assert r.status_code == 400 and 'id="signin-form"' in r.content.decode()
    with pytest.raises(services.Conflict):
        services.sign_up_and_accept(token, full_name="X", password=GOOD_PW)
    assert not Membership.objects.filter(user__email="new.person@example.com").exists()



def test_signup_whose_acceptance_fails_leaves_no_account(invite, monkeypatch):
    """The account and the membership are one transaction: an acceptance that fails takes the account back."""
    _, token, _url = invite()

    def refuse(user, token):
        raise services.Conflict("this invitation was revoked")

    monkeypatch.setattr(services, "accept_invitation", refuse)
    with pytest.raises(services.Conflict):
        services.sign_up_and_accept(token, full_name="New Person", password=GOOD_PW)
    assert not User.objects.filter(email="new.person@example.com").exists()


# --- someone with an account --------------------------------------------------------------------

def test_existing_account_signs_in_and_joins(invite):
    person = UserFactory(email="new.person@example.com")
    _, _, url = invite()
    c = Client()
    body = c.get(url).content.decode()
    assert 'id="signin-form"' in body and 'id="signup-form"' not in body
    wrong = c.post(url, {"action": "signin", "password": "not-it"})
    assert wrong.status_code == 400 and "not right" in wrong.content.decode()
    assert not Membership.objects.filter(user=person).exists()
    r = c.post(url, {"action": "signin", "password": "pw-Secret-123"})
    assert r.status_code == 302 and r["Location"] == "/portal/?tenant=alpha"
    assert Membership.objects.get(user=person).role == Role.BILLING and get_user(c) == person


def test_sign_in_on_the_invitation_page_is_locked_like_the_login(invite, settings):
    settings.TESSERA_LOGIN_MAX_FAILURES = 3
    UserFactory(email="new.person@example.com")
    _, _, url = invite()
    c = Client()
    for _ in range(3):
        c.post(url, {"action": "signin", "password": "guess"})
    r = c.post(url, {"action": "signin", "password": "pw-Secret-123"})  # right, but locked
    assert r.status_code == 400 and "Too many failed sign-in attempts" in r.content.decode()
    assert not Membership.objects.filter(user__email="new.person@example.com").exists()


def test_signed_in_invitee_clicks_join(invite):
    person = UserFactory(email="new.person@example.com")
    _, _, url = invite()
    c = Client()
    c.force_login(person)
    assert 'id="join-form"' in c.get(url).content.decode()
    r = c.post(url, {"action": "join"})
    assert r.status_code == 302 and Membership.objects.get(user=person).role == Role.BILLING
    assert c.get(url)["Location"] == "/portal/?tenant=alpha"  # opening the link again: on to the portal


def test_signed_in_as_someone_else_gets_a_clear_message_and_cannot_join(invite):
    other = UserFactory(email="someone.else@example.com")
    inv, _, url = invite()
    c = Client()
    c.force_login(other)
    r = c.get(url)
    body = r.content.decode()
    assert r.status_code == 200 and 'id="inv-wrong-user"' in body
    assert "someone.else@example.com" in body and "new.person@example.com" in body
    assert 'id="join-form"' not in body and 'name="next"' in body
    for action in ("join", "signin", "signup"):
        assert c.post(url, {"action": action, "password": GOOD_PW, "password2": GOOD_PW,
                            "full_name": "X"}).status_code == 400
    assert not Membership.objects.filter(user=other, tenant=inv.tenant).exists()
    inv.refresh_from_db()
    assert inv.status == "pending"
    # signing out goes back to the link
    out = c.post("/logout/", {"next": url})
    assert out.status_code == 302 and out["Location"] == url


def test_the_api_and_the_page_follow_one_rule(invite, as_user):
    """The page and POST /api/v1/invitations/accept/ both go through services.accept_invitation."""
    person = UserFactory(email="new.person@example.com")
    _, token, url = invite()
    assert as_user(person).post("/api/v1/invitations/accept/", {"token": token}).status_code == 201
    c = Client()
    assert c.post(url, {"action": "signin", "password": "pw-Secret-123"}).status_code == 410


# --- links that no longer work ------------------------------------------------------------------

def _gone(url, status, text, marker):
    for method in ("get", "post"):
        r = getattr(Client(), method)(url, {"action": "signup", "full_name": "X", "password": GOOD_PW,
                                            "password2": GOOD_PW} if method == "post" else None)
        body = r.content.decode()
        assert r.status_code == status and text in body and f'id="invitation-{marker}"' in body
        assert 'class="topbar"' in body and "signup-form" not in body  # the site's page, no form


def test_expired_link(invite):
    inv, _, url = invite()
    Invitation.objects.filter(pk=inv.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    _gone(url, 410, "This invitation has expired", "expired")
    assert "Ask Olive Owner (owner@alpha.example) to invite you to Alpha again." in Client().get(url).content.decode()
    assert not User.objects.filter(email=inv.email).exists()


def test_used_link(invite):
    inv, token, url = invite()
    services.accept_invitation(UserFactory(email=inv.email), token)
    _gone(url, 410, "already been used", "accepted")


def test_revoked_link(invite, owner):
    inv, _, url = invite()
    services.revoke_invitation(principal_for_user(owner), inv)
    _gone(url, 410, "was withdrawn", "revoked")
    assert "Alpha" not in Client().get(url).content.decode()  # a withdrawn link no longer names the tenant
    assert not User.objects.filter(email=inv.email).exists()


def test_unknown_link_says_nothing_about_anyone(invite):
    UserFactory(email="new.person@example.com")
    _gone("/invitations/not-a-real-token/", 404, "Invitation not found", "unknown")
    r = Client().get("/invitations/not-a-real-token/")
    assert "new.person@example.com" not in r.content.decode() and "Alpha" not in r.content.decode()


def test_the_pages_are_rate_limited_per_client(invite, settings):
    settings.TESSERA_INVITATION_PAGE_RATE = 3
    _, _, url = invite()
    c = Client()
    assert [c.get("/invitations/guess-1/").status_code for _ in range(3)] == [404] * 3
    r = c.get(url)
    assert r.status_code == 429 and r["Retry-After"] == "60" and "Alpha" not in r.content.decode()


def test_the_token_stays_out_of_the_request_log(invite, caplog):
    _, token, url = invite()
    with caplog.at_level("INFO", logger="tessera.request"):
        assert Client().get(url).status_code == 200
    paths = [getattr(r, "path", "") for r in caplog.records if r.name == "tessera.request"]
    assert paths == ["/invitations/<token>/"] and token not in caplog.text


def test_a_failed_attempt_does_not_log_the_live_token(invite, caplog):
    _, token, url = invite()
    with caplog.at_level("INFO"):
        assert signup(Client(), url, pw="short").status_code == 400
    assert token not in caplog.text
