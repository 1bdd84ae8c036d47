"""Request logging: one structured line per request with status, duration and principal."""

from __future__ import annotations

import logging
import re
import time

log = logging.getLogger("tessera.request")
# Secrets in paths stay out of the logs: an invitation link's token would let a log reader join.
SECRET_PATH = re.compile(r"^/invitations/[^/]+/")


class RequestLogMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        user = getattr(request, "user", None)
        log.info(
            "request",
            extra={
                "method": request.method,
                "path": SECRET_PATH.sub("/invitations/<token>/", request.path),
                "status": response.status_code,
                "ms": round((time.perf_counter() - started) * 1000, 1),
                "user_id": getattr(user, "pk", None),
                "api_key": getattr(getattr(request, "auth", None), "prefix", None),
            },
        )
        return response


class DatabaseErrorMiddleware:
    """Pages (the API has its own handler): input the database cannot store is a 400, and a lost
    database connection a 503 — clean answers, the transaction already rolled back."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exc):
        from django.db import DataError, InterfaceError, OperationalError
        from django.http import HttpResponse

        if isinstance(exc, DataError):
            return HttpResponse("Bad request: the input contains values that cannot be stored.", status=400,
                                content_type="text/plain")
        if isinstance(exc, OperationalError | InterfaceError):
            log.error("database unavailable", extra={"path": request.path})
            resp = HttpResponse("The database is unavailable; nothing was stored. Try again shortly.", status=503,
                                content_type="text/plain")
            resp["Retry-After"] = "5"
            return resp
        return None
