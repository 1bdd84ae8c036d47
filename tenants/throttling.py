"""API rate limits, counted in the Django cache (Redis in production, so all web workers share them).

One bucket per API key (by its prefix), else per signed-in user, else per client IP. Usage ingest
(POST /api/v1/usage/events/) has its own scope, so a busy reporter does not starve reads and vice
versa. Rates are read from settings at request time (TESSERA_API_RATE, TESSERA_USAGE_INGEST_RATE,
TESSERA_ANON_RATE; "<n>/<sec|min|hour|day>", empty = unlimited). Exceeding a rate gives 429 with
Retry-After.
"""

from __future__ import annotations

from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle

from .models import ApiKey

USAGE_INGEST_PATH_SUFFIX = "/usage/events/"


def client_ip(request) -> str:
    """The client's address; the first X-Forwarded-For hop only when the proxy is trusted."""
    meta = getattr(request, "META", {})
    if getattr(settings, "TESSERA_TRUST_X_FORWARDED_FOR", False):
        forwarded = meta.get("HTTP_X_FORWARDED_FOR", "")
        if forwarded:
            return forwarded.split(",")[0].strip()
    return meta.get("REMOTE_ADDR", "") or "unknown"


class ApiKeyRateThrottle(SimpleRateThrottle):
    cache_format = "tessera:throttle:%(scope)s:%(ident)s"

    def __init__(self):  # the scope (and so the rate) is chosen per request
        self.scope = None
        self.rate = None

    @staticmethod
    def scope_for(request, view) -> str:
        auth = getattr(request, "auth", None)
        user = getattr(request, "user", None)
        if request.method == "POST" and request.path.endswith(USAGE_INGEST_PATH_SUFFIX):
            return "usage_ingest"
        if isinstance(auth, ApiKey) or (user is not None and user.is_authenticated):
            return "api"
        return "anon"

    def get_rate(self):
        name = {"api": "TESSERA_API_RATE", "usage_ingest": "TESSERA_USAGE_INGEST_RATE",
                "anon": "TESSERA_ANON_RATE"}[self.scope]
        return getattr(settings, name, None) or None

    def get_cache_key(self, request, view):
        auth = getattr(request, "auth", None)
        user = getattr(request, "user", None)
        if isinstance(auth, ApiKey):
            ident = f"key:{auth.prefix}"
        elif user is not None and user.is_authenticated and getattr(user, "pk", None) is not None:
            ident = f"user:{user.pk}"
        else:
            ident = f"ip:{client_ip(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def allow_request(self, request, view):
        self.scope = self.scope_for(request, view)
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)
