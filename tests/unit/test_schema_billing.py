"""The schema as an integrator reads it (issue 14): billing answers have bodies, errors are JSON even for a
CSV export, /api/v1/charts/ is listed, each operation names the API-key scheme once, and PATCH on a
tenant does not offer the slug."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


@pytest.fixture
def doc(api):
    r = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert r.status_code == 200
    return r.json()


def test_billing_answers_document_their_bodies(doc):
    for path in ("/api/v1/billing/usage/", "/api/v1/billing/spend/", "/api/v1/invoices/{id}/export/"):
        ok = doc["paths"][path]["get"]["responses"]["200"]
        assert "content" in ok and "$ref" in ok["content"]["application/json"]["schema"], path
    assert "text/csv" in doc["paths"]["/api/v1/invoices/{id}/export/"]["get"]["responses"]["200"]["content"]


def test_errors_are_documented_as_json_even_for_the_csv_export(doc):
    for status, answer in doc["paths"]["/api/v1/invoices/{id}/export/"]["get"]["responses"].items():
        if status != "200":
            assert answer == {"$ref": answer["$ref"]} and answer["$ref"].startswith("#/components/responses/")


def test_export_errors_are_json_when_csv_was_asked(world, as_key):
    r = as_key(world["secret_a"]).get("/api/v1/invoices/999999/export/?format=csv")
    assert r.status_code == 404 and r["Content-Type"].startswith("application/json")
    assert r.json()["detail"]


def test_charts_index_is_in_the_schema(doc, api):
    assert "/api/v1/charts/" in doc["paths"]
    assert "charts" in api.get("/api/v1/charts/").json()


def test_the_api_key_scheme_is_listed_once_per_operation(doc):
    twice = [(p, m) for p, ops in doc["paths"].items() for m, op in ops.items()
             if sum("ApiKey" in s for s in op.get("security", [])) > 1]
    assert twice == []
    assert "ApiKey" in doc["components"]["securitySchemes"]


def test_patch_tenant_does_not_document_the_slug_as_writable(doc):
    body = doc["paths"]["/api/v1/tenants/{slug}/"]["patch"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[1]
    assert "slug" not in doc["components"]["schemas"][name]["properties"]
