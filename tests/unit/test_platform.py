"""Platform: schema and docs served without CDNs, services reachable, query counts flat."""

from __future__ import annotations

import os

import pytest
from django.db import connection

from tests.factories import MembershipFactory, TenantFactory, make_key

pytestmark = pytest.mark.django_db


def test_openapi_schema_and_docs(api):
    r = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    for p in ["/api/v1/tenants/", "/api/v1/api-keys/", "/api/v1/memberships/", "/api/v1/invitations/accept/"]:
        assert p in paths
    docs = api.get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    assert "/static/drf_spectacular_sidecar/" in html
    assert "cdn" not in html.lower() and "https://" not in html.split("<body")[1]


def test_database_and_redis_are_the_configured_ones(settings):
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith("postgres"):
        assert connection.vendor == "postgresql"
    if os.environ.get("REDIS_URL"):
        from django.core.cache import cache

        assert "redis" in settings.CACHES["default"]["BACKEND"].lower()
        cache.set("tessera:ci:ping", "pong", 10)
        assert cache.get("tessera:ci:ping") == "pong"


@pytest.mark.parametrize("url", ["/api/v1/tenants/", "/api/v1/memberships/", "/api/v1/api-keys/",
                                 "/api/v1/invitations/"])
def test_list_query_count_does_not_grow_with_rows(as_user, operator, django_assert_max_num_queries, url):
    from tenants import services
    from tenants.scoping import principal_for_user

    def add(n):
        for _ in range(n):
            t = TenantFactory()
            MembershipFactory(tenant=t)
            make_key(t)
            services.invite(principal_for_user(operator), tenant=t, email=f"x@{t.slug}.example", send=False)

    api = as_user(operator)
    add(2)
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as few:
        assert api.get(url).status_code == 200
    add(10)
    with CaptureQueriesContext(connection) as many:
        assert api.get(url).status_code == 200
    assert len(many) == len(few), (len(few), len(many))
