"""One FilterSet per tenant-side list, shared by the REST API and the operator console (see
``marketplace.filters`` for the fleet, order and billing lists)."""

import django_filters
from django.db.models import Q
from django.utils import timezone

from .models import ApiKey, AuditEvent, Invitation, Membership, Tenant


class TenantFilter(django_filters.FilterSet):
    q = django_filters.CharFilter(method="filter_q", help_text="part of the name or slug")

    class Meta:
        model = Tenant
        fields = {"status": ["exact"], "currency": ["exact"], "slug": ["exact"]}

    def filter_q(self, qs, name, value):
        value = value.strip()
        return qs.filter(Q(name__icontains=value) | Q(slug__icontains=value)) if value else qs


class MembershipFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")

    class Meta:
        model = Membership
        fields = ["tenant", "role"]


class InvitationFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    pending = django_filters.BooleanFilter(method="filter_pending")

    class Meta:
        model = Invitation
        fields = ["tenant", "role", "pending"]

    def filter_pending(self, qs, name, value):
        pending = Q(accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now())
        return qs.filter(pending) if value else qs.exclude(pending)


class ApiKeyFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    status = django_filters.ChoiceFilter(
        choices=[("active", "active"), ("revoked", "revoked"), ("expired", "expired")], method="filter_status"
    )

    class Meta:
        model = ApiKey
        fields = ["tenant", "status"]

    def filter_status(self, qs, name, value):
        now = timezone.now()
        if value == "revoked":
            return qs.filter(revoked_at__isnull=False)
        expired = Q(expires_at__isnull=False, expires_at__lte=now)
        if value == "expired":
            return qs.filter(revoked_at__isnull=True).filter(expired)
        return qs.filter(revoked_at__isnull=True).exclude(expired)


class AuditEventFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    action = django_filters.CharFilter(field_name="action")
    action_prefix = django_filters.CharFilter(field_name="action", lookup_expr="startswith")
    since = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="lt")

    class Meta:
        model = AuditEvent
        fields = ["tenant", "action", "action_prefix", "since", "until"]
