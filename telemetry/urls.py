"""Telemetry URLs mounted at the site root: /metrics, /charts/<name>/, /api/v1/charts/<name>/."""

from django.urls import path

from . import views

urlpatterns = [
    path("metrics", views.metrics_view, name="metrics"),
    path("charts/<slug:name>/", views.chart_page, name="chart-page"),
    path("api/v1/charts/", views.ChartIndexView.as_view(), name="chart-index"),
    path("api/v1/charts/<slug:name>/", views.ChartApiView.as_view(), name="chart-api"),
]
