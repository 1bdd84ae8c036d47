"""Tiers and price plans (operators write, everyone signed in reads), orders and allocations
(tenant-scoped), drift (operators)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from marketplace.filters import AllocationFilter, DriftEventFilter, PricePlanFilter
from marketplace.models import (
    Allocation,
    AllocationEvent,
    DriftEvent,
    GpuModel,
    LibraryModel,
    MigProfile,
    Node,
    Order,
    PricePlan,
    Tier,
    TritonServer,
)
from marketplace.selectors import orders as selectors
from marketplace.services import models as model_svc
from marketplace.services import offers, orders
from marketplace.services.billing.plans import in_force
from tenants.api.serializers import ScopedTenantField
from tenants.models import Tenant
from tenants.permissions import SharedRead
from tenants.scoping import principal_for

from .disclosure import OperatorOnlyFieldsMixin
from .viewsets import ScopedViewSetMixin, StrictInputMixin

if TYPE_CHECKING:
    from rest_framework.validators import Validator


class PricePlanSerializer(serializers.ModelSerializer):
    tier = serializers.SlugRelatedField(slug_field="key", queryset=Tier.objects.all())
    effective_from = serializers.DateTimeField(required=False)

    class Meta:
        model = PricePlan
        fields = ["id", "tier", "kind", "currency", "price_per_slice_hour", "price_per_1m_input_tokens",
                  "price_per_1m_output_tokens", "monthly_commit", "effective_from", "created_at"]
        read_only_fields = ["id", "created_at"]
        validators: list[Validator[dict[str, object]]] = []


class TierSerializer(serializers.ModelSerializer):
    gpu_model = serializers.SlugRelatedField(slug_field="key", queryset=GpuModel.objects.all())
    profile = serializers.CharField(required=False, allow_null=True, help_text="MIG profile name; null: whole GPU")
    memory_gb = serializers.IntegerField(read_only=True)
    current_prices = serializers.SerializerMethodField()

    class Meta:
        model = Tier
        fields = ["id", "key", "name", "gpu_model", "profile", "gpu_count", "dedicated", "description", "active",
                  "memory_gb", "current_prices", "created_at"]
        read_only_fields = ["id", "created_at"]
        extra_kwargs: dict[str, dict[str, Any]] = {"key": {"validators": []}}

    def to_representation(self, obj):
        data = super().to_representation(obj)
        data["profile"] = obj.profile.name if obj.profile_id else None
        return data

    def validate(self, attrs):
        name = attrs.get("profile")
        if name is not None and "gpu_model" in attrs:
            profile = MigProfile.objects.filter(gpu_model=attrs["gpu_model"], name=name).first()
            if profile is None:
                raise serializers.ValidationError({"profile": [f"{attrs['gpu_model'].name} has no profile {name}"]})
            attrs["profile"] = profile
        return attrs

    def get_current_prices(self, obj) -> list[dict]:
        from django.utils import timezone

        plans = list(obj.plans.all())  # newest first (prefetched)
        current, out = {p.pk for p in in_force(plans, timezone.now()).values()}, []
        for p in plans:
            if p.pk in current:
                out.append({"kind": p.kind, "currency": p.currency, "per_slice_hour": str(p.price_per_slice_hour),
                            "per_1m_input_tokens": str(p.price_per_1m_input_tokens),
                            "per_1m_output_tokens": str(p.price_per_1m_output_tokens),
                            "monthly_commit": None if p.monthly_commit is None else str(p.monthly_commit),
                            "since": p.effective_from})
        return out


class OperatorWritesMixin(StrictInputMixin):
    def get_permissions(self):
        if self.request.method in permissions.SAFE_METHODS:
            return [SharedRead()]
        return super().get_permissions()

    @property
    def principal(self):
        return principal_for(self.request)


class TierViewSet(OperatorWritesMixin, viewsets.ModelViewSet):
    """What the MSP sells, with the prices in force now."""

    queryset = selectors.tiers()
    serializer_class = TierSerializer
    lookup_field = "key"
    filterset_fields = ["active", "dedicated"]
    search_fields = ["key", "name"]
    ordering_fields = ["key", "name", "created_at"]
    http_method_names = ["get", "post", "patch", "head", "options"]
    capabilities = {"create": "operate", "partial_update": "operate"}

    def perform_create(self, serializer):
        serializer.instance = offers.create_tier(self.principal, **serializer.validated_data)

    def perform_update(self, serializer):
        serializer.instance = offers.update_tier(self.principal, serializer.instance, **serializer.validated_data)


class PricePlanViewSet(OperatorWritesMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                       mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Price plans. A new price is a new plan; plans in force are never edited (DELETE: future only)."""

    queryset = selectors.price_plans()
    serializer_class = PricePlanSerializer
    filterset_class = PricePlanFilter
    ordering_fields = ["effective_from"]
    ordering = ["tier__key", "-effective_from"]
    capabilities = {"create": "operate", "destroy": "operate"}

    def perform_create(self, serializer):
        serializer.instance = offers.add_price_plan(self.principal, **serializer.validated_data)

    def perform_destroy(self, instance):
        offers.withdraw_price_plan(self.principal, instance)


