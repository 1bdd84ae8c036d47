"""The tenant portal, mounted at /portal/ (namespace "portal")."""

from django.urls import path

from . import portal

urlpatterns = [
    path("", portal.home, name="home"),
    path("catalog/", portal.catalog, name="catalog"),
    path("catalog/<int:tier_id>/order/", portal.order, name="order"),
    path("slices/", portal.slices, name="slices"),
    path("slices/<int:pk>/", portal.slice_detail, name="slice"),
    path("slices/<int:pk>/status/", portal.slice_status, name="slice_status"),
    path("slices/<int:pk>/release/", portal.slice_release, name="slice_release"),
    path("models/", portal.deployment_list, name="deployments"),
    path("models/new/", portal.deployment_create, name="deployment_create"),
    path("models/repositories/", portal.repositories, name="repositories"),
    path("models/repositories/upload/", portal.repository_upload, name="repository_upload"),
    path("models/adapters/upload/", portal.adapter_upload, name="adapter_upload"),
    path("models/uploads/status/", portal.uploads_status, name="uploads_status"),
    path("find-tier/", portal.find_tier, name="find_tier"),
    path("models/<int:pk>/", portal.deployment_detail, name="deployment"),
    path("models/<int:pk>/status/", portal.deployment_status, name="deployment_status"),
    path("models/<int:pk>/remove/", portal.deployment_remove, name="deployment_remove"),
    path("models/<int:pk>/retry/", portal.deployment_retry, name="deployment_retry"),
    path("models/<int:pk>/try/", portal.deployment_try, name="deployment_try"),
    path("usage/", portal.usage, name="usage"),
    path("invoices/", portal.invoice_list, name="invoices"),
    path("invoices/<int:pk>/", portal.invoice_detail, name="invoice"),
    path("invoices/<int:pk>/csv/", portal.invoice_download, name="invoice_csv"),
    path("invoices/<int:pk>/pdf/", portal.invoice_pdf, name="invoice_pdf"),
    path("credit-notes/<int:pk>/pdf/", portal.credit_note_pdf, name="credit_note_pdf"),
    path("billing/", portal.billing_details, name="billing_details"),
    path("keys/", portal.keys, name="keys"),
    path("keys/new/", portal.key_create, name="key_create"),
    path("keys/<int:pk>/revoke/", portal.key_revoke, name="key_revoke"),
    path("keys/<int:pk>/limits/", portal.key_limits, name="key_limits"),
    path("members/", portal.members, name="members"),
    path("members/invite/", portal.member_invite, name="member_invite"),
    path("members/<int:pk>/role/", portal.member_role, name="member_role"),
    path("members/<int:pk>/remove/", portal.member_remove, name="member_remove"),
    path("invitations/<int:pk>/revoke/", portal.invitation_revoke, name="invitation_revoke"),
]
