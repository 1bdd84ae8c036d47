"""API errors: service errors and model validation errors become field errors (400/403/409)."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from tenants.errors import ServiceError


def exception_handler(exc, context):
    if isinstance(exc, ServiceError):
        return Response(exc.as_dict(), status=exc.status_code)
    if isinstance(exc, DjangoValidationError):
        data = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return Response(data, status=status.HTTP_400_BAD_REQUEST)
    return drf_exception_handler(exc, context)
