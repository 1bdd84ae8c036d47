"""An invitation as a person meets it, in a real browser: the owner invites from the Members page, the
invitee opens the link from the e-mail, sets a name and password and lands in the tenant's portal;
the same link opened again is a clear "already used" page. Screenshots of each step."""

from __future__ import annotations

import re

import pytest
from django.core import mail
from playwright.sync_api import expect

from tenants.models import Membership
from tenants.roles import Role
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
