"""Root URLs: admin, REST API v1, OpenAPI schema and docs, health."""

from django.contrib import admin
from django.http import JsonResponse
from django.urls import URLPattern, URLResolver, include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from marketplace.api.root import ApiRootView


def healthz(request):
    return JsonResponse({"status": "ok"})


api_v1: list[URLPattern | URLResolver] = [
    path("", ApiRootView.as_view(), name="root"),
    path("", include("tenants.api.urls")),
    path("", include("marketplace.api.urls")),
    path("", include("telemetry.api.urls")),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include((api_v1, "api"), namespace="api")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("healthz", healthz, name="healthz"),
    path("", include("telemetry.urls")),  # /metrics, /charts/<name>/, /api/v1/charts/<name>/
    path("", include("marketplace.web.urls")),
]

handler403 = "marketplace.web.errors.forbidden"
handler404 = "marketplace.web.errors.not_found"
handler500 = "marketplace.web.errors.server_error"
