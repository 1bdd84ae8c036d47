"""Roles, capabilities and API-key scopes. One table (``CAPABILITIES``) says what each role may do;
``Principal.tenant_ids`` in ``tenants.scoping`` reads it, and every check in the code goes through
``Principal.can`` / ``tenant_ids`` / ``visible_to``, which reject an unknown capability name."""

from __future__ import annotations

from enum import StrEnum

from django.db import models


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    BILLING = "billing", "Billing"
    VIEWER = "viewer", "Viewer"


class Capability(StrEnum):
    """Every capability a check may name. Members are strings, so ``"read" == Capability.READ``."""

    READ = "read"
    MANAGE_TENANT = "manage_tenant"
    MANAGE_MEMBERS = "manage_members"
    MANAGE_KEYS = "manage_keys"
    BILLING = "billing"
    DEPLOY = "deploy"
    INFER = "infer"
    AUDIT = "audit"
    REFRESH_BILLING = "refresh_billing"
    USAGE = "usage"  # operators only (and operator keys with usage:write)
    OPERATE = "operate"  # operators only: the fleet, offers, tiers, every tenant


def capability(name: str) -> Capability:
    """``name`` as a :class:`Capability`; raises ``ValueError`` for a name that is none (a misspelt
    ``can("opertae")`` must fail, not be granted to every operator)."""
    try:
        return Capability(name)
    except ValueError:
        raise ValueError(f"unknown capability {name!r}; known: {', '.join(Capability)}") from None


# Capabilities: read (see the tenant's objects), manage_tenant (edit the tenant profile),
# manage_members (invite, change roles, remove), manage_keys (create/revoke API keys),
# billing (invoices, usage, spend), deploy (order slices, deploy models), infer (call the tenant's models through
# the inference gateway), audit (read the tenant's audit log), refresh_billing (re-rate a draft invoice now: a
# write, so no API-key scope grants it; billing:read keys only read). Reporting usage ("usage") is no tenant's
# capability: Tessera bills what its gateway served; only operators (and operator keys with usage:write, for an
# MSP-run external gateway) may post usage events. Operators hold every capability ("operate" included).
CAPABILITIES: dict[str, frozenset[str]] = {
    Role.OWNER: frozenset({"read", "manage_tenant", "manage_members", "manage_keys", "billing", "deploy", "infer",
                           "audit", "refresh_billing"}),
    Role.ADMIN: frozenset({"read", "manage_tenant", "manage_members", "manage_keys", "billing", "deploy", "infer",
                           "audit", "refresh_billing"}),
    Role.MEMBER: frozenset({"read", "deploy", "infer"}),
    Role.BILLING: frozenset({"read", "billing", "refresh_billing"}),
    Role.VIEWER: frozenset({"read"}),
}


class Scope(models.TextChoices):
    """API-key scopes. A key may do exactly what its scopes name, on its own tenant."""

    READ = "read", "Read the tenant's objects"
    USAGE_WRITE = "usage:write", "Report usage events (operator keys only: an MSP-run external gateway)"
    BILLING_READ = "billing:read", "Read usage summaries and invoices"
    DEPLOYMENTS_WRITE = "deployments:write", "Order slices and deploy models"
    INFERENCE = "inference", "Call the tenant's models through the inference gateway"


# Scopes only an operator key (no tenant) may carry.
OPERATOR_ONLY_SCOPES = frozenset({"usage:write"})


# Which capability each scope grants to a key (keys never manage members, keys or the tenant).
SCOPE_CAPABILITY = {
    Scope.READ: "read",
    Scope.USAGE_WRITE: "usage",
    Scope.BILLING_READ: "billing",
    Scope.DEPLOYMENTS_WRITE: "deploy",
    Scope.INFERENCE: "infer",
}


# Every name in the tables above is a Capability (checked at import).
for _name in {c for caps in CAPABILITIES.values() for c in caps} | set(SCOPE_CAPABILITY.values()):
    capability(_name)
