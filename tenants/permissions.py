"""DRF permission that applies the tenant model: capabilities per action, scopes for keys.

Views declare what each action needs::

    capabilities = {"list": "read", "retrieve": "read", "create": "manage_keys", "destroy": "manage_keys"}

Unlisted safe actions need "read"; unlisted unsafe actions need "manage_tenant". Querysets are
filtered by ``visible_to``, so a foreign object is a 404 for every method; an own object that the
principal may see but not change gives 403.
"""

from __future__ import annotations

from rest_framework import permissions

from .roles import Capability
from .scoping import principal_for


def required_capability(view, request) -> str:
    action = getattr(view, "action", None) or request.method.lower()
    caps = getattr(view, "capabilities", {})
    if action in caps:
        return caps[action]
    return "read" if request.method in permissions.SAFE_METHODS else "manage_tenant"


def object_tenant_id(obj) -> int | None:
    """The tenant an object belongs to; None for shared objects (catalog, fleet, tiers), for which the
    capability itself decides (e.g. only operators hold "operate")."""
    path = getattr(type(obj), "tenant_path", None)
    if path is None:
        return None
    value = obj
    for part in path.replace("__", ".").split("."):
        value = getattr(value, part)
    return value


class TenantAccess(permissions.BasePermission):
    message = "Your role or API-key scopes do not allow this."

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        principal = principal_for(request)
        lookup = getattr(view, "lookup_url_kwarg", None) or getattr(view, "lookup_field", None)
        if lookup and lookup in getattr(view, "kwargs", {}):
            # Detail route: the object decides. A foreign object is absent from the scoped queryset
            # (404); an own object the principal may not change is a 403 in has_object_permission.
            return principal.can("read") or principal.can(required_capability(view, request))
        return principal.can(required_capability(view, request))

    def has_object_permission(self, request, view, obj) -> bool:
        return principal_for(request).can(required_capability(view, request), object_tenant_id(obj))


#: What lets a principal read the shared catalog, tiers and price plans: a key that only reports usage
#: (scope usage:write) does not.
SHARED_READ_CAPABILITIES = (Capability.READ, Capability.BILLING, Capability.DEPLOY)


class SharedRead(permissions.BasePermission):
    """Shared objects (catalog, tiers, price plans): any principal holding read, billing or deploy on
    some tenant (every role; keys with scope read, billing:read or deployments:write), and operators."""

    message = "Your API-key scopes do not allow reading the catalog and prices (scope read, billing:read or " \
              "deployments:write)."

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        p = principal_for(request)
        return p.is_operator or any(p.can(c) for c in SHARED_READ_CAPABILITIES)
