"""factory_boy factories shared by the tests."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import factory
from django.contrib.auth.models import Permission
from django.utils import timezone

from tenants import keys
from tenants.models import ApiKey, Membership, Tenant, User
from tenants.roles import Role


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    email = factory.Sequence(lambda n: f"user{n}@example.com")
    full_name = factory.Faker("name")
    password = factory.django.Password("pw-Secret-123")


class OperatorFactory(UserFactory):
    is_staff = True

    @factory.post_generation
    def operate(self, create, extracted, **kwargs):
        if create:
            self.user_permissions.add(Permission.objects.get(codename="operate", content_type__app_label="tenants"))


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant

    name = factory.Sequence(lambda n: f"Tenant {n}")
    slug = factory.Sequence(lambda n: f"tenant-{n}")
    billing_email = factory.LazyAttribute(lambda o: f"billing@{o.slug}.example")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    tenant = factory.SubFactory(TenantFactory)
    role = Role.MEMBER


def make_key(tenant, scopes=("read",), *, expires_at=None, created_by=None, name="test key"):
    """An API key as the service makes it; returns (ApiKey, secret)."""
    secret, prefix, hashed = keys.generate()
    key = ApiKey.objects.create(tenant=tenant, name=name, prefix=prefix, hashed_key=hashed,
                                scopes=sorted(scopes), expires_at=expires_at, created_by=created_by)
    return key, secret


class OrderFactory(factory.django.DjangoModelFactory):
    """An order of `tier` (pass one: tiers need the catalog) for a tenant."""

    class Meta:
        model = "marketplace.Order"

    tenant = factory.SubFactory(TenantFactory)
    quantity = 1


class AllocationFactory(factory.django.DjangoModelFactory):
    """An active allocation of its order's tier and tenant (no instance: billing and charts need none)."""

    class Meta:
        model = "marketplace.Allocation"

    order = factory.SubFactory(OrderFactory)
    tenant = factory.SelfAttribute("order.tenant")
    tier = factory.SelfAttribute("order.tier")
    state = "active"
    activated_at = factory.LazyFunction(timezone.now)


class DeploymentFactory(factory.django.DjangoModelFactory):
    """A ready model on an allocation, its tenant's."""

    class Meta:
        model = "marketplace.ModelDeployment"

    allocation = factory.SubFactory(AllocationFactory)
    tenant = factory.SelfAttribute("allocation.tenant")
    name = factory.Sequence(lambda n: f"model-{n}")
    backend = "python"
    spec = factory.LazyFunction(dict)
    memory_mb = 1000
    state = "ready"


class InvoiceFactory(factory.django.DjangoModelFactory):
    """A draft invoice of a tenant's month (period_start: the first of a month)."""

    class Meta:
        model = "marketplace.Invoice"

    tenant = factory.SubFactory(TenantFactory)
    period_start = factory.LazyFunction(lambda: timezone.now().date().replace(day=1))
    period_end = factory.LazyAttribute(lambda o: (o.period_start.replace(day=28) + timedelta(days=4)).replace(day=1))
    currency = factory.SelfAttribute("tenant.currency")


def validated(obj):
    """An uploaded model repository or LoRA adapter after its validation by the control worker
    (``tessera.validate_repository`` / ``tessera.validate_adapter``), run in-line here; refreshed."""
    from marketplace.models import LoraAdapter
    from marketplace.services import models as model_svc

    model_svc.validate("adapter" if isinstance(obj, LoraAdapter) else "repository", obj.pk)
    obj.refresh_from_db()
    return obj


class PricePlanFactory(factory.django.DjangoModelFactory):
    """A price plan of `tier` (pass one) in force from `effective_from` (default: a day ago); a reserved plan gets
    a monthly commitment unless one is given."""

    class Meta:
        model = "marketplace.PricePlan"

    kind = "on_demand"
    currency = "USD"
    price_per_slice_hour = Decimal("2.0000")
    price_per_1m_input_tokens = Decimal("0.5000")
    price_per_1m_output_tokens = Decimal("1.5000")
    monthly_commit = factory.LazyAttribute(lambda o: Decimal("1000.00") if o.kind == "reserved" else None)
    effective_from = factory.LazyFunction(lambda: timezone.now() - timedelta(days=1))


class UsageHourlyFactory(factory.django.DjangoModelFactory):
    """An hour of a deployment's usage, its tenant's (pass `hour`: the start of a UTC hour)."""

    class Meta:
        model = "telemetry.UsageHourly"

    deployment = factory.SubFactory(DeploymentFactory)
    tenant = factory.SelfAttribute("deployment.tenant")
    input_tokens = 0
    output_tokens = 0
    requests = 0


class InvoiceLineFactory(factory.django.DjangoModelFactory):
    """A line of an invoice (pass `tier`; its plan is a plan of that tier unless given)."""

    class Meta:
        model = "marketplace.InvoiceLine"

    invoice = factory.SubFactory(InvoiceFactory)
    kind = "slice_hours"
    plan = factory.SubFactory(PricePlanFactory, tier=factory.SelfAttribute("..tier"))
    description = factory.Sequence(lambda n: f"line {n}")
    quantity = Decimal("1.000000")
    unit = "hour"
    unit_price = Decimal("1.0000")
    amount = Decimal("1.00")
    usage_from = factory.LazyAttribute(lambda o: timezone.now() - timedelta(hours=1))
    usage_to = factory.LazyFunction(timezone.now)


class CreditNoteFactory(factory.django.DjangoModelFactory):
    """A credit note of a (finalized) invoice, its tenant's and in its currency."""

    class Meta:
        model = "marketplace.CreditNote"

    invoice = factory.SubFactory(InvoiceFactory)
    tenant = factory.SelfAttribute("invoice.tenant")
    currency = factory.SelfAttribute("invoice.currency")
    number = factory.Sequence(lambda n: f"CN-2026-{n + 1:06d}")
    total = Decimal("1.00")
    reason = "correction"
    issued_by = "user:op@msp.example"
