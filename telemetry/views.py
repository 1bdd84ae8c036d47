"""Telemetry pages and endpoints: /metrics (Prometheus), /charts/<name>/ (HTML with plotly.js from
static files) and /api/v1/charts/<name>/ (the figure JSON plus its numbers)."""

from __future__ import annotations

from datetime import datetime

from django.contrib.auth.views import redirect_to_login
from django.http import HttpResponse
from django.shortcuts import render
from django.urls import reverse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from marketplace.api.schema import error_response
from telemetry import charts, metrics
from tenants.errors import Forbidden, ServiceError
from tenants.scoping import principal_for


def metrics_view(request):
    """Prometheus scrape: `Authorization: Bearer <TESSERA_METRICS_TOKEN>`, or a staff session."""
    user = getattr(request, "user", None)
    staff = bool(user and user.is_authenticated and user.is_active and user.is_staff)
    if not staff and not metrics.token_ok(request.headers.get("Authorization")):
        if request.headers.get("Authorization") or (user and user.is_authenticated):
            return HttpResponse("forbidden\n", status=403, content_type="text/plain")
        resp = HttpResponse("authentication required\n", status=401, content_type="text/plain")
        resp["WWW-Authenticate"] = 'Bearer realm="tessera-metrics"'
        return resp
    return HttpResponse(metrics.render(), content_type=metrics.CONTENT_TYPE)


def _params(request) -> dict:
    return {k: request.GET.get(k) for k in request.GET}


def chart_page(request, name: str):
    if not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    principal = principal_for(request)
    try:
        body = charts.figure_json(name, principal, _params(request))
    except charts.ChartNotFound as exc:
        return _chart_error(request, name, 404, "Chart not found", str(exc))
    except Forbidden as exc:
        return _chart_error(request, name, 403, "You cannot open this chart", str(exc))
    except ServiceError as exc:
        reason = f"{exc.field}: {exc.message}" if exc.field else exc.message
        return _chart_error(request, name, 400, "The chart cannot be drawn for that", reason)
    visible = [c for c in charts.CHARTS.values() if not c.operators_only or principal.is_operator]
    params = _params(request)
    custom = bool(params.get("start"))
    return render(request, "telemetry/chart.html", {
        "chart": charts.CHARTS[name], "charts": visible, "figure": body["figure"], "data": body["data"],
        "api_url": reverse("chart-api", args=[name]),
        "start": datetime.fromisoformat(body["data"]["start"]), "end": datetime.fromisoformat(body["data"]["end"]),
        "ranges": RANGES, "range": "custom" if custom else (params.get("hours") or "24"),
        "refreshes": REFRESHES, "refresh": params.get("refresh") or "0",
        "currency": params.get("currency") or "", "currencies": CURRENCIES,
        "money": name in MONEY_CHARTS,
    })


def _chart_error(request, name: str, status: int, title: str, text: str):
    """A refused chart inside the app's page (its navigation, the reason, a way back), with the right status."""
    known = name in charts.CHARTS
    home = reverse("chart-page", args=[name]) if known and status == 400 else (
        "/console/" if getattr(request.user, "is_operator", False) else "/portal/")
    return render(request, "error.html", {"status": status, "title": title, "text": text, "home": home,
                                          "home_label": "Back to this chart's last 24 hours" if home.startswith(
                                              "/charts/") else "Back to the start page"}, status=status)


#: the time-range picker (hours), the auto-refresh choices (seconds), as in Grafana
RANGES = [("1", "last 1 h"), ("24", "last 24 h"), ("168", "last 7 days"), ("720", "last 30 days")]
REFRESHES = [("0", "off"), ("30", "30 s"), ("60", "1 min"), ("300", "5 min")]
CURRENCIES = ["USD", "EUR", "GBP"]
MONEY_CHARTS = {"cost-per-tier", "h100-vs-h200", "tenant-usage"}


class ChartApiView(APIView):
    """A chart's plotly figure (JSON) and the numbers it is built from. Fleet charts: operators only;
    tenant-usage: the caller's own tenants (billing)."""

    permission_classes = [IsAuthenticated]

    @extend_schema(parameters=[OpenApiParameter(p, str, required=False) for p in
                               ("start", "end", "hours", "resolution", "bucket", "tenant", "currency")],
                   responses={200: dict})
    def get(self, request, name: str):
        try:
            body = charts.figure_json(name, principal_for(request), _params(request))
        except charts.ChartNotFound as exc:
            raise NotFound(str(exc)) from exc
        except Forbidden as exc:
            raise PermissionDenied(str(exc)) from exc
        except ServiceError as exc:
            raise ValidationError({exc.field or "non_field_errors": [exc.message]}) from exc
        return Response(body)


class ChartInfoSerializer(serializers.Serializer):
    name = serializers.CharField()
    title = serializers.CharField()
    operators_only = serializers.BooleanField()


class ChartIndexSerializer(serializers.Serializer):
    charts = ChartInfoSerializer(many=True)


class ChartIndexView(APIView):
    """The charts there are (name, title, whether only operators may see it). Public, as before."""

    permission_classes = [AllowAny]

    @extend_schema(operation_id="charts_list", responses={
        200: ChartIndexSerializer, 403: error_response(403, "credentials were sent and are not valid")})
    def get(self, request):
        return Response({"charts": [{"name": c.name, "title": c.title, "operators_only": c.operators_only}
                                    for c in charts.CHARTS.values()]})
