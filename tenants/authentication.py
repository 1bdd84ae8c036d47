"""DRF authentication with ``Authorization: Bearer <api key>``."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from rest_framework import authentication, exceptions

from . import keys
from .models import ApiKey

log = logging.getLogger("tessera.auth")


class ApiKeyUser:
    """What ``request.user`` is for a request authenticated by an API key."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False
    is_operator = False

    def __init__(self, key: ApiKey):
        self.key = key
        self.pk = None
        self.id = None

    def __str__(self) -> str:
        return f"api-key:{self.key.prefix}"

    def has_perm(self, perm, obj=None) -> bool:
        return False


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        parts = header.split()
        if parts[0].lower() != self.keyword.lower():
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <key>'.")
        key = authenticate_key(parts[1])
        return ApiKeyUser(key), key

    def authenticate_header(self, request):
        return f'{self.keyword} realm="api"'


def authenticate_key(raw: str) -> ApiKey:
    prefix = keys.parse_prefix(raw)
    key = None
    if prefix:
        key = ApiKey.objects.select_related("tenant", "created_by").filter(prefix=prefix).first()
    if key is None or not keys.matches(raw, key.hashed_key):
        log.warning("api key rejected", extra={"reason": "unknown", "prefix": prefix})
        raise exceptions.AuthenticationFailed("Invalid API key.")
    if key.revoked_at is not None:
        log.warning("api key rejected", extra={"reason": "revoked", "prefix": prefix})
        raise exceptions.AuthenticationFailed("API key revoked.")
    now = timezone.now()
    if key.expires_at is not None and key.expires_at <= now:
        log.warning("api key rejected", extra={"reason": "expired", "prefix": prefix})
        raise exceptions.AuthenticationFailed("API key expired.")
    resolution = timedelta(seconds=settings.TESSERA_API_KEY_LAST_USED_RESOLUTION_S)
    if key.last_used_at is None or now - key.last_used_at >= resolution:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key
