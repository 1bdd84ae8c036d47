"""Single sign-on with OpenID Connect (mozilla-django-oidc) for the console and the portal.

On when ``TESSERA_OIDC_CLIENT_ID`` is set (README: "Single sign-on"); local passwords stay either way. Who a
person the identity provider signed in is, in Tessera — the one rule, ``sign_in``:

- the provider's ``email`` claim names the account (an existing one, else one is made without a password); a
  provider that says the address is not verified (``email_verified: false``) is refused;
- **operators** by group claim: a member of ``TESSERA_OIDC_OPERATOR_GROUP`` (in the ``TESSERA_OIDC_GROUPS_CLAIM``
  claim, default ``groups``) is put in the "SSO operators" group (staff, holding ``tenants.operate``) at each
  sign-in, and taken out of it at the first sign-in after the provider dropped them (an operator made locally —
  a superuser, a permission of their own — stays one);
- **tenant users** by invitation (every pending, unexpired invitation to the address is accepted, with its role)
  or by e-mail domain (the tenant whose ``sso_email_domain`` is the address's joins it as a member);
- nobody else: a new address that is neither an operator nor admitted by a tenant is refused, and so is a
  disabled account (``is_active`` false), with a message on the sign-in page.

Every sign-in and every change it makes is audited. Logout ends Tessera's session and, when the provider has an
end-session endpoint, the provider's too (RP-initiated logout with the ID token as hint).
"""

from __future__ import annotations

import logging
from urllib.parse import urlencode, urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.models import Group, Permission
from django.db import transaction
from django.http import Http404, HttpRequest
from django.utils import timezone
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from . import audit
from .models import Invitation, Membership, Tenant, User
from .roles import Role
from .scoping import Principal
from .services import join_by_invitation

log = logging.getLogger("tessera.sso")

OPERATOR_GROUP = "SSO operators"
SESSION_FLAG = "tessera_sso"


class Refused(Exception):
    """Why a signed-in person may not enter (shown on the sign-in page)."""


def enabled() -> bool:
    return bool(getattr(settings, "OIDC_RP_CLIENT_ID", ""))


def _operator_group() -> Group:
    group, created = Group.objects.get_or_create(name=OPERATOR_GROUP)
    if created:
        group.permissions.add(Permission.objects.get(content_type__app_label="tenants", codename="operate"))
    return group


@transaction.atomic
def sign_in(claims: dict) -> User:
    """The account of the person the provider vouches for, its operator standing and tenants brought up to date
    from `claims` (the userinfo claims); Refused if they may not enter."""
    email = str(claims.get("email") or "").strip().lower()
    if "@" not in email:
        raise Refused("The identity provider did not give an e-mail address.")
    if claims.get("email_verified") is False:
        raise Refused(f"The identity provider has not verified {email}.")
    groups = claims.get(settings.TESSERA_OIDC_GROUPS_CLAIM) or []
    operator = bool(settings.TESSERA_OIDC_OPERATOR_GROUP) and settings.TESSERA_OIDC_OPERATOR_GROUP in (
        groups if isinstance(groups, list) else [groups])
    user = User.objects.select_for_update().filter(email__iexact=email).first()
    if user is not None and not user.is_active:
        raise Refused(f"The account {email} is disabled; ask your provider's operators.")
    now = timezone.now()
    invitations = list(Invitation.objects.select_for_update().filter(
        email__iexact=email, accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=now))
    domain = Tenant.objects.filter(sso_email_domain=email.rsplit("@", 1)[1]).first()
    created = user is None
    if user is None:
        if not (operator or invitations or domain):
            raise Refused(f"No tenant admits {email} yet: ask its owner for an invitation.")
        user = User.objects.create_user(email=email, full_name=str(claims.get("name") or "")[:200])
        user.set_unusable_password()
        user.save(update_fields=["password"])
    who = Principal(user=user)
    changes = _sync_operator(user, operator)
    for inv in invitations:
        join_by_invitation(inv, user, via="sso")
    if domain is not None:
        _, joined = Membership.objects.get_or_create(user=user, tenant=domain, defaults={"role": Role.MEMBER})
        if joined:
            audit.record(who, "membership.join", f"user:{email}", domain, role=Role.MEMBER, via="sso domain")
    audit.record(who, "user.sso_login", f"user:{email}", None, created=created, operator=user.is_operator,
                 **changes)
    log.info("sso sign-in", extra={"user": user.pk, "new_account": created, "operator": operator})
    return user


def _sync_operator(user: User, operator: bool) -> dict:
    group = _operator_group()
    member = user.groups.filter(pk=group.pk).exists()
    if operator and not member:
        user.groups.add(group)
        if not user.is_staff:
            user.is_staff = True
            user.save(update_fields=["is_staff"])
        return {"operator_granted": True}
    if not operator and member:
        user.groups.remove(group)
        holds_own = user.is_superuser or user.user_permissions.filter(codename="operate").exists()
        if not holds_own and user.is_staff:
            user.is_staff = False
            user.save(update_fields=["is_staff"])
        return {"operator_revoked": True}
    return {}


class Backend(OIDCAuthenticationBackend):
    """mozilla-django-oidc's backend with Tessera's rule (`sign_in`); inert while SSO is off (it sits in
    AUTHENTICATION_BACKENDS beside the password backend)."""

    def __init__(self, *args, **kwargs):
        if enabled():
            super().__init__(*args, **kwargs)

    def authenticate(self, request, **kwargs):
        if not enabled() or request is None:
            return None
        return super().authenticate(request, **kwargs)

    def get_or_create_user(self, access_token, id_token, payload):
        claims = self.get_userinfo(access_token, id_token, payload)
        try:
            user = sign_in(claims)
        except Refused as why:
            log.warning("sso sign-in refused", extra={"reason": str(why)})
            messages.error(self.request, str(why))
            return None
        self.request.session[SESSION_FLAG] = True
        return user


def start(request: HttpRequest):
    """/oidc/authenticate/: off while SSO is off (a 404, not a configuration error)."""
    if not enabled():
        raise Http404("single sign-on is not configured")
    return OIDCAuthenticationRequestView.as_view()(request)


def callback(request: HttpRequest):
    if not enabled():
        raise Http404("single sign-on is not configured")
    return OIDCAuthenticationCallbackView.as_view()(request)


def form_action_origins() -> list[str]:
    """Origins a form may lead to besides Tessera's own (CSP form-action): the provider's, whose end-session
    endpoint the sign-out form is redirected to (browsers hold a form's redirects to form-action too)."""
    endpoint = settings.TESSERA_OIDC_END_SESSION_ENDPOINT
    if not (enabled() and endpoint):
        return []
    parts = urlsplit(endpoint)
    return [f"{parts.scheme}://{parts.netloc}"]


def provider_logout_url(request: HttpRequest) -> str | None:
    """Where to send a browser after Tessera's own logout of an SSO session: the provider's end-session endpoint
    with the ID token as hint and the sign-in page to come back to (None: not an SSO session, or no endpoint).
    Read before the session is flushed."""
    endpoint = settings.TESSERA_OIDC_END_SESSION_ENDPOINT
    if not (enabled() and endpoint and request.session.get(SESSION_FLAG)):
        return None
    back = request.build_absolute_uri(settings.LOGOUT_REDIRECT_URL)
    query = {"post_logout_redirect_uri": back, "client_id": settings.OIDC_RP_CLIENT_ID}
    hint = request.session.get("oidc_id_token")
    if hint:
        query["id_token_hint"] = hint
    return f"{endpoint}?{urlencode(query)}"
