"""Tenancy REST API. Thin: validate with serializers, act with services, read with selectors."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from marketplace.api.viewsets import ScopedModelViewSet, ScopedViewSetMixin

from .. import filters, selectors, services
from ..models import ApiKey, AuditEvent, Invitation, Membership, Tenant
from ..scoping import principal_for
from . import serializers


class TenantViewSet(ScopedModelViewSet):
    """Tenants: operators see and create all; tenant users see their own."""

    queryset_model = Tenant
    selector = selectors.tenants
    serializer_class = serializers.TenantSerializer
    filterset_class = filters.TenantFilter
    search_fields = ["name", "slug", "billing_email"]
    ordering_fields = ["name", "slug", "created_at", "status"]
    ordering = ["name"]
    lookup_field = "slug"
    http_method_names = ["get", "post", "patch", "head", "options"]
    capabilities = {
        "create": "operate", "partial_update": "manage_tenant",
        "suspend": "operate", "activate": "operate",
    }

    def get_serializer_class(self):
        if self.action in ("partial_update", "update"):
            return serializers.TenantUpdateSerializer
        return serializers.TenantSerializer

    def perform_create(self, serializer):
        data = dict(serializer.validated_data)
        owner_email = data.pop("owner_email", None)
        serializer.instance = services.create_tenant(self.principal, owner_email=owner_email, **data)

    def perform_update(self, serializer):
        data = dict(serializer.validated_data)
        data.pop("owner_email", None)
        serializer.instance = services.update_tenant(self.principal, serializer.instance, **data)

    def _refetch(self, tenant):
        return self.get_serializer(self.get_queryset().get(pk=tenant.pk)).data

    @extend_schema(request=serializers.SuspendSerializer, responses=serializers.TenantSerializer)
    @action(detail=True, methods=["post"])
    def suspend(self, request, slug=None):
        body = serializers.SuspendSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        tenant = services.suspend_tenant(self.principal, self.get_object(), body.validated_data["reason"])
        return Response(self._refetch(tenant))

    @extend_schema(request=None, responses=serializers.TenantSerializer)
    @action(detail=True, methods=["post"])
    def activate(self, request, slug=None):
        tenant = services.activate_tenant(self.principal, self.get_object())
        return Response(self._refetch(tenant))


class MembershipViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        mixins.UpdateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Members of the caller's tenants. Owners/admins change roles and remove members."""

    queryset_model = Membership
    selector = selectors.memberships
    serializer_class = serializers.MembershipSerializer
    filterset_class = filters.MembershipFilter
    search_fields = ["user__email", "user__full_name"]
    ordering_fields = ["created_at", "role", "user__email"]
    ordering = ["tenant__slug", "user__email"]
    http_method_names = ["get", "patch", "delete", "head", "options"]
    capabilities = {"partial_update": "manage_members", "destroy": "read"}  # self-removal allowed

    def perform_update(self, serializer):
        role = serializer.validated_data.get("role", serializer.instance.role)
        serializer.instance = services.change_role(self.principal, serializer.instance, role)

    def perform_destroy(self, instance):
        services.remove_member(self.principal, instance)


class InvitationViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Invitations by e-mail. The token goes only to the invitee's e-mail; DELETE revokes."""

    queryset_model = Invitation
    selector = selectors.invitations
    serializer_class = serializers.InvitationSerializer
    filterset_class = filters.InvitationFilter
    search_fields = ["email"]
    ordering_fields = ["created_at", "email", "expires_at"]
    ordering = ["-created_at"]
    capabilities = {"list": "manage_members", "retrieve": "manage_members",
                    "create": "manage_members", "destroy": "manage_members"}

    def perform_create(self, serializer):
        invitation, _token = services.invite(self.principal, **serializer.validated_data)
        serializer.instance = invitation

    def perform_destroy(self, instance):
        services.revoke_invitation(self.principal, instance)


