"""The invitation link from the e-mail (/invitations/<token>/): the invitee sees the tenant, who invited
them and the role, then joins in one step: a new person sets a name and password, someone with an
account enters their password, someone already signed in as the invited e-mail clicks Join. Every path
accepts through ``tenants.services.accept_invitation``, the rule the API uses. Used, revoked and
expired links answer 410 with a page that says so; an unknown token is a 404 that tells nothing."""

from __future__ import annotations

import time
from functools import wraps

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import authenticate, login
from django.core.cache import cache
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from tenants import lockout, selectors, services
from tenants.errors import ServiceError
from tenants.models import Invitation
from tenants.throttling import client_ip

GONE = {
    "accepted": ("This invitation has already been used",
                 "Each invitation link works once. If you joined with it, sign in to reach the tenant."),
    "revoked": ("This invitation was withdrawn",
                "The tenant's administrator revoked it. Ask them for a new invitation if you still need access."),
    "expired": ("This invitation has expired",
                "Invitations are valid for a limited time. Ask the person who invited you to send a new one."),
}
UNKNOWN = ("Invitation not found",
           "The link is incomplete or not valid. Open it again from the e-mail, or ask for a new invitation.")


def _over_rate(request) -> bool:
    """At most TESSERA_INVITATION_PAGE_RATE requests a minute per client address (0: no limit)."""
    rate = settings.TESSERA_INVITATION_PAGE_RATE
    if rate <= 0:
        return False
    key = f"tessera:invitation-page:{client_ip(request)}:{int(time.time() // 60)}"
    cache.add(key, 0, 120)
    try:
        count = cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.set(key, 1, 120)
        count = 1
    return count > rate


def _portal(invitation: Invitation) -> str:
    return f"{reverse('portal:home')}?tenant={invitation.tenant.slug}"


def _gone(request, invitation: Invitation | None):
    if invitation is None:
        title, text, status, reason = *UNKNOWN, 404, "unknown"
    else:
        title, text = GONE[invitation.status]
        status, reason = 410, invitation.status
        if reason == "expired":  # what the invitee saw while it was valid: whom to ask for a new one
            text = (f"Invitations are valid for a limited time. Ask {_inviter(invitation)} to invite you "
                    f"to {invitation.tenant.name} again.")
    return render(request, "invitations/gone.html", {"title": title, "text": text, "reason": reason,
                                                     "status": status}, status=status)


def _inviter(invitation: Invitation) -> str:
    user = invitation.invited_by
    if user is None:
        return "the tenant's administrator"
    return f"{user.full_name} ({user.email})" if user.full_name else user.email


def _unlogged(view):
    """Django logs 4xx answers with their path ("Bad Request: /invitations/<token>/"); a live token must
    not reach the logs, so these answers are marked as logged (the request log masks the token)."""
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        response = view(request, *args, **kwargs)
        if response.status_code >= 400:
            response._has_been_logged = True
        return response
    return wrapper


@never_cache
@require_http_methods(["GET", "POST"])
@_unlogged
def invitation(request, token: str):
    if _over_rate(request):
        response = render(request, "invitations/gone.html", {
            "title": "Too many attempts", "reason": "throttled", "status": 429,
            "text": "Too many requests from your network. Wait a minute, then open the link again."}, status=429)
        response["Retry-After"] = "60"
        return response
    inv = selectors.invitation_by_token(token)
    if inv is None:
        return _gone(request, None)
    user = request.user if request.user.is_authenticated else None
    if inv.status != "pending":
        if inv.status == "accepted" and user is not None and inv.accepted_by_id == user.pk:
            return redirect(_portal(inv))  # a second click (or submit) of someone who already joined
        return _gone(request, inv)

    if user is not None:
        mode = "join" if user.email.lower() == inv.email.lower() else "other"
    else:
        mode = "signin" if selectors.has_account(inv.email) else "signup"
    errors: dict[str, str] = {}
    full_name = ""
    if request.method == "POST":
        action = request.POST.get("action", "")
        full_name = request.POST.get("full_name", "").strip()
        if action != mode:  # the page was out of date (signed in or out, or an account made meanwhile)
            errors["page"] = "This page was out of date; check the details below and try again."
        else:
            try:
                joined = _accept(request, mode, inv, token, full_name, errors)
            except ServiceError as exc:
                fresh = selectors.invitation_by_token(token)
                if fresh is None or fresh.status != "pending":
                    return _gone(request, fresh)  # used, revoked or expired meanwhile (a double submit)
                errors[exc.field if exc.field in ("password", "full_name") else "page"] = exc.message
            else:
                if joined is not None:
                    login(request, joined, backend=getattr(joined, "backend", settings.AUTHENTICATION_BACKENDS[0]))
                    messages.success(request, f"Welcome to {inv.tenant.name}. You joined as "
                                              f"{inv.get_role_display().lower()}.")
                    return redirect(_portal(inv))
    return render(request, "invitations/accept.html", {
        "inv": inv, "tenant": inv.tenant, "inviter": _inviter(inv), "role": inv.get_role_display(),
        "mode": mode, "errors": errors, "full_name": full_name,
        "path": request.path,
    }, status=400 if errors else 200)


def _accept(request, mode: str, inv: Invitation, token: str, full_name: str, errors: dict):
    """Join in the way `mode` says; the user who joined, or None with `errors` filled in."""
    password = request.POST.get("password", "")
    if mode == "join":
        services.accept_invitation(request.user, token)
        return request.user
    if mode == "signup":
        if not full_name:
            errors["full_name"] = "Enter your name."
        if password != request.POST.get("password2", ""):
            errors["password2"] = "The two passwords differ."
        if errors:
            return None
        return services.sign_up_and_accept(token, full_name=full_name, password=password).user
    if mode == "signin":
        user = authenticate(request, username=inv.email, password=password)  # counts failures, may lock
        if user is None:
            locked = lockout.is_locked(inv.email, client_ip(request))
            errors["password"] = (lockout.LOCKED_MESSAGE % {"minutes": settings.TESSERA_LOGIN_LOCKOUT_MINUTES}
                                  if locked else "That password is not right.")
            return None
        services.accept_invitation(user, token)
        return user
    errors["page"] = "Sign out first, then open the link again."  # mode "other"
    return None
