"""The one tenant-scoping mechanism.

A request is turned into a ``Principal`` once (``principal_for``). Every model that belongs to a
tenant uses ``TenantScopedQuerySet`` and names its path to the tenant id in ``tenant_path``
("tenant_id", "allocation__tenant_id", ...). Every view, API and selector reads through
``Model.objects.visible_to(principal, capability)``, so objects of other tenants are simply not
there (a foreign id gives 404, never 403 and never the data).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, cast

from django.db import models

from .roles import CAPABILITIES, SCOPE_CAPABILITY
from .roles import capability as known_capability


@dataclass(frozen=True)
class Principal:
    """Who is asking: a user (roles per tenant) or an API key (scopes on one tenant)."""

    user: Any = None
    api_key: Any = None
    is_operator: bool = False
    roles: dict[int, str] = field(default_factory=dict)  # tenant id -> role (users)
    key_tenant_id: int | None = None
    scopes: frozenset[str] | None = None  # None: a user, whose role decides
    suspended: frozenset[int] = frozenset()  # tenants that may only read and see billing
    site_url: str = ""  # the site's address as the request saw it ("https://host"): links in e-mails

    @property
    def is_authenticated(self) -> bool:
        return self.user is not None or self.api_key is not None

    def _key_allows(self, capability: str) -> bool:
        scopes = self.scopes or frozenset()
        return any(cap == capability and scope in scopes for scope, cap in SCOPE_CAPABILITY.items())

    def can(self, capability: str, tenant_id: int | None = None) -> bool:
        """May this principal exercise `capability` on `tenant_id` (None: on some tenant)?"""
        ids = self.tenant_ids(capability)
        if ids is None:
            return True
        return bool(ids) if tenant_id is None else tenant_id in ids

    def tenant_ids(self, capability: str = "read") -> set[int] | None:
        """Tenant ids this principal may `capability` on; None means every tenant (operators).
        An unknown capability name raises ``ValueError``."""
        capability = known_capability(capability)
        if self.api_key is not None:
            if not self._key_allows(capability):
                return set()
            if capability == "usage" and self.key_tenant_id is not None:
                return set()  # reporting usage is for operator keys only (a tenant key kept from before)
            if self.key_tenant_id is None:
                return None if self.is_operator else set()
            ids = {self.key_tenant_id}
        elif self.is_operator:
            return None
        else:
            ids = {t for t, r in self.roles.items() if capability in CAPABILITIES.get(r, ())}
        if capability not in READ_ONLY_CAPS:
            ids -= self.suspended
        return ids

    def role_in(self, tenant_id: int) -> str | None:
        return self.roles.get(tenant_id)


ANONYMOUS = Principal()
# What a suspended tenant may still do: read, see billing, and report usage (its slices may still be
# serving, and usage it reports must not be lost to billing).
READ_ONLY_CAPS = frozenset({"read", "billing", "usage", "audit"})


class _TenantOwned(Protocol):
    tenant_path: ClassVar[str]  # e.g. "tenant_id", "allocation__tenant_id"


class TenantScopedQuerySet(models.QuerySet):
    @property
    def _tenant_path(self) -> str:
        # Every model whose manager is built from this queryset names its path to the tenant id.
        return cast("type[_TenantOwned]", self.model).tenant_path

    def visible_to(self, principal: Principal, capability: str = "read") -> TenantScopedQuerySet:
        ids = principal.tenant_ids(capability)
        if ids is None:
            return self.all()
        if not ids:
            return self.none()
        return self.filter(**{f"{self._tenant_path}__in": ids})

    def for_tenant(self, tenant_id: int) -> TenantScopedQuerySet:
        return self.filter(**{self._tenant_path: tenant_id})


def principal_for_user(user) -> Principal:
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return ANONYMOUS
    from .models import Membership, Tenant

    rows = Membership.objects.filter(user=user).values_list("tenant_id", "role", "tenant__status")
    roles = {t: r for t, r, _ in rows}
    suspended = frozenset(t for t, _, s in rows if s != Tenant.Status.ACTIVE)
    return Principal(user=user, is_operator=user.is_operator, roles=roles, suspended=suspended)


def principal_for_key(key) -> Principal:
    creator = key.created_by
    is_operator = key.tenant_id is None and creator is not None and creator.is_operator
    suspended: frozenset[int] = frozenset()
    if key.tenant_id is not None and key.tenant.status != key.tenant.Status.ACTIVE:
        suspended = frozenset({key.tenant_id})
    return Principal(
        api_key=key,
        is_operator=is_operator,
        key_tenant_id=key.tenant_id,
        scopes=frozenset(key.scopes),
        suspended=suspended,
    )


def _site_url(request) -> str:
    try:
        return request.build_absolute_uri("/").rstrip("/")
    except Exception:  # DisallowedHost and the like: no link base from this request
        return ""


def principal_for(request) -> Principal:
    """The principal of a Django or DRF request, computed once and cached on the request."""
    django_request = getattr(request, "_request", request)
    cached = getattr(django_request, "_tessera_principal", None)
    if cached is not None:
        return cached
    from .models import ApiKey

    auth = getattr(request, "auth", None)
    if isinstance(auth, ApiKey):
        principal = principal_for_key(auth)
    else:
        principal = principal_for_user(getattr(request, "user", None))
    if principal.is_authenticated:
        principal = replace(principal, site_url=_site_url(django_request))
    django_request._tessera_principal = principal
    return principal