class AllocationEventSerializer(OperatorOnlyFieldsMixin, serializers.ModelSerializer):
    detail = serializers.CharField(read_only=True, help_text="operators only (blank for tenants): the diagnostic")
    operator_only: ClassVar = {"detail": ""}

    class Meta:
        model = AllocationEvent
        fields = ["from_state", "to_state", "actor", "reason", "detail", "at"]


class TritonServerSerializer(serializers.ModelSerializer):
    """The slice's Triton server as its node worker last saw it (operators)."""

    class Meta:
        model = TritonServer
        fields = ["state", "runtime", "isolation", "address", "http_port", "grpc_port", "metrics_port", "unix_user",
                  "pid", "started_at", "ready_at", "stopped_at", "last_health_at", "last_health_ok", "restarts",
                  "exit_code", "reason"]


class AllocationSerializer(OperatorOnlyFieldsMixin, serializers.ModelSerializer):
    """A tenant reads its slice's tier, state, MIG device and history; where in the fleet it runs
    (node, GPU, start) and the engine's diagnostic are the operators'."""

    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    tier: serializers.SlugRelatedField[Tier] = serializers.SlugRelatedField(slug_field="key", read_only=True)
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="hostname", read_only=True, allow_null=True, help_text="operators only (null for tenants)")
    gpu_uuid = serializers.CharField(read_only=True, help_text="operators only (blank for tenants)")
    start = serializers.IntegerField(read_only=True, allow_null=True, help_text="operators only (null for tenants)")
    placement_detail = serializers.CharField(read_only=True, help_text="operators only (blank for tenants): the "
                                             "placement engine's diagnostic")
    events = AllocationEventSerializer(many=True, read_only=True)
    triton_server = TritonServerSerializer(read_only=True, allow_null=True,
                                           help_text="operators only (null for tenants): the slice's Triton server")
    operator_only: ClassVar = {"node": None, "gpu_uuid": "", "start": None, "placement_detail": "",
                               "triton_server": None}

    class Meta:
        model = Allocation
        fields = ["id", "order", "tenant", "tier", "state", "node", "gpu_uuid", "mig_uuid", "start", "size",
                  "placement_reason", "placement_detail", "failure_reason", "attempts", "created_at", "updated_at",
                  "activated_at", "released_at", "events", "triton_server"]


