"""Reads for tenancy, always through the principal's scope."""

from __future__ import annotations

from django.db.models import Count, Q

from . import keys
from .models import ApiKey, AuditEvent, Invitation, Membership, Tenant, User
from .scoping import Principal


def tenants(principal: Principal):
    return Tenant.objects.visible_to(principal).annotate(
        member_count=Count("memberships", distinct=True),
        active_key_count=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True), distinct=True),
    )


def memberships(principal: Principal):
    return Membership.objects.visible_to(principal).select_related("user", "tenant")


def invitations(principal: Principal):
    return Invitation.objects.visible_to(principal, "manage_members").select_related("tenant", "invited_by")


def invitation_by_token(token: str) -> Invitation | None:
    """The invitation a link's token opens (any status), or None. Only the token's hash is looked up."""
    return (Invitation.objects.select_related("tenant", "invited_by")
            .filter(token_hash=keys.hash_key(token)).first())


def has_account(email: str) -> bool:
    return User.objects.filter(email__iexact=email).exists()


def api_keys(principal: Principal):
    return ApiKey.objects.visible_to(principal, "manage_keys").select_related("tenant", "created_by")


def audit_events(principal: Principal):
    """Operators: every event; tenant owners/admins: their tenants' events."""
    return AuditEvent.objects.visible_to(principal, "audit").select_related("tenant", "actor_user")
