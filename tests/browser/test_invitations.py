"""An invitation as a person meets it, in a real browser: the owner invites from the Members page, the
invitee opens the link from the e-mail, sets a name and password and lands in the tenant's portal;
the same link opened again is a clear "already used" page. Screenshots of each step."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone
from playwright.sync_api import expect

from tenants import services
from tenants.models import Invitation, Membership
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_invitee_follows_the_emailed_link_sets_a_password_and_lands_in_the_portal(
        browser, page, shot, login, live_server):
    alpha = TenantFactory(slug="alpha", name="Alpha Labs")
    MembershipFactory(tenant=alpha, role=Role.OWNER,
                      user=UserFactory(email="owner@alpha.example", full_name="Olive Owner"))
    mail.outbox.clear()

    login(page, "owner@alpha.example")
    page.goto(f"{live_server.url}/portal/members/")
    page.fill("#invite-form input[name=email]", "Dana@Example.com")
    page.select_option("#invite-form select[name=role]", "admin")
    page.click("#invite-form button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert "Invitation sent to dana@example.com" in page.inner_text("main")

    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["dana@example.com"]
    link = re.search(r"https?://\S+/invitations/[\w-]+/", mail.outbox[0].body).group(0)
    assert link.startswith(live_server.url)  # absolute, on the address the owner used

    phone = browser.new_context(viewport={"width": 390, "height": 844})  # e-mail is often read on a phone
    try:
        pp = phone.new_page()
        pp.goto(link)
        expect(pp.locator("#signup-form")).to_be_visible()
        assert pp.evaluate("document.documentElement.scrollWidth") <= 390
        shot(pp, "invitation-signup-phone")
    finally:
        phone.close()

    ctx = browser.new_context(viewport={"width": 1366, "height": 900})
    invitee = ctx.new_page()
    invitee.set_default_timeout(15_000)
    try:
        invitee.goto(link)
        expect(invitee.locator("h1")).to_have_text("Join Alpha Labs")
        assert "Olive Owner" in invitee.inner_text("#inv-inviter")
        assert invitee.inner_text("#inv-role").strip() == "Admin"
        shot(invitee, "invitation-signup")

        invitee.fill("#id_full_name", "Dana Diaz")
        invitee.fill("#id_password", "short")
        invitee.fill("#id_password2", "short")
        invitee.click("#signup-form button[type=submit]")
        expect(invitee.locator("#password-error")).to_contain_text("too short")
        shot(invitee, "invitation-bad-password")

        invitee.fill("#id_password", "plum-Harbor-47-lantern")
        invitee.fill("#id_password2", "plum-Harbor-47-lantern")
        invitee.click("#signup-form button[type=submit]")
        invitee.wait_for_url(re.compile(r"/portal/\?tenant=alpha$"))
        invitee.wait_for_load_state("networkidle")
        assert "Welcome to Alpha Labs" in invitee.inner_text("main")
        assert "dana@example.com" in invitee.inner_text("header")
        shot(invitee, "invitation-joined-portal")
        assert Membership.objects.get(user__email="dana@example.com", tenant=alpha).role == Role.ADMIN

        # the link again, signed out: it has been used
        invitee.click("header form.who button[type=submit]")
        invitee.wait_for_url(re.compile(r"/login/"))
        response = invitee.goto(link)
        assert response.status == 410
        expect(invitee.locator("h1")).to_have_text("This invitation has already been used")
        shot(invitee, "invitation-used")
    finally:
        ctx.close()


def test_existing_account_wrong_user_and_expired_links(browser, page, shot, login, live_server):
    """The other ways a link is met: an account that signs in to join, someone signed in as another
    person (told so, and signed out back to the link), and a link past its date."""
    alpha = TenantFactory(slug="alpha", name="Alpha Labs")
    owner = MembershipFactory(tenant=alpha, role=Role.OWNER, user=UserFactory(email="owner@alpha.example")).user
    erin = UserFactory(email="erin@example.com")
    p = principal_for_user(owner)
    _, token = services.invite(p, tenant=alpha, email="erin@example.com", role=Role.VIEWER, send=False)
    old, old_token = services.invite(p, tenant=alpha, email="old@example.com", send=False)
    Invitation.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(hours=1))
    link = f"{live_server.url}/invitations/{token}/"

    login(page, "owner@alpha.example")  # signed in as someone else
    page.goto(link)
    expect(page.locator("#inv-wrong-user")).to_contain_text("erin@example.com")
    shot(page, "invitation-wrong-user")
    page.click("#invitation button[type=submit]")  # sign out and continue
    page.wait_for_url(link)
    expect(page.locator("#signin-form")).to_be_visible()
    page.fill("#id_password", "wrong-password")
    page.click("#signin-form button[type=submit]")
    expect(page.locator("#password-error")).to_have_text("That password is not right.")
    shot(page, "invitation-signin")
    page.fill("#id_password", "pw-Secret-123")
    page.click("#signin-form button[type=submit]")
    page.wait_for_url(re.compile(r"/portal/\?tenant=alpha$"))
    assert Membership.objects.get(user=erin, tenant=alpha).role == Role.VIEWER

    response = page.goto(f"{live_server.url}/invitations/{old_token}/")
    assert response.status == 410
    expect(page.locator("h1")).to_have_text("This invitation has expired")
    shot(page, "invitation-expired")
