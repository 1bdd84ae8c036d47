"""API errors: service errors and model validation errors become field errors (400/403/409).

Every error body is an object (documented in marketplace/api/schema.py): {"detail": "..."} or field errors
{field: [messages]}. A DRF ValidationError raised with a bare message or list (e.g. DRF's own "Null characters
are not allowed." for ?search=) would be a JSON list; it is given under "non_field_errors" instead."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, InterfaceError, OperationalError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import exception_handler as drf_exception_handler

from marketplace.api.disclosure import reader_is_operator
from marketplace.services.dbretry import is_conflict
from tenants.errors import ServiceError


def exception_handler(exc, context):
    if isinstance(exc, ServiceError):
        if exc.diagnostic and reader_is_operator(context):  # operators get the diagnostic
            return Response(exc.as_dict(operator=True), status=exc.status_code)
        return Response(exc.as_dict(), status=exc.status_code)
    if isinstance(exc, DjangoValidationError):
        data = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return Response(data, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, DataError):
        # Input the database cannot hold (e.g. a NUL byte in text); the transaction was rolled back.
        return Response({"detail": "the input contains values the database cannot store (e.g. NUL bytes)"},
                        status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, OperationalError) and is_conflict(exc):
        # A deadlock or serialization failure (after the service's own retries): not an outage.
        resp = Response({"detail": "the request conflicted with concurrent updates; nothing was stored, retry"},
                        status=status.HTTP_409_CONFLICT)
        resp["Retry-After"] = "1"
        return resp
    if isinstance(exc, OperationalError | InterfaceError):
        # The database went away mid-request: the transaction was rolled back, nothing is stored.
        resp = Response({"detail": "database unavailable; nothing was stored, retry"},
                        status=status.HTTP_503_SERVICE_UNAVAILABLE)
        resp["Retry-After"] = "5"
        return resp
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(exc, exceptions.ValidationError) and isinstance(response.data, list):
        response.data = {api_settings.NON_FIELD_ERRORS_KEY: response.data}
    return response
