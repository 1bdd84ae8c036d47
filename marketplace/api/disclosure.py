"""What a tenant may read about the fleet: its own slices, never the fleet's internals.

Node hostnames, GPU UUIDs and ids, placement starts, GPU-instance and compute-instance ids and the
placement engine's diagnostics (which name GPU and node ids, fleet sizes and how many GPUs other
tenants hold) are for MSP operators. A serializer lists such fields in ``operator_only`` with the
value everyone else gets instead (the field stays in the response, so the schema holds for both).
A serializer without a request in its context treats the reader as a tenant. Filters by such fields are
``marketplace.filters.OperatorOnlyFiltersMixin``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tenants.scoping import principal_for


def reader_is_operator(context: Mapping[str, Any] | None) -> bool:
    """Operators read the fleet's internals; anyone else, and any doubt (no request, a principal that
    cannot be worked out, e.g. while the database is down), reads what tenants read."""
    request = (context or {}).get("request")
    if request is None:
        return False
    try:
        return principal_for(request).is_operator
    except Exception:  # an answer (an error answer too) must not fail on the principal
        return False


class OperatorOnlyFieldsMixin:
    #: field name -> the value a non-operator reads instead
    operator_only: ClassVar[dict[str, Any]] = {}

    def to_representation(self, instance):
        data = super().to_representation(instance)
        if self.operator_only and not reader_is_operator(self.context):
            for name, value in self.operator_only.items():
                if name in data:
                    data[name] = value
        return data

