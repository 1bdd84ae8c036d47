"""Capacity planner API (MSP operators): the measured inputs, and a plan for a demand mix."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import permissions, serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from marketplace import planner
from marketplace.selectors import capacity_planning
from telemetry.charts import capacity_plan
from tenants.models import CURRENCIES
from tenants.scoping import principal_for


class IsOperator(permissions.BasePermission):
    message = "The capacity planner is for MSP operators."

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        p = principal_for(request)
        return p.is_operator and p.can("read")


class WorkloadSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=80)
    tokens_per_s = serializers.FloatField(min_value=0.001, max_value=1e9)
    min_memory_gib = serializers.FloatField(min_value=0, max_value=10_000,
                                            help_text="GPU memory one replica needs (model weights + KV cache)")
    gpu_models = serializers.ListField(child=serializers.SlugField(max_length=40), required=False, default=list,
                                       help_text="run only on these GPU models (keys); empty: any")


class PlanRequestSerializer(serializers.Serializer):
    workloads: serializers.ListSerializer[Any] = serializers.ListSerializer(
        child=WorkloadSerializer(), allow_empty=False, max_length=capacity_planning.MAX_WORKLOADS)
    target_utilization = serializers.FloatField(min_value=0.01, max_value=1.0,
                                                default=capacity_planning.DEFAULT_TARGET_UTILIZATION)
    growth = serializers.FloatField(min_value=0.01, max_value=10_000, default=1.0)
    window_days = serializers.FloatField(min_value=0.05, max_value=366, default=capacity_planning.DEFAULT_WINDOW_DAYS)
    price_per_kwh = serializers.FloatField(min_value=0, max_value=100, required=False,
                                           help_text="default: TESSERA_ENERGY_PRICE_PER_KWH")
    currency = serializers.ChoiceField(choices=CURRENCIES, default="USD")
    gpu_models = serializers.ListField(child=serializers.SlugField(max_length=40), required=False,
                                       help_text="GPU models the fleet may use (default: all)")
    gpu_hour_cost = serializers.DictField(child=serializers.FloatField(min_value=0, max_value=10_000),
                                          required=False, help_text="GPU model key -> cost per GPU-hour")
    throughput = serializers.DictField(child=serializers.FloatField(min_value=0.001, max_value=1e9), required=False,
                                       help_text="shape ('h200-sxm-141gb/3g.71gb', '.../whole') -> tokens/s")

    def validate_workloads(self, value):
        names = [w["name"] for w in value]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise serializers.ValidationError(f"workload names must be unique: {', '.join(dup)}")
        return value


PLAN_RESPONSE = inline_serializer("CapacityPlan", {
    "window": serializers.DictField(), "currency": serializers.CharField(),
    "target_utilization": serializers.FloatField(), "growth": serializers.FloatField(),
    "input_token_share": serializers.FloatField(), "workloads": serializers.ListField(child=serializers.DictField()),
    "shapes": serializers.ListField(child=serializers.DictField()), "power": serializers.DictField(),
    "fleet_gpus": serializers.DictField(), "scenarios": serializers.ListField(child=serializers.DictField()),
    "figure": serializers.DictField(required=False),
})


class PlannerView(APIView):
    """POST a demand mix; get the lowest-cost fleet (GPUs per model, MIG layouts, where each workload
    runs, cost per 1K tokens) and the comparison scenarios (one GPU model only, whole GPUs only)."""

    permission_classes = [IsOperator]

    @extend_schema(request=PlanRequestSerializer, responses=PLAN_RESPONSE,
                   parameters=[OpenApiParameter("figure", bool, required=False,
                                                description="include the Plotly figure")])
    def post(self, request):
        ser = PlanRequestSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        req = capacity_planning.PlanRequest(
            workloads=[planner.Workload(w["name"], w["tokens_per_s"], w["min_memory_gib"], tuple(w["gpu_models"]))
                       for w in d["workloads"]],
            target_utilization=d["target_utilization"], growth=d["growth"], window_days=d["window_days"],
            price_per_kwh=d.get("price_per_kwh"), currency=d["currency"],
            gpu_models=tuple(d["gpu_models"]) if d.get("gpu_models") else None,
            gpu_hour_cost=dict(d.get("gpu_hour_cost") or {}), throughput=dict(d.get("throughput") or {}))
        try:
            report = capacity_planning.build_plan(req)
        except planner.PlanError as exc:
            raise ValidationError({exc.field or "non_field_errors": [exc.message]}) from None
        body = capacity_planning.report_dict(report)
        if request.query_params.get("figure") in ("1", "true", "yes"):
            body["figure"] = capacity_plan(report)
        return Response(body)


class PlannerInputsView(APIView):
    """What the planner measured: throughput per shape, power per GPU model, and the demand of the
    tenants' deployments (busiest hour) over the window."""

    permission_classes = [IsOperator]

    @extend_schema(parameters=[OpenApiParameter("window_days", float, required=False),
                               OpenApiParameter("currency", str, required=False)],
                   responses=inline_serializer("CapacityPlannerInputs", {
                       "window": serializers.DictField(), "power": serializers.DictField(),
                       "shapes": serializers.ListField(child=serializers.DictField()),
                       "demand": serializers.ListField(child=serializers.DictField()),
                       "gpu_hour_cost": serializers.DictField(), "fleet_gpus": serializers.DictField()}))
    def get(self, request):
        try:
            days = float(request.query_params.get("window_days") or capacity_planning.DEFAULT_WINDOW_DAYS)
        except ValueError:
            raise ValidationError({"window_days": ["a number of days"]}) from None
        if not 0.05 <= days <= 366:
            raise ValidationError({"window_days": ["between 0.05 and 366 days"]})
        currency = (request.query_params.get("currency") or "USD").upper()
        if currency not in dict(CURRENCIES):
            raise ValidationError({"currency": [f"one of {', '.join(dict(CURRENCIES))}"]})
        since, until = capacity_planning.window(days)
        shapes = capacity_planning.shape_figures(since, until, currency)
        power = capacity_planning.power_figures(since, until)
        return Response({
            "window": {"since": since.isoformat(), "until": until.isoformat()},
            "shapes": [capacity_planning.shape_dict(f) for f in shapes],
            "power": {k: capacity_planning.power_dict(p) for k, p in power.items()},
            "demand": capacity_planning.measured_demand(since, until),
            "gpu_hour_cost": {m: str(capacity_planning.default_gpu_hour_cost(m)) for m in power},
            "fleet_gpus": capacity_planning.fleet_gpus(),
        })
