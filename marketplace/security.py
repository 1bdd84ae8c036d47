"""Content-Security-Policy with a per-request script nonce.

Scripts run only from our origin or with the nonce; inline event handlers (onclick=...) are refused,
so templates use static/tessera/app.js (data-confirm, data-autosubmit) instead. Templates that need
an inline script write ``<script nonce="{{ csp_nonce }}">``. The policy is settings.TESSERA_CSP.
"""

from __future__ import annotations

import secrets

from django.conf import settings
from django.utils.functional import SimpleLazyObject

HEADER = "Content-Security-Policy"
REPORT_ONLY_HEADER = "Content-Security-Policy-Report-Only"


def _nonce(request) -> str:
    if not hasattr(request, "_csp_nonce"):
        request._csp_nonce = secrets.token_urlsafe(18)
    return request._csp_nonce


def policy(nonce: str) -> str:
    from tenants.sso import form_action_origins

    extra = {"form-action": " ".join(form_action_origins())}  # the sign-out form ends at the SSO provider
    return "; ".join(f"{name} {value.replace('{nonce}', nonce)} {extra.get(name, '')}".strip()
                     for name, value in settings.TESSERA_CSP.items())


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.csp_nonce = SimpleLazyObject(lambda: _nonce(request))
        response = self.get_response(request)
        header = REPORT_ONLY_HEADER if getattr(settings, "TESSERA_CSP_REPORT_ONLY", False) else HEADER
        if HEADER not in response and REPORT_ONLY_HEADER not in response:
            response[header] = policy(_nonce(request))
        return response


def csp_nonce(request) -> dict:
    """Context processor: ``{{ csp_nonce }}`` for the rare inline script."""
    nonce = getattr(request, "csp_nonce", None)
    return {"csp_nonce": nonce if nonce is not None else ""}
