"""Capabilities are names checked against ``tenants.roles.Capability``: a misspelt one raises, it is never
granted (an operator holds every known capability, none that does not exist)."""

import pytest

from tenants.roles import CAPABILITIES, Capability, Role, capability
from tenants.scoping import Principal


def test_known_names_are_capabilities():
    assert capability("operate") is Capability.OPERATE
    assert {c for caps in CAPABILITIES.values() for c in caps} <= set(Capability)


@pytest.mark.parametrize(
    "principal",
    [
        Principal(user=object(), is_operator=True),
        Principal(user=object(), roles={1: Role.OWNER}),
        Principal(api_key=object(), key_tenant_id=1, scopes=frozenset({"read"})),
    ],
    ids=["operator", "owner", "tenant key"],
)
def test_misspelt_capability_raises(principal):
    with pytest.raises(ValueError, match="opertae"):
        principal.can("opertae")
    with pytest.raises(ValueError, match="opertae"):
        principal.tenant_ids("opertae")


def test_operator_still_holds_every_known_capability():
    op = Principal(user=object(), is_operator=True)
    assert all(op.can(c) for c in Capability)
    owner = Principal(user=object(), roles={1: Role.OWNER})
    assert owner.can("deploy", 1) and not owner.can("operate")
