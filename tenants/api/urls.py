from django.urls import path
from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter()
router.register("tenants", views.TenantViewSet, basename="tenant")
router.register("memberships", views.MembershipViewSet, basename="membership")
router.register("invitations", views.InvitationViewSet, basename="invitation")
router.register("api-keys", views.ApiKeyViewSet, basename="apikey")
router.register("audit", views.AuditEventViewSet, basename="auditevent")

urlpatterns = [
    path("me/", views.MeView.as_view(), name="me"),
    path("invitations/accept/", views.AcceptInvitationView.as_view(), name="invitation-accept"),
    *router.urls,
]
