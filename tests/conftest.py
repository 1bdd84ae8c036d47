from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tenants.roles import Role
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory, UserFactory, make_key

pytest_plugins = ["tests.fleet_fixtures", "tests.serving_fixtures", "tests.gateway_fixtures"]

ROLES = [Role.OWNER, Role.ADMIN, Role.MEMBER, Role.BILLING, Role.VIEWER]


@pytest.fixture(autouse=True, scope="session")
def _static_files_uncollected(tmp_path_factory):
    """Tests see the static files as a fresh checkout serves them (their own names, from the finders), whatever a
    demo run left collected in var/static: with its manifest there, pages name the hashed copies, and tests that
    look for a file's own name would pass or fail by the order the README's two commands were run in."""
    from django.conf import settings
    from django.test.signals import setting_changed

    root = str(tmp_path_factory.mktemp("static-root"))
    old, settings.STATIC_ROOT = settings.STATIC_ROOT, root
    setting_changed.send(sender=type(settings), setting="STATIC_ROOT", value=root, enter=True)
    yield
    settings.STATIC_ROOT = old
    setting_changed.send(sender=type(settings), setting="STATIC_ROOT", value=old, enter=False)


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Rate-limit and login-lockout counters live in the cache: each test starts with none."""
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def operator(db):
    return OperatorFactory(email="op@msp.example")


@pytest.fixture
def tenant_a(db):
    return TenantFactory(slug="alpha", name="Alpha")


@pytest.fixture
def tenant_b(db):
    return TenantFactory(slug="bravo", name="Bravo")


@pytest.fixture
def members_a(tenant_a):
    """One user of each role in tenant A: {role: user}."""
    return {r: MembershipFactory(tenant=tenant_a, role=r, user=UserFactory(email=f"{r}@alpha.example")).user
            for r in ROLES}


@pytest.fixture
def world(tenant_a, tenant_b, members_a, operator):
    """Two tenants with members, keys and an invitation each."""
    from tenants import services
    from tenants.scoping import principal_for_user

    owner_b = MembershipFactory(tenant=tenant_b, role=Role.OWNER, user=UserFactory(email="owner@bravo.example")).user
    op = principal_for_user(operator)
    inv_a, _ = services.invite(op, tenant=tenant_a, email="new@alpha.example", send=False)
    inv_b, _ = services.invite(op, tenant=tenant_b, email="new@bravo.example", send=False)
    key_a, secret_a = make_key(tenant_a, ["read", "billing:read", "usage:write", "deployments:write"])
    key_b, secret_b = make_key(tenant_b, ["read"])
    return {
        "a": tenant_a, "b": tenant_b, "owner_b": owner_b, "inv_a": inv_a, "inv_b": inv_b,
        "key_a": key_a, "secret_a": secret_a, "key_b": key_b, "secret_b": secret_b,
    }


@pytest.fixture
def usage_key(operator):
    """An operator key with usage:write (an MSP-run external gateway): the only kind that reports usage."""
    return make_key(None, ["usage:write"], created_by=operator)[1]


@pytest.fixture
def as_user(api):
    def login(user):
        api.credentials()
        api.force_login(user)
        return api
    return login


@pytest.fixture
def as_key(api):
    def use(secret):
        api.logout()
        api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        return api
    return use


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
