"""One FilterSet per list, shared by the REST API (``filterset_class``) and the operator console.

The console binds the same FilterSet to ``request.GET`` (see ``marketplace.web.tables.filtered``): a value
the form rejects is shown as a message and that filter is left out, never a 500. Tenant-side lists
(tenants, members, invitations, keys, the audit log) have theirs in ``tenants.filters``.
"""

from __future__ import annotations

import django_filters
from django.db.models import QuerySet
from django_filters import rest_framework as drf_filters

from marketplace.api.disclosure import reader_is_operator
from marketplace.models import (
    Allocation,
    DriftEvent,
    Gpu,
    GpuInstance,
    Invoice,
    MigProfile,
    ModelDeployment,
    Node,
    PricePlan,
)


class OperatorOnlyFiltersMixin:
    """FilterSet mixin: ``CharFilter(field_name="node__hostname", method="operator_only")`` filters
    operators' lists by a fleet field; for anyone else it matches nothing, so a tenant cannot use
    it to confirm a guessed hostname."""

    request: object

    def operator_only(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        if not reader_is_operator({"request": self.request}):
            return queryset.none()
        return queryset.filter(**{name: value})


# --- catalog ------------------------------------------------------------------------------------

class MigProfileFilter(django_filters.FilterSet):
    gpu_model = django_filters.CharFilter(field_name="gpu_model__key")

    class Meta:
        model = MigProfile
        fields = ["gpu_model", "name", "profile_id", "media_extensions"]


class NodeFilter(django_filters.FilterSet):
    platform = django_filters.CharFilter(field_name="platform__key")

    class Meta:
        model = Node
        fields = ["platform", "state"]


class GpuFilter(django_filters.FilterSet):
    node = django_filters.CharFilter(field_name="node__hostname")
    gpu_model = django_filters.CharFilter(field_name="gpu_model__key")
    dedicated_tenant = django_filters.CharFilter(field_name="dedicated_tenant__slug")

    class Meta:
        model = Gpu
        fields = ["node", "gpu_model", "mig_mode", "state", "dedicated_tenant"]


class InstanceFilter(OperatorOnlyFiltersMixin, django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    node = django_filters.CharFilter(field_name="gpu__node__hostname", method="operator_only",
                                     help_text="node hostname (operators only)")
    gpu_model = django_filters.CharFilter(field_name="gpu__gpu_model__key")

    class Meta:
        model = GpuInstance
        fields = ["tenant", "node", "gpu_model", "state"]


# --- orders -------------------------------------------------------------------------------------

class PricePlanFilter(django_filters.FilterSet):
    tier = django_filters.CharFilter(field_name="tier__key")

    class Meta:
        model = PricePlan
        fields = ["tier", "kind", "currency"]


class AllocationFilter(OperatorOnlyFiltersMixin, django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    tier = django_filters.CharFilter(field_name="tier__key")
    node = django_filters.CharFilter(field_name="node__hostname", method="operator_only",
                                     help_text="node hostname (operators only)")

    class Meta:
        model = Allocation
        fields = ["tenant", "tier", "node", "state", "order"]


class DriftEventFilter(drf_filters.FilterSet):
    """``resolved``: true or false (absent: both). The console shows the open ones unless asked."""

    class Meta:
        model = DriftEvent
        fields = ["kind", "resolved"]


class DeploymentFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")

    class Meta:
        model = ModelDeployment
        fields = ["tenant", "allocation", "state", "name"]


# --- billing ------------------------------------------------------------------------------------

class InvoiceFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    period_from = django_filters.DateFilter(field_name="period_start", lookup_expr="gte")
    period_to = django_filters.DateFilter(field_name="period_start", lookup_expr="lte")
    period = django_filters.DateFilter(field_name="period_start", input_formats=["%Y-%m"],
                                       help_text="the invoice's month, YYYY-MM")

    class Meta:
        model = Invoice
        fields = ["tenant", "status", "period_start", "currency", "period"]


__all__ = ["AllocationFilter", "DeploymentFilter", "DriftEventFilter", "GpuFilter", "InstanceFilter",
           "InvoiceFilter", "MigProfileFilter", "NodeFilter", "OperatorOnlyFiltersMixin", "PricePlanFilter"]
