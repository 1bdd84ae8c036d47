"""The operator console, mounted at /console/ with namespace "console"."""

from django.urls import path

from . import capacity_planning_page
from . import console as v

urlpatterns = [
    path("", v.overview, name="overview"),
    path("alerts/", v.overview_alerts, name="overview_alerts"),
    path("nodes/", v.nodes, name="nodes"),
    path("nodes/new/", v.node_create, name="node_create"),
    path("allocations/", v.allocations, name="allocations"),
    path("allocations/drift/", v.drift, name="allocation_drift"),
    path("allocations/metering/", v.metering, name="allocation_metering"),
    path("allocations/<int:pk>/", v.allocation_detail, name="allocation_detail"),
    path("allocations/<int:pk>/retry/", v.allocation_retry, name="allocation_retry"),
    path("allocations/<int:pk>/release/", v.allocation_release, name="allocation_release"),
    path("tenants/", v.tenants, name="tenants"),
    path("tenants/new/", v.tenant_create, name="tenant_create"),
    path("tenants/<int:pk>/", v.tenant_detail, name="tenant_detail"),
    path("tenants/<int:pk>/suspend/", v.tenant_suspend, name="tenant_suspend"),
    path("tenants/<int:pk>/activate/", v.tenant_activate, name="tenant_activate"),
    path("tiers/", v.tiers, name="tiers"),
    path("tiers/new/", v.tier_create, name="tier_create"),
    path("tiers/<int:pk>/", v.tier_detail, name="tier_detail"),
    path("invoices/", v.invoices, name="invoices"),
    path("invoices/<int:pk>/", v.invoice_detail, name="invoice_detail"),
    path("invoices/<int:pk>/csv/", v.invoice_download, name="invoice_csv"),
    path("invoices/<int:pk>/finalize/", v.invoice_finalize, name="invoice_finalize"),
    path("invoices/<int:pk>/credit-note/", v.invoice_credit_note, name="invoice_credit_note"),
    path("deployments/", v.deployments, name="deployments"),
    path("charts/", v.charts, name="charts"),
    path("audit/", v.audit_log, name="audit"),
    path("planner/", capacity_planning_page.planner_page, name="planner"),
]
