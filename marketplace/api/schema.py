"""OpenAPI: the error answers of every operation, documented from the view itself.

drf-spectacular documents only the success answer. ``AutoSchema`` (DEFAULT_SCHEMA_CLASS) adds the
errors the API really gives (``marketplace.api.errors.exception_handler`` and DRF's defaults), so an
endpoint added later is documented without further work. Per operation:

- 400 ``ValidationError``: the operation takes input (body, query parameters, a string path parameter:
  PostgreSQL cannot store a NUL byte, which is a 400) or changes state (services refuse with field errors);
- 401 ``Error`` + ``WWW-Authenticate``: the view authenticates and its first authenticator names a
  scheme (otherwise DRF answers an unauthenticated request with 403);
- 403 ``Error`` or ``ValidationError`` (a service's ``Forbidden`` names the field): the view checks
  permissions, or the method is unsafe (a session request's CSRF check);
- 404 ``Error``: the path has parameters (a foreign or missing object), or the list is paginated
  (a ``page`` past the end; also for a view that paginates by hand and documents ``page``);
- 406 ``Error``: the ``Accept`` header names nothing the operation renders (DRF content negotiation);
- 409 ``ValidationError``: unsafe methods (services raise ``Conflict`` naming the conflicting field);
- 415 ``Error``: the operation takes a body (DRF parsers);
- 429 ``Error`` + ``Retry-After``: the view is throttled;
- 503 ``Error`` + ``Retry-After``: always (the database went away; nothing was stored).

Error bodies are JSON whatever the operation's success media type (a CSV export's errors too).

A status the view documents itself (``@extend_schema(responses={404: ...})``) is kept as it is: a view
that raises an error these rules cannot see (e.g. a 404 for a tenant named in the body) declares it.
"""

from __future__ import annotations

import uritemplate
from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import OpenApiResponse
from rest_framework import permissions

ERROR = "Error"
VALIDATION_ERROR = "ValidationError"
UNSAFE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def _ref(kind: str, name: str) -> dict:
    return {"$ref": f"#/components/{kind}/{name}"}


_FIELD_MESSAGES = {
    "anyOf": [
        {"type": "array", "items": {"anyOf": [{"type": "string"}, _ref("schemas", VALIDATION_ERROR)]}},
        _ref("schemas", VALIDATION_ERROR),
    ]
}

