"""Login lockout: after TESSERA_LOGIN_MAX_FAILURES failed logins for one (e-mail, client IP), that
pair is locked for TESSERA_LOGIN_LOCKOUT_MINUTES; while locked even the right password is refused.

Counters live in the Django cache (Redis in production, shared by every web worker). The check is in
the authentication backend, so every form that calls ``authenticate(request, ...)`` is covered (the
web /login/ and the admin login); the forms below turn a lockout into a clear message.
"""

from __future__ import annotations

import hashlib
import logging
import time

from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache
from django.core.exceptions import PermissionDenied

from .throttling import client_ip

log = logging.getLogger("tessera.auth")

LOCKED_MESSAGE = ("Too many failed sign-in attempts. This account is locked on this network for "
                  "%(minutes)d minutes; try again later or reset your password.")


def _max_failures() -> int:
    return int(getattr(settings, "TESSERA_LOGIN_MAX_FAILURES", 5))


def _lock_seconds() -> int:
    return int(getattr(settings, "TESSERA_LOGIN_LOCKOUT_MINUTES", 15)) * 60


def _ident(email: str | None, ip: str) -> str:
    raw = f"{(email or '').strip().lower()}|{ip}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _keys(email, ip) -> tuple[str, str]:
    ident = _ident(email, ip)
    return f"tessera:login:fail:{ident}", f"tessera:login:lock:{ident}"


def locked_until(email, ip) -> float | None:
    """Epoch seconds until which (email, ip) is locked, or None."""
    until = cache.get(_keys(email, ip)[1])
    if until is None or until <= time.time():
        return None
    return until


def is_locked(email, ip) -> bool:
    return locked_until(email, ip) is not None


def register_failure(email, ip) -> int:
    """Count one failed attempt; lock the pair once the count reaches the maximum. Returns the count."""
    fail_key, lock_key = _keys(email, ip)
    seconds = _lock_seconds()
    cache.add(fail_key, 0, seconds)
    try:
        count = cache.incr(fail_key)
    except ValueError:  # expired between add and incr
        cache.set(fail_key, 1, seconds)
        count = 1
    if count >= _max_failures():
        cache.set(lock_key, time.time() + seconds, seconds)
        cache.delete(fail_key)
        log.warning("login locked", extra={"ip": ip, "failures": count})
    return count


def reset(email, ip) -> None:
    cache.delete_many(list(_keys(email, ip)))


class LockoutModelBackend(ModelBackend):
    """ModelBackend that refuses a locked (e-mail, IP) before checking the password, and counts failures."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:  # not a web login (shell, management commands): no lockout
            return super().authenticate(request, username=username, password=password, **kwargs)
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        ip = client_ip(request)
        if is_locked(username, ip):
            log.warning("login refused: locked", extra={"ip": ip})
            raise PermissionDenied("locked")  # stops authenticate(): no other backend is tried
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            register_failure(username, ip)
        else:
            reset(username, ip)
        return user


class LockoutFormMixin:
    def _locked_error(self) -> forms.ValidationError:
        return forms.ValidationError(LOCKED_MESSAGE, code="locked",
                                     params={"minutes": _lock_seconds() // 60})

    def clean(self):
        username = self.cleaned_data.get("username")
        ip = client_ip(self.request) if self.request is not None else None
        if ip is not None and username and is_locked(username, ip):
            raise self._locked_error()
        try:
            return super().clean()
        except forms.ValidationError:
            if ip is not None and username and is_locked(username, ip):
                raise self._locked_error() from None
            raise


class LockoutAuthenticationForm(LockoutFormMixin, AuthenticationForm):
    pass


class LockoutAdminAuthenticationForm(LockoutFormMixin, AdminAuthenticationForm):
    pass
