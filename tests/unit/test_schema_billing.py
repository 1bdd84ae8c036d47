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


def test_the_schema_is_a_valid_openapi_document(doc):
    """openapi-spec-validator (dev extra) accepts /api/schema/: CI runs it with the tests. (It refused the schema
    while DeploymentRequest.declared_memory_mb documented a default of 0 below its minimum of 1.)"""
    from openapi_spec_validator import validate

    validate(doc)


JSON_EXPORTS = ("/api/v1/invoices/{id}/export/", "/api/v1/credit-notes/{id}/export/")
CSV_EXPORTS = ("/api/v1/invoices/{id}/export/csv/", "/api/v1/credit-notes/{id}/export/csv/")


def test_billing_answers_document_their_bodies(doc):
    for path in ("/api/v1/billing/usage/", "/api/v1/billing/spend/", *JSON_EXPORTS):
        ok = doc["paths"][path]["get"]["responses"]["200"]
        assert "content" in ok and "$ref" in ok["content"]["application/json"]["schema"], path


def test_each_export_documents_the_one_media_type_it_answers(doc):
    """A generated client reads a 200 by its (first) media type: JSON exports say application/json only (and offer
    no `format` that would make them answer CSV), CSV exports text/csv only, a string."""
    for path in JSON_EXPORTS:
        op = doc["paths"][path]["get"]
        assert list(op["responses"]["200"]["content"]) == ["application/json"], path
        assert "format" not in [p["name"] for p in op.get("parameters", [])], path
    for path in CSV_EXPORTS:
        ok = doc["paths"][path]["get"]["responses"]["200"]
        assert ok["content"] == {"text/csv": {"schema": {"type": "string"}}} and ok["description"], path


def test_errors_are_documented_as_json_even_for_the_csv_export(doc):
    for path in (*JSON_EXPORTS, *CSV_EXPORTS):
        for status, answer in doc["paths"][path]["get"]["responses"].items():
            if status != "200":
                assert answer == {"$ref": answer["$ref"]} and answer["$ref"].startswith("#/components/responses/")


def test_export_errors_are_json_when_csv_was_asked(world, as_key):
    api = as_key(world["secret_a"])
    for url in ("/api/v1/invoices/999999/export/?format=csv", "/api/v1/invoices/999999/export/csv/",
                "/api/v1/credit-notes/999999/export/csv/"):
        r = api.get(url)
        assert r.status_code == 404 and r["Content-Type"].startswith("application/json"), url
        assert r.json()["detail"]
    r = api.get("/api/v1/invoices/999999/export/csv/", HTTP_ACCEPT="application/json")  # CSV cannot be JSON
    assert r.status_code == 406 and r["Content-Type"].startswith("application/json") and r.json()["detail"]


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
