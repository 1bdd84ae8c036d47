from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rest_framework import serializers

from ..models import ApiKey, AuditEvent, Invitation, Membership, Tenant
from ..roles import Role, Scope
from ..scoping import principal_for

if TYPE_CHECKING:
    from rest_framework.validators import Validator


class TenantSerializer(serializers.ModelSerializer):
    member_count = serializers.IntegerField(read_only=True)
    active_key_count = serializers.IntegerField(read_only=True)
    owner_email = serializers.EmailField(write_only=True, required=False,
                                         help_text="invite this person as the first owner")

    class Meta:
        model = Tenant
        fields = [
            "id", "name", "slug", "status", "billing_email", "currency", "created_at",
            "suspended_at", "suspended_reason",
            "max_slices", "max_slices_per_tier", "max_memory_gb",
            "monthly_spend_limit", "spend_warn_ratio", "spend_block_ratio",
            "max_concurrent_requests", "max_key_requests_per_minute", "max_key_tokens_per_minute",
            "sso_email_domain", "billing_legal_name", "billing_address", "billing_tax_id",
            "member_count", "active_key_count", "owner_email",
        ]
        read_only_fields = ["id", "status", "created_at", "suspended_at", "suspended_reason"]
        # uniqueness is the service's (409), after it normalizes the value
        extra_kwargs: dict[str, dict[str, Any]] = {"slug": {"validators": []}, "sso_email_domain": {"validators": []}}

    def get_fields(self):
        fields = super().get_fields()
        if self.instance is not None:  # slug is fixed once created
            fields["slug"].read_only = True
        return fields


class TenantUpdateSerializer(TenantSerializer):
    """PATCH: the slug is fixed once created (documented read-only; sending it is a 400)."""

    class Meta(TenantSerializer.Meta):
        read_only_fields = [*TenantSerializer.Meta.read_only_fields, "slug"]
        extra_kwargs: dict[str, dict[str, Any]] = {"sso_email_domain": {"validators": []}}


class SuspendSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class UserBriefSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    email = serializers.EmailField()
    full_name = serializers.CharField()


class MembershipSerializer(serializers.ModelSerializer):
    user = UserBriefSerializer(read_only=True)
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "tenant", "user", "role", "created_at"]
        read_only_fields = ["id", "tenant", "user", "created_at"]


class ScopedTenantField(serializers.SlugRelatedField):
    """A tenant, by slug, among those the caller can see (others: 'does not exist')."""

    def __init__(self, **kwargs):
        kwargs.setdefault("slug_field", "slug")
        super().__init__(**kwargs)

    def get_queryset(self):
        request = self.context["request"]
        return Tenant.objects.visible_to(principal_for(request))

    def to_internal_value(self, data):
        if isinstance(data, str) and "\x00" in data:  # no slug has one, and PostgreSQL refuses it in a query
            self.fail("does_not_exist", slug_name=self.slug_field, value=data.replace("\x00", "\\x00"))
        return super().to_internal_value(data)


class InvitationSerializer(serializers.ModelSerializer):
    tenant = ScopedTenantField()
    status = serializers.CharField(read_only=True)
    invited_by = serializers.EmailField(source="invited_by.email", read_only=True, default=None)

    class Meta:
        model = Invitation
        fields = ["id", "tenant", "email", "role", "status", "invited_by", "created_at", "expires_at"]
        read_only_fields = ["id", "status", "invited_by", "created_at", "expires_at"]
        validators: list[Validator[dict[str, object]]] = []  # the pending-invitation uniqueness is the service's (409)


class AcceptInvitationSerializer(serializers.Serializer):
    token = serializers.CharField(max_length=200,
                                  help_text="the last part of the e-mailed link <site>/invitations/<token>/")


class ApiKeySerializer(serializers.ModelSerializer):
    tenant = ScopedTenantField(required=False, allow_null=True,
                               help_text="tenant slug; omit for an MSP operator key (operators only)")
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices), allow_empty=False)
    status = serializers.CharField(read_only=True)
    created_by = serializers.EmailField(source="created_by.email", read_only=True, default=None)

    requests_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=1,
        help_text="the gateway's requests per minute for this key; empty: the installation's default. A tenant's "
                  "admins may set at most the tenant's max_key_requests_per_minute")
    tokens_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=1,
        help_text="the gateway's tokens (input + output) per minute for this key; empty: the installation's default. "
                  "A tenant's admins may set at most the tenant's max_key_tokens_per_minute")
    monthly_token_allowance = serializers.IntegerField(
        required=False, allow_null=True, min_value=1,
        help_text="tokens (input + output) this key may be served per calendar month (UTC); once reached the "
                  "gateway answers 429 insufficient_quota (tessera_code key_allowance_reached) until the month ends or "
                  "the allowance is raised; empty: none")

    class Meta:
        model = ApiKey
        fields = ["id", "tenant", "name", "prefix", "scopes", "status", "created_by", "created_at",
                  "expires_at", "last_used_at", "revoked_at", "requests_per_minute", "tokens_per_minute",
                  "monthly_token_allowance"]
        read_only_fields = ["id", "prefix", "status", "created_by", "created_at", "last_used_at", "revoked_at"]


class ApiKeyLimitsSerializer(serializers.Serializer):
    """PATCH a key: its gateway limits only (a key's name, scopes and expiry are fixed once made)."""

    requests_per_minute = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    tokens_per_minute = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    monthly_token_allowance = serializers.IntegerField(required=False, allow_null=True, min_value=1)

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({f: ["cannot be changed: revoke the key and make another"]
                                               for f in unknown})
        return attrs


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the secret; shown once, never again")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class MeSerializer(serializers.Serializer):
    kind = serializers.CharField()
    email = serializers.EmailField(allow_null=True)
    is_operator = serializers.BooleanField()
    memberships = serializers.ListField(child=serializers.DictField())
    api_key = serializers.DictField(allow_null=True)


ROLE_CHOICES = Role.choices


class AuditEventSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = AuditEvent
        fields = ["id", "at", "actor", "tenant", "action", "target", "detail"]
        read_only_fields = fields
