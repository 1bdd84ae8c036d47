"""Errors raised by services; the API maps them to 400 (field errors), 403 and 409."""

from __future__ import annotations


class ServiceError(Exception):
    """A request that cannot be carried out. `field` names the offending input when there is one.

    `message` is what any caller may be shown, tenants included. `diagnostic` (optional) is the
    operators' fuller account, which may name fleet internals (GPU and node ids, fleet figures,
    other tenants): only operator-facing surfaces (console, an operator's API call) show it."""

    status_code = 400

    def __init__(self, message: str, field: str | None = None, code: str = "invalid", diagnostic: str = ""):
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code
        self.diagnostic = diagnostic

    def text_for(self, operator: bool) -> str:
        return (self.diagnostic or self.message) if operator else self.message

    def as_dict(self, operator: bool = False) -> dict:
        key = self.field or "non_field_errors"
        return {key: [self.text_for(operator)]}


class Forbidden(ServiceError):
    status_code = 403


class Conflict(ServiceError):
    status_code = 409