SCHEMAS = {
    ERROR: {
        "type": "object",
        "description": "An error that concerns the request as a whole.",
        "properties": {"detail": {"type": "string", "description": "what went wrong, for people"}},
        "required": ["detail"],
    },
    VALIDATION_ERROR: {
        "type": "object",
        "description": (
            "Field errors: each key names an input field (`non_field_errors`: the input as a whole) and holds "
            "its messages; a nested object or list holds the errors of nested input, by key or by index. "
            "A request-wide problem (a malformed body, a value the database cannot store) is given in `detail`."
        ),
        "properties": {
            "detail": {"type": "string"},
            "non_field_errors": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": _FIELD_MESSAGES,
    },
}

_RETRY_AFTER = {"schema": {"type": "integer"}, "description": "seconds to wait before retrying"}

# name, status, description, body schema, headers
RESPONSES = {
    "400": ("BadRequest", "The input is invalid; nothing was stored.", _ref("schemas", VALIDATION_ERROR), None),
    "401": ("Unauthorized", "No credentials, or an unknown, revoked or expired API key.", _ref("schemas", ERROR),
            {"WWW-Authenticate": {"schema": {"type": "string"}, "required": True,
                                  "description": 'the scheme to authenticate with, e.g. `Bearer realm="api"`'}}),
    "403": ("Forbidden", "Authenticated, but the role, the API key's scopes or the tenant's state do not allow "
            "this (a service's refusal names the field).",
            {"anyOf": [_ref("schemas", ERROR), _ref("schemas", VALIDATION_ERROR)]}, None),
    "404": ("NotFound", "No such object, or one the caller may not see (another tenant's objects are absent), "
            "or a page past the end.", _ref("schemas", ERROR), None),
    "406": ("NotAcceptable", "The Accept header names no media type this operation can produce.",
            _ref("schemas", ERROR), None),
    "409": ("Conflict", "The request conflicts with the current state (a duplicate, an illegal state "
            "transition, a finalized invoice); nothing was changed.", _ref("schemas", VALIDATION_ERROR), None),
    "415": ("UnsupportedMediaType", "The body's Content-Type is not one this operation accepts.",
            _ref("schemas", ERROR), None),
    "429": ("TooManyRequests", "Over the rate limit of this API key, user or client address.",
            _ref("schemas", ERROR), {"Retry-After": {**_RETRY_AFTER, "required": False}}),
    "503": ("ServiceUnavailable", "The database is unavailable; nothing was stored. Retry later.",
            _ref("schemas", ERROR), {"Retry-After": {**_RETRY_AFTER, "required": True}}),
}

JSON_MEDIA_TYPES = ("application/json",)


class _Identity:
    """The registry's identity for the components defined here."""


def _response(status: str, media_types: list[str]) -> dict:
    _name, description, schema, headers = RESPONSES[status]
    content = {m: {"schema": schema if _is_json(m) else {"type": "string"}} for m in media_types}
    return {"description": description, **({"headers": headers} if headers else {}), "content": content}


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or media_type.endswith("+json")


def error_response(status: int | str, description: str | None = None) -> OpenApiResponse:
    """An error answer for ``@extend_schema(responses={...})``, for a view that gives one these rules
    cannot see, with the same body schema as the generic one."""
    _name, default_description, schema, _headers = RESPONSES[str(status)]
    return OpenApiResponse(response=schema, description=description or default_description)


def register_components(registry) -> None:
    for name, schema in SCHEMAS.items():
        registry.register_on_missing(ResolvedComponent(name, ResolvedComponent.SCHEMA, schema, _Identity))
    for status in RESPONSES:
        registry.register_on_missing(ResolvedComponent(
            RESPONSES[status][0], ResolvedComponent.RESPONSE, _response(status, list(JSON_MEDIA_TYPES)), _Identity))


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's AutoSchema plus the error answers of each operation (see the module docstring)."""

    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        register_components(registry)
        responses = operation["responses"]
        for status in self.error_statuses(operation):
            if status in responses:  # the view documented it itself
                continue
            # Errors are JSON whatever the operation renders on success (e.g. an invoice's CSV export).
            responses[status] = _ref("responses", RESPONSES[status][0])
        operation["responses"] = dict(sorted(responses.items()))
        return operation

    def error_statuses(self, operation: dict) -> list[str]:
        view, method = self.view, self.method
        params = operation.get("parameters", [])
        takes_body = "requestBody" in operation
        string_path_param = any(p.get("in") == "path" and p.get("schema", {}).get("type") == "string"
                                for p in params)
        takes_query = any(p.get("in") == "query" for p in params)
        unsafe = method in UNSAFE_METHODS
        authenticators = view.get_authenticators()
        perms = [type(p) for p in view.get_permissions()]
        open_to_all = bool(perms) and all(p is permissions.AllowAny for p in perms)

        out = []
        if takes_body or takes_query or string_path_param or unsafe:
            out.append("400")
        if authenticators and self._authenticate_header(authenticators[0]):
            out.append("401")
        if (perms and not open_to_all) or unsafe:
            out.append("403")
        paginated = (self._is_list_view() and self._get_paginator() is not None) or any(
            p.get("in") == "query" and p.get("name") == "page" for p in params)
        if uritemplate.variables(self.path) or paginated:
            out.append("404")
        out.append("406")
        if unsafe:
            out.append("409")
        if takes_body:
            out.append("415")
        if view.get_throttles():
            out.append("429")
        out.append("503")
        return out

    def _authenticate_header(self, authenticator) -> str | None:
        try:
            return authenticator.authenticate_header(getattr(self.view, "request", None))
        except Exception:  # an authenticator that needs a real request: assume a header
            return "unknown"