class OrderSerializer(serializers.ModelSerializer):
    tenant = ScopedTenantField(required=False, help_text="tenant slug (API keys: their own tenant)")
    tier = serializers.SlugRelatedField(slug_field="key", queryset=Tier.objects.filter(active=True))
    quantity = serializers.IntegerField(min_value=1, max_value=64, default=1)
    allocations = AllocationSerializer(many=True, read_only=True)
    library_model = serializers.SlugRelatedField(
        slug_field="key", queryset=LibraryModel.objects.filter(active=True), required=False, write_only=True,
        help_text="optional: the library model the slice is for; the order is refused if it does not fit the tier")
    # a declared field: DRF's serializer metaclass takes it off the class, so self.context stays the context
    context = serializers.IntegerField(  # type: ignore[assignment]
        required=False, write_only=True, min_value=0, max_value=10**7, default=0,
        help_text="with library_model: tokens per sequence (0: one token)")
    concurrency = serializers.IntegerField(required=False, write_only=True, min_value=1, max_value=100_000,
                                           default=1, help_text="with library_model: concurrent sequences")

    class Meta:
        model = Order
        fields = ["id", "tenant", "tier", "plan_kind", "quantity", "idempotency_key", "created_at", "allocations",
                  "library_model", "context", "concurrency"]
        read_only_fields = ["id", "created_at"]
        validators: list[Validator[dict[str, object]]] = []

    def validate(self, attrs):
        principal = principal_for(self.context["request"])
        if "tenant" not in attrs:
            if principal.key_tenant_id is None:
                raise serializers.ValidationError({"tenant": ["This field is required."]})
            attrs["tenant"] = principal.api_key.tenant
        model = attrs.pop("library_model", None)
        context, concurrency = attrs.pop("context", 0), attrs.pop("concurrency", 1)
        if model is not None:
            model_svc.check_tier_fits(attrs["tier"], model, context=context, concurrency=concurrency)
        return attrs


class OrderViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                   viewsets.GenericViewSet):
    """Orders. Creating one places every allocation at once (or nothing, with the reason)."""

    queryset_model = Order
    selector = selectors.orders
    serializer_class = OrderSerializer
    filterset_fields = ["plan_kind"]
    ordering_fields = ["created_at"]
    ordering = ["-created_at"]
    capabilities = {"create": "deploy"}

    def perform_create(self, serializer):
        serializer.instance = orders.create_order(self.principal, **serializer.validated_data)

    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        self.perform_create(serializer)
        order = self.get_queryset().get(pk=serializer.instance.pk)
        return Response(self.get_serializer(order).data, status=status.HTTP_201_CREATED)


class AllocationViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        viewsets.GenericViewSet):
    """Allocations with their state history; release (tenant) and retry (operators)."""

    queryset_model = Allocation
    selector = selectors.allocations
    serializer_class = AllocationSerializer
    filterset_class = AllocationFilter
    ordering_fields = ["created_at", "updated_at", "state"]
    ordering = ["-created_at"]
    capabilities = {"release": "deploy", "retry": "operate"}

    @extend_schema(request=None, responses={202: AllocationSerializer})
    @action(detail=True, methods=["post"])
    def release(self, request, pk=None):
        a = orders.request_release(self.principal, self.get_object())
        return Response(self.get_serializer(self.get_queryset().get(pk=a.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: AllocationSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request, pk=None):
        a = orders.retry(self.principal, self.get_object())
        return Response(self.get_serializer(self.get_queryset().get(pk=a.pk)).data, status=status.HTTP_202_ACCEPTED)


class DriftEventSerializer(serializers.ModelSerializer):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(slug_field="hostname", read_only=True)

    class Meta:
        model = DriftEvent
        fields = ["id", "node", "gpu_index", "kind", "detail", "allocation", "resolved", "at"]


class DriftEventViewSet(ScopedViewSetMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """What reconcile found different between the database and the GPUs (operators)."""

    queryset_model = DriftEvent
    selector = selectors.drift_events
    serializer_class = DriftEventSerializer
    filterset_class = DriftEventFilter
    ordering = ["-at"]
    capabilities = {"list": "operate"}
