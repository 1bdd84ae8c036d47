"""Request logging: one structured line per request with status, duration and principal."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("tessera.request")


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
                "path": request.path,
                "status": response.status_code,
                "ms": round((time.perf_counter() - started) * 1000, 1),
                "user_id": getattr(user, "pk", None),
                "api_key": getattr(getattr(request, "auth", None), "prefix", None),
            },
        )
        return response
