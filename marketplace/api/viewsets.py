"""The base every tenant-owned API uses: its queryset comes from a selector that scopes by the
principal, so foreign objects are absent (404) and lists show only the caller's tenants."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from django.db.models import QuerySet
from rest_framework import serializers, viewsets

from tenants.scoping import Principal, principal_for


def reject_unsettable_fields(serializer, data) -> None:
    """A body naming a field the client may not set (unknown, or read-only such as a tenant's slug
    after creation) is a 400 naming each such field, never silently ignored."""
    if not isinstance(data, Mapping) or not hasattr(serializer, "fields"):
        return
    fields = serializer.fields
    bad = {}
    for name in data:
        f = fields.get(name)
        if f is None:
            bad[name] = ["unknown field; it cannot be set"]
        elif f.read_only:
            bad[name] = ["read-only field; it cannot be set here"]
    if bad:
        raise serializers.ValidationError(bad)


class StrictInputMixin:
    """Write actions refuse fields the serializer does not accept (see reject_unsettable_fields)."""

    def get_serializer(self, *args, **kwargs):
        s = super().get_serializer(*args, **kwargs)
        if "data" in kwargs and self.request is not None and self.request.method in ("POST", "PUT", "PATCH"):
            reject_unsettable_fields(s, kwargs["data"])
        return s


class ScopedViewSetMixin(StrictInputMixin):
    #: selector(principal) -> queryset already limited to what the principal may see; every viewset sets it
    selector: ClassVar[Callable[[Principal], QuerySet[Any]]]

    @property
    def principal(self):
        return principal_for(self.request)

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation
            return self.queryset_model.objects.none()
        return type(self).selector(self.principal)


class ScopedReadOnlyViewSet(ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    pass


class ScopedModelViewSet(ScopedViewSetMixin, viewsets.ModelViewSet):
    pass
