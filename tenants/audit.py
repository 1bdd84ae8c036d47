"""The audit log: ``record(principal, action, target, tenant=None, **detail)``.

Called by the service functions (tenants.services, marketplace.services.offers/orders/billing)
inside their transaction, so an action and its audit row commit or roll back together.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from .models import AuditEvent


def actor_of(principal) -> tuple[str, Any]:
    if principal is None:
        return "system", None
    if isinstance(principal, str):
        return principal, None
    if getattr(principal, "api_key", None) is not None:
        key = principal.api_key
        return f"key:{key.prefix}", getattr(key, "created_by", None)
    if getattr(principal, "user", None) is not None:
        return f"user:{principal.user.email}", principal.user
    return "anonymous", None


def _jsonable(detail: dict) -> dict:
    return json.loads(json.dumps(detail, cls=DjangoJSONEncoder, default=str))


def record(principal, action: str, target: Any = "", tenant=None, **detail) -> AuditEvent:
    """principal: a Principal, None (the system) or an actor string like "system:beat"."""
    actor, user = actor_of(principal)
    tenant_id = tenant if isinstance(tenant, int) or tenant is None else tenant.pk
    return AuditEvent.objects.create(actor=actor[:254], actor_user=user if getattr(user, "pk", None) else None,
                                     tenant_id=tenant_id, action=action, target=str(target)[:254],
                                     detail=_jsonable(detail))
