"""The base every tenant-owned API uses: its queryset comes from a selector that scopes by the
principal, so foreign objects are absent (404) and lists show only the caller's tenants."""

from __future__ import annotations

from rest_framework import viewsets

from tenants.scoping import principal_for


class ScopedViewSetMixin:
    #: selector(principal) -> queryset already limited to what the principal may see
    selector = None

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
