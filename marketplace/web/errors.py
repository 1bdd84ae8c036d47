"""Error pages: JSON for the API (the same body as DRF's errors), the site's own page for people."""

from __future__ import annotations

from django.http import JsonResponse
from django.shortcuts import render

PAGES = {
    403: ("You cannot open this page", "Your role does not allow it, or it belongs to another tenant."),
    404: ("Page not found", "The address may be mistyped, or the page belongs to another tenant."),
    500: ("Something went wrong", "The error is logged; try again in a moment."),
}
API_DETAIL = {403: "You do not have permission to perform this action.", 404: "Not found.",
              500: "A server error occurred."}


def _answer(request, status: int):
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": API_DETAIL[status]}, status=status)
    title, text = PAGES[status]
    home = "/console/" if getattr(request.user, "is_operator", False) else "/portal/"
    return render(request, "error.html", {"status": status, "title": title, "text": text, "home": home},
                  status=status)


def not_found(request, exception=None):
    return _answer(request, 404)


def forbidden(request, exception=None):
    return _answer(request, 403)


def server_error(request):
    try:
        return _answer(request, 500)
    except Exception:  # the error page itself must not fail
        from django.http import HttpResponseServerError

        return HttpResponseServerError("<h1>Something went wrong</h1><p><a href='/'>Back to Tessera</a></p>")
