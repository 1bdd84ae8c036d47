"""The operator console, mounted at /console/ with namespace "console"."""

from django.urls import path

from . import capacity_planning_page, console

urlpatterns = [
    path("", console.overview, name="overview"),
    path("alerts/", console.overview_alerts, name="overview_alerts"),
    path("nodes/", console.nodes, name="nodes"),
    path("nodes/new/", console.node_create, name="node_create"),
    path("nodes/<int:pk>/edit/", console.node_edit, name="node_edit"),
    path("allocations/", console.allocations, name="allocations"),
    path("allocations/drift/", console.drift, name="allocation_drift"),
    path("allocations/metering/", console.metering, name="allocation_metering"),
    path("allocations/<int:pk>/", console.allocation_detail, name="allocation_detail"),
    path("allocations/<int:pk>/retry/", console.allocation_retry, name="allocation_retry"),
    path("allocations/<int:pk>/release/", console.allocation_release, name="allocation_release"),
    path("tenants/", console.tenants, name="tenants"),
    path("tenants/new/", console.tenant_create, name="tenant_create"),
    path("tenants/<int:pk>/", console.tenant_detail, name="tenant_detail"),
    path("tenants/<int:pk>/billing/", console.tenant_billing, name="tenant_billing"),
    path("tenants/<int:pk>/suspend/", console.tenant_suspend, name="tenant_suspend"),
    path("tenants/<int:pk>/activate/", console.tenant_activate, name="tenant_activate"),
    path("api-keys/<int:pk>/limits/", console.tenant_key_limits, name="tenant_key_limits"),
    path("tiers/", console.tiers, name="tiers"),
    path("tiers/new/", console.tier_create, name="tier_create"),
    path("tiers/<int:pk>/", console.tier_detail, name="tier_detail"),
    path("invoices/", console.invoices, name="invoices"),
    path("invoices/<int:pk>/", console.invoice_detail, name="invoice_detail"),
    path("invoices/<int:pk>/csv/", console.invoice_download, name="invoice_csv"),
    path("invoices/<int:pk>/pdf/", console.invoice_pdf, name="invoice_pdf"),
    path("credit-notes/<int:pk>/pdf/", console.credit_note_pdf, name="credit_note_pdf"),
    path("invoices/<int:pk>/finalize/", console.invoice_finalize, name="invoice_finalize"),
    path("invoices/<int:pk>/credit-note/", console.invoice_credit_note, name="invoice_credit_note"),
    path("deployments/", console.deployments, name="deployments"),
    path("charts/", console.charts, name="charts"),
    path("audit/", console.audit_log, name="audit"),
    path("planner/", capacity_planning_page.planner_page, name="planner"),
]
