"""Demo seed data: a realistic small MSP. Idempotent; later domains add their own seed steps."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from decimal import Decimal

from django.contrib.auth.hashers import make_password
from django.contrib.auth.models import Permission
from django.db import transaction

from tenants import services
from tenants.models import ApiKey, Membership, Tenant, User
from tenants.roles import Role, Scope
from tenants.scoping import principal_for_user

OPERATOR_EMAIL = "operator@tessera.local"

TENANTS = [
    # slug, name, currency, spend limit, members [(email, role)]
    ("acme-ai", "Acme AI", "USD", Decimal("25000.00"),
     [("owner@acme.example", Role.OWNER), ("ml@acme.example", Role.MEMBER), ("ap@acme.example", Role.BILLING)]),
    ("borealis", "Borealis Labs", "EUR", Decimal("12000.00"),
     [("owner@borealis.example", Role.OWNER), ("ops@borealis.example", Role.ADMIN),
      ("intern@borealis.example", Role.VIEWER)]),
    ("cobalt-health", "Cobalt Health", "USD", Decimal("8000.00"),
     [("owner@cobalt.example", Role.OWNER), ("data@cobalt.example", Role.MEMBER)]),
    ("dynamo-search", "Dynamo Search", "GBP", None,
     [("owner@dynamo.example", Role.OWNER)]),
]


#: what the demo tenants' invoices and credit notes print (made-up companies and tax ids)
BILLING = {
    "acme-ai": ("Acme AI, Inc.", "100 Market Street\nSan Francisco, CA 94105\nUnited States", "US-12-3456789"),
    "borealis": ("Borealis Labs GmbH", "Torstraße 10\n10119 Berlin\nGermany", "DE123456789"),
    "cobalt-health": ("Cobalt Health LLC", "1 Harbor Way\nBoston, MA 02110\nUnited States", "US-98-7654321"),
    "dynamo-search": ("Dynamo Search Ltd", "20 Old Street\nLondon EC1V 9AB\nUnited Kingdom", "GB123456789"),
}


@dataclass
class SeedResult:
    operator_email: str
    operator_password: str
    user_password: str
    keys: dict[str, str] = field(default_factory=dict)  # tenant slug -> secret (new keys only)


@transaction.atomic
def seed_demo(operator_password: str | None = None, user_password: str | None = None) -> SeedResult:
    """Seed (or re-seed) the demo MSP. Passwords are new unless given (the demo command keeps the first run's)."""
    operator_password = operator_password or secrets.token_urlsafe(9)
    user_password = user_password or secrets.token_urlsafe(9)
    operator, _ = User.objects.get_or_create(email=OPERATOR_EMAIL, defaults={"full_name": "MSP Operator"})
    operator.is_staff = True
    operator.is_superuser = True
    operator.set_password(operator_password)
    operator.save()
    operator.user_permissions.add(Permission.objects.get(codename="operate", content_type__app_label="tenants"))
    operator = User.objects.get(pk=operator.pk)  # drop the permission cache
    op = principal_for_user(operator)
    result = SeedResult(OPERATOR_EMAIL, operator_password, user_password)
    user_hash = make_password(user_password)  # hash once: every demo tenant user shares it

    for slug, name, currency, limit, members in TENANTS:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            legal, address, tax_id = BILLING[slug]
            tenant = services.create_tenant(
                op, slug=slug, name=name, currency=currency, billing_email=f"billing@{slug}.example",
                monthly_spend_limit=limit, billing_legal_name=legal, billing_address=address, billing_tax_id=tax_id,
            )
        for email, role in members:
            user, _ = User.objects.get_or_create(email=email, defaults={"full_name": email.split("@")[0].title()})
            user.password = user_hash
            user.save(update_fields=["password"])
            Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": role})
        if not ApiKey.objects.filter(tenant=tenant, name="inference gateway").exists():
            _key, secret = services.create_api_key(
                op, tenant=tenant, name="inference gateway",
                scopes=[Scope.INFERENCE, Scope.READ, Scope.BILLING_READ, Scope.DEPLOYMENTS_WRITE],
            )
            result.keys[slug] = secret
    return result
