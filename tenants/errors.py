"""Errors raised by services; the API maps them to 400 (field errors), 403 and 409."""

from __future__ import annotations


class ServiceError(Exception):
    """A request that cannot be carried out. `field` names the offending input when there is one."""

    status_code = 400

    def __init__(self, message: str, field: str | None = None, code: str = "invalid"):
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code

    def as_dict(self) -> dict:
        key = self.field or "non_field_errors"
        return {key: [self.message]}


class Forbidden(ServiceError):
    status_code = 403


class Conflict(ServiceError):
    status_code = 409
