"""The tenant portal, mounted at /portal/ (namespace "portal")."""

from django.urls import path

from . import portal as v

urlpatterns = [
    path("", v.home, name="home"),
    path("catalog/", v.catalog, name="catalog"),
    path("catalog/<int:tier_id>/order/", v.order, name="order"),
    path("slices/", v.slices, name="slices"),
    path("slices/<int:pk>/", v.slice_detail, name="slice"),
    path("slices/<int:pk>/status/", v.slice_status, name="slice_status"),
    path("slices/<int:pk>/release/", v.slice_release, name="slice_release"),
    path("models/", v.deployment_list, name="deployments"),
    path("models/new/", v.deployment_create, name="deployment_create"),
    path("models/repositories/", v.repositories, name="repositories"),
    path("models/repositories/upload/", v.repository_upload, name="repository_upload"),
    path("models/adapters/upload/", v.adapter_upload, name="adapter_upload"),
    path("find-tier/", v.find_tier, name="find_tier"),
    path("models/<int:pk>/", v.deployment_detail, name="deployment"),
    path("models/<int:pk>/status/", v.deployment_status, name="deployment_status"),
    path("models/<int:pk>/remove/", v.deployment_remove, name="deployment_remove"),
    path("models/<int:pk>/retry/", v.deployment_retry, name="deployment_retry"),
    path("models/<int:pk>/try/", v.deployment_try, name="deployment_try"),
    path("usage/", v.usage, name="usage"),
    path("invoices/", v.invoice_list, name="invoices"),
    path("invoices/<int:pk>/", v.invoice_detail, name="invoice"),
    path("invoices/<int:pk>/csv/", v.invoice_download, name="invoice_csv"),
    path("keys/", v.keys, name="keys"),
    path("keys/new/", v.key_create, name="key_create"),
    path("keys/<int:pk>/revoke/", v.key_revoke, name="key_revoke"),
    path("members/", v.members, name="members"),
    path("members/invite/", v.member_invite, name="member_invite"),
    path("members/<int:pk>/role/", v.member_role, name="member_role"),
    path("members/<int:pk>/remove/", v.member_remove, name="member_remove"),
    path("invitations/<int:pk>/revoke/", v.invitation_revoke, name="invitation_revoke"),
]