class AcceptInvitationView(APIView):
    """The signed-in invitee accepts with the token from the e-mailed link and becomes a member
    (people use the link's page, /invitations/<token>/, which also signs up new users)."""

    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(request=serializers.AcceptInvitationSerializer, responses={201: serializers.MembershipSerializer})
    def post(self, request):
        principal = principal_for(request)
        if principal.user is None:
            return Response({"detail": "Sign in as a user to accept an invitation."},
                            status=status.HTTP_403_FORBIDDEN)
        body = serializers.AcceptInvitationSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        membership = services.accept_invitation(principal.user, body.validated_data["token"])
        return Response(serializers.MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)


class ApiKeyViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                    mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """API keys. Create returns the secret once (field `key`); PATCH sets its gateway limits; DELETE or
    POST .../revoke/ revokes."""

    queryset_model = ApiKey
    selector = selectors.api_keys
    serializer_class = serializers.ApiKeySerializer
    filterset_class = filters.ApiKeyFilter
    search_fields = ["name", "prefix"]
    ordering_fields = ["created_at", "name", "last_used_at", "expires_at"]
    ordering = ["-created_at"]
    capabilities = {"list": "manage_keys", "retrieve": "manage_keys", "create": "manage_keys",
                    "destroy": "manage_keys", "revoke": "manage_keys", "partial_update": "manage_keys"}

    @extend_schema(responses={201: serializers.ApiKeyCreatedSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        key, secret = services.create_api_key(
            self.principal, tenant=data.get("tenant"), name=data["name"], scopes=data["scopes"],
            expires_at=data.get("expires_at"), requests_per_minute=data.get("requests_per_minute"),
            tokens_per_minute=data.get("tokens_per_minute"),
            monthly_token_allowance=data.get("monthly_token_allowance"),
        )
        key.key = secret
        return Response(serializers.ApiKeyCreatedSerializer(key, context=self.get_serializer_context()).data,
                        status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.revoke_api_key(self.principal, instance)

    @extend_schema(request=serializers.ApiKeyLimitsSerializer, responses=serializers.ApiKeySerializer)
    def partial_update(self, request, pk=None):
        key = self.get_object()  # another tenant's key is a 404 whatever the body
        body = serializers.ApiKeyLimitsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        key = services.update_api_key_limits(self.principal, key, **body.validated_data)
        return Response(self.get_serializer(key).data)

    @extend_schema(request=None, responses=serializers.ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        key = services.revoke_api_key(self.principal, self.get_object())
        return Response(self.get_serializer(key).data)


class MeView(APIView):
    """Who the caller is: user or key, operator flag, memberships and roles, key scopes."""

    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(responses=serializers.MeSerializer)
    def get(self, request):
        principal = principal_for(request)
        tenants = {t.pk: t for t in Tenant.objects.filter(pk__in=list(principal.roles) + (
            [principal.key_tenant_id] if principal.key_tenant_id else []))}
        key = principal.api_key
        return Response({
            "kind": "api_key" if key else "user",
            "email": principal.user.email if principal.user else None,
            "is_operator": principal.is_operator,
            "memberships": [
                {"tenant": tenants[t].slug, "role": r, "tenant_status": tenants[t].status}
                for t, r in sorted(principal.roles.items())
            ],
            "api_key": None if key is None else {
                "prefix": key.prefix, "name": key.name, "scopes": key.scopes,
                "tenant": tenants[key.tenant_id].slug if key.tenant_id else None,
                "expires_at": key.expires_at,
            },
        })


class AuditEventViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        viewsets.GenericViewSet):
    """The audit log (read only): operators see every event, tenant owners/admins their tenants'."""

    queryset_model = AuditEvent
    selector = selectors.audit_events
    serializer_class = serializers.AuditEventSerializer
    filterset_class = filters.AuditEventFilter
    search_fields = ["actor", "target", "action"]
    ordering_fields = ["at", "action"]
    ordering = ["-at", "-id"]
    capabilities = {"list": "audit", "retrieve": "audit"}
