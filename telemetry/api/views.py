"""Metering REST API: usage ingest (gateway -> Tessera), hourly usage, metered vs served."""

from __future__ import annotations

from datetime import timedelta

import django_filters
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, serializers, viewsets
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from marketplace.api.schema import error_response
from marketplace.api.viewsets import ScopedViewSetMixin
from telemetry import selectors
from telemetry.models import UsageHourly
from telemetry.services import ingest
from tenants.models import Tenant
from tenants.permissions import TenantAccess
from tenants.scoping import principal_for


class ReadOrBilling(TenantAccess):
    """Safe methods: a key with scope read *or* billing:read (roles: read covers every role)."""

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        p = principal_for(request)
        return p.can("read") or p.can("billing")

    def has_object_permission(self, request, view, obj) -> bool:
        p = principal_for(request)
        return p.can("read", obj.tenant_id) or p.can("billing", obj.tenant_id)


def _tenant_for(principal, slug: str | None) -> Tenant:
    """The tenant a batch is for: a tenant key's own tenant; else the `tenant` slug in the body, or the
    caller's only tenant it may report usage for."""
    if principal.api_key is not None and principal.key_tenant_id is not None:
        tenant = Tenant.objects.get(pk=principal.key_tenant_id)
        if slug not in (None, "", tenant.slug):
            raise NotFound("No such tenant.")
        return tenant
    if not slug:
        ids = principal.tenant_ids("usage")
        if ids is not None and len(ids) == 1:
            return Tenant.objects.get(pk=next(iter(ids)))
        raise ValidationError({"tenant": ["give the tenant (slug) this batch is for"]})
    named = Tenant.objects.visible_to(principal, "usage").filter(slug=slug).first()
    if named is None:
        raise NotFound("No such tenant.")
    return named


EVENT_FIELDS: dict[str, serializers.Field] = {
    "event_id": serializers.CharField(max_length=100, help_text="unique per tenant: the idempotency key"),
    "deployment": serializers.IntegerField(required=False, help_text="deployment id (or give model)"),
    "model": serializers.CharField(required=False, help_text="name of a live deployment of the tenant"),
    "ts": serializers.DateTimeField(help_text="ISO 8601 with a timezone"),
    "input_tokens": serializers.IntegerField(min_value=0),
    "output_tokens": serializers.IntegerField(min_value=0),
    "requests": serializers.IntegerField(min_value=1, default=1),
}


class UsageEventsView(APIView):
    """Report usage: up to 10,000 events per batch. Replays of an event id are accepted and not
    counted twice. A malformed batch is refused whole (400, the bad items by index); events that are
    well-formed but not acceptable are listed in `rejected` and the rest stored."""

    capabilities = {"post": "usage", "create": "usage"}

    @extend_schema(
        request=inline_serializer("UsageBatch", {
            "tenant": serializers.SlugField(required=False, help_text="for users and operator keys"),
            "events": inline_serializer("UsageEventIn", EVENT_FIELDS, many=True),
        }),
        responses={200: inline_serializer("UsageBatchResult", {
            "new": serializers.IntegerField(), "duplicates": serializers.IntegerField(),
            "rejected": serializers.ListField(child=serializers.DictField()),
        }), 404: error_response(404, "The tenant named in the body does not exist or is not the caller's.")},
    )
    def post(self, request):
        principal = principal_for(request)
        data = request.data
        if not isinstance(data, dict) or "events" not in data:
            raise ValidationError({"events": ["send {\"events\": [...]}"]})
        unknown = sorted(set(data) - {"events", "tenant"})
        if unknown:  # never silently ignored
            raise ValidationError({k: ["unknown field; it cannot be set"] for k in unknown})
        tenant = _tenant_for(principal, data.get("tenant"))
        result = ingest.ingest_batch(principal, tenant, data["events"])
        return Response(result.as_dict())


class UsageHourlySerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    model = serializers.CharField(source="deployment.name", read_only=True)

    class Meta:
        model = UsageHourly
        fields = ["id", "tenant", "deployment", "model", "hour", "input_tokens", "output_tokens", "requests",
                  "events", "billed_input_tokens", "billed_output_tokens", "billed_requests", "updated_at"]
        read_only_fields = fields


class UsageHourlyFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    model = django_filters.CharFilter(field_name="deployment__name")
    hour_from = django_filters.IsoDateTimeFilter(field_name="hour", lookup_expr="gte")
    hour_to = django_filters.IsoDateTimeFilter(field_name="hour", lookup_expr="lt")

    class Meta:
        model = UsageHourly
        fields = ["tenant", "deployment", "model", "hour_from", "hour_to"]


class UsageHourlyViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                         viewsets.GenericViewSet):
    """Usage per (tenant, deployment, hour), kept up to date as events arrive; `billed_*` is what a
    finalized invoice charged. Filter: tenant (slug), deployment, model, hour_from, hour_to (UTC, [from, to))."""

    queryset_model = UsageHourly
    selector = selectors.usage_hours
    serializer_class = UsageHourlySerializer
    filterset_class = UsageHourlyFilter
    permission_classes = [ReadOrBilling]
    ordering_fields = ["hour", "requests", "input_tokens", "output_tokens"]
    ordering = ["-hour", "deployment_id"]


def _when(request, name: str, default):
    raw = request.query_params.get(name)
    if not raw:
        return default
    value = parse_datetime(raw)
    if value is None or value.tzinfo is None:
        raise ValidationError({name: ["an ISO 8601 time with a timezone"]})
    return value


class MeteredVsServedView(APIView):
    """Per deployment: requests metered (reported by the tenant's gateway) against requests served
    (Triton's own statistics), and the difference (metered - served). Operators see all tenants."""

    permission_classes = [ReadOrBilling]

    @extend_schema(parameters=[
        OpenApiParameter("since", str, description="ISO 8601 (default: 24 hours ago)"),
        OpenApiParameter("until", str, description="ISO 8601 (default: now)"),
        OpenApiParameter("tenant", str, description="tenant slug"),
        OpenApiParameter("page", int, description="page number"),
        OpenApiParameter("page_size", int, description="rows per page"),
    ], responses=inline_serializer("MeteredVsServed", {"results": serializers.ListField(
        child=serializers.DictField())}))
    def get(self, request):
        now = timezone.now()
        until = _when(request, "until", now)
        since = _when(request, "since", until - timedelta(hours=24))
        rows = selectors.metered_vs_served(principal_for(request), since, until,
                                           tenant=request.query_params.get("tenant") or None)
        paginator = api_settings.DEFAULT_PAGINATION_CLASS() if api_settings.DEFAULT_PAGINATION_CLASS else None
        if paginator is None:
            return Response({"since": since, "until": until, "results": rows})
        page = paginator.paginate_queryset(rows, request, view=self)
        response = paginator.get_paginated_response(page)
        response.data["since"], response.data["until"] = since, until
        return response
