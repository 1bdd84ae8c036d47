"""factory_boy factories shared by the tests."""

from __future__ import annotations

import factory
from django.contrib.auth.models import Permission

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
