"""The OpenAPI schema documents every operation's error answers (marketplace/api/schema.py), and the
documented bodies are the ones the API really sends: real error responses are validated against the
schema the operation documents for their status."""

from __future__ import annotations

import pytest
from django.db import OperationalError
from django.urls import path
from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants.roles import Role

pytestmark = pytest.mark.django_db

UNSAFE = {"post", "put", "patch", "delete"}
METHODS = {"get", "post", "put", "patch", "delete", "head", "options", "trace"}
# status -> (response component, body schema component(s))
EXPECTED = {
    "400": ("BadRequest", {"ValidationError"}),
    "401": ("Unauthorized", {"Error"}),
    "403": ("Forbidden", {"Error", "ValidationError"}),
    "404": ("NotFound", {"Error"}),
    "409": ("Conflict", {"ValidationError"}),
    "429": ("TooManyRequests", {"Error"}),
    "503": ("ServiceUnavailable", {"Error"}),
}


@pytest.fixture
def doc(api):
    r = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert r.status_code == 200
    return r.json()


def operations(doc):
    for p, item in doc["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield p, method, op


def resolve(doc, obj):
    while "$ref" in obj:
        node = doc
        for part in obj["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        obj = node
    return obj


def body_refs(schema) -> set[str]:
    """The component names a response body schema refers to (directly or through anyOf)."""
    if "$ref" in schema:
        return {schema["$ref"].rsplit("/", 1)[1]}
    return {name for sub in schema.get("anyOf", []) for name in body_refs(sub)}


def takes_input(op) -> bool:
    params = op.get("parameters", [])
    return ("requestBody" in op or any(p["in"] == "query" for p in params)
            or any(p["in"] == "path" and p["schema"].get("type") == "string" for p in params))


# --- every operation documents its errors ---------------------------------------------------------

def test_every_operation_documents_its_error_answers(doc):
    ops = list(operations(doc))
    assert len(ops) > 60
    problems = []
    for p, method, op in ops:
        responses = op["responses"]
        wanted = {"401", "403", "429", "503"}
        if takes_input(op) or method in UNSAFE:
            wanted.add("400")
        if "{" in p:
            wanted.add("404")
        if method in UNSAFE:
            wanted.add("409")
        if "requestBody" in op:
            wanted.add("415")
        for status in sorted(wanted):
            if status not in responses:
                problems.append(f"{method.upper()} {p}: {status} not documented")
                continue
            if status not in EXPECTED:
                continue
            component, bodies = EXPECTED[status]
            response = responses[status]
            if "$ref" in response:
                if response["$ref"] != f"#/components/responses/{component}":
                    problems.append(f"{method.upper()} {p}: {status} -> {response['$ref']}")
                response = resolve(doc, response)
            json_schema = response.get("content", {}).get("application/json", {}).get("schema", {})
            if not body_refs(json_schema) or not body_refs(json_schema) <= bodies:
                problems.append(f"{method.upper()} {p}: {status} body {json_schema}")
    assert not problems, "\n".join(problems)


def test_error_components_and_headers(doc):
    schemas, responses = doc["components"]["schemas"], doc["components"]["responses"]
    assert schemas["Error"]["required"] == ["detail"]
    assert schemas["ValidationError"]["properties"]["non_field_errors"]["items"] == {"type": "string"}
    assert responses["Unauthorized"]["headers"]["WWW-Authenticate"]["required"] is True
    assert "Retry-After" in responses["TooManyRequests"]["headers"]
    assert responses["ServiceUnavailable"]["headers"]["Retry-After"]["required"] is True
    for status, (component, bodies) in EXPECTED.items():
        assert body_refs(responses[component]["content"]["application/json"]["schema"]) == bodies, status


def test_success_statuses_of_async_actions_are_documented(doc):
    """release/retry and deleting a deployment answer 202 with the object (not 200 / 204)."""
    paths = doc["paths"]
    for p, method in [("/api/v1/allocations/{id}/release/", "post"), ("/api/v1/allocations/{id}/retry/", "post"),
                      ("/api/v1/deployments/{id}/", "delete")]:
        codes = paths[p][method]["responses"]
        assert "202" in codes and "200" not in codes and "204" not in codes, (p, sorted(codes))


def test_an_endpoint_added_later_gets_its_errors_without_annotating_them():
    """The errors come from the view (inputs, authentication, permissions, throttles), not a list of paths."""
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.utils import extend_schema
    from rest_framework import serializers

    class In(serializers.Serializer):
        n = serializers.IntegerField()

    class Later(APIView):
        @extend_schema(responses=In)
        def get(self, request, pk):
            return Response({"n": pk})

        @extend_schema(request=In, responses=In)
        def post(self, request, pk):
            In(data=request.data).is_valid(raise_exception=True)
            return Response(request.data)

    class LaterList(APIView):
        @extend_schema(responses=In(many=True))
        def get(self, request):
            return Response([])

    patterns = [path("api/v1/later/<int:pk>/", Later.as_view()), path("api/v1/later/", LaterList.as_view())]
    generated = SchemaGenerator(patterns=patterns).get_schema(request=None, public=True)
    later = generated["paths"]["/api/v1/later/{id}/"]  # drf-spectacular names pk "id"
    assert set(later["get"]["responses"]) >= {"401", "403", "404", "406", "429", "503"}
    assert "400" not in later["get"]["responses"]  # an integer id and no query: nothing to refuse
    assert set(later["post"]["responses"]) >= {"400", "401", "403", "404", "409", "429", "503"}
    listing = generated["paths"]["/api/v1/later/"]["get"]["responses"]
    assert "404" not in listing and "400" not in listing and "503" in listing
    assert generated["components"]["responses"]["NotFound"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"}


# --- the documented bodies are the real ones ------------------------------------------------------

def _validator(doc, schema):
    """A validator for `schema` as if it stood in the document, so that its "#/components/..." refs resolve."""
    contents = {**doc, "x-checked": schema}
    registry = Registry().with_resource("urn:openapi", Resource.from_contents(contents, default_specification=DRAFT7))
    return Draft7Validator({"$ref": "urn:openapi#/x-checked"}, registry=registry)


def check(doc, p, method, response, media_type="application/json"):
    """The response's status is documented for the operation and its body matches the documented schema."""
    documented = doc["paths"][p][method]["responses"]
    status = str(response.status_code)
    assert status in documented, (method, p, status, sorted(documented))
    declared = resolve(doc, documented[status])
    schema = declared["content"][media_type]["schema"]
    errors = [e.message for e in _validator(doc, schema).iter_errors(response.json())]
    assert not errors, (method, p, status, response.json(), errors)
    for name, header in declared.get("headers", {}).items():
        if header.get("required"):
            assert response.has_header(name), (method, p, status, name)
    return response.json()


def test_real_error_bodies_match_the_documented_components(doc, api, as_key, as_user, world, operator, members_a,
                                                           usage_key,
                                                           tiers, settings):
    key = world["secret_a"]
    # 404: another tenant's object, and a page past the end
    r = as_key(key).get(f"/api/v1/tenants/{world['b'].slug}/")
    assert r.status_code == 404
    assert set(check(doc, "/api/v1/tenants/{slug}/", "get", r)) == {"detail"}
    for listing in ["/api/v1/tenants/", "/api/v1/usage/metered-vs-served/"]:  # the latter paginates by hand
        r = as_key(key).get(f"{listing}?page=99")
        assert r.status_code == 404
        check(doc, listing, "get", r)
    # 400: field errors, nested field errors (list items by index), a filter, DRF's list-shaped search error
    r = as_key(key).post("/api/v1/orders/", {"tier": "nope", "quantity": 0}, format="json")
    assert r.status_code == 400
    assert {"tier", "quantity"} <= set(check(doc, "/api/v1/orders/", "post", r))
    r = as_user(members_a[Role.OWNER]).post("/api/v1/webhooks/", {"tenant": "alpha", "url": "https://h.example/",
                                                                   "events": ["invoice.finalized", "nope"]},
                                             format="json")
    assert r.status_code == 400
    assert check(doc, "/api/v1/webhooks/", "post", r)["events"] == {"1": ['"nope" is not a valid choice.']}
    r = as_key(key).get("/api/v1/invoices/?period_from=not-a-date")
    assert r.status_code == 400
    assert "period_from" in check(doc, "/api/v1/invoices/", "get", r)
    r = as_key(key).get("/api/v1/tenants/?search=a%00b")
    assert r.status_code == 400
    assert check(doc, "/api/v1/tenants/", "get", r) == {"non_field_errors": ["Null characters are not allowed."]}
    r = as_key(usage_key).post("/api/v1/usage/events/", "{not json", content_type="application/json")
    assert r.status_code == 400
    assert "detail" in check(doc, "/api/v1/usage/events/", "post", r)
    # 401: no credentials, and an unknown key; the challenge names the Bearer scheme
    api.credentials()
    r = api.get("/api/v1/me/")
    assert r.status_code == 401 and r["WWW-Authenticate"] == 'Bearer realm="api"'
    check(doc, "/api/v1/me/", "get", r)
    r = as_key("tsk_nope_nope").get("/api/v1/orders/")
    assert r.status_code == 401
    check(doc, "/api/v1/orders/", "get", r)
    # 403: a permission check ({"detail"}) and a service's refusal (field errors)
    r = as_key(world["secret_b"]).post("/api/v1/orders/", {"tier": "h100-1g"}, format="json")
    assert r.status_code == 403
    assert set(check(doc, "/api/v1/orders/", "post", r)) == {"detail"}
    r = as_user(members_a[Role.ADMIN]).post("/api/v1/invitations/",
                                            {"tenant": "alpha", "email": "x@alpha.example", "role": Role.OWNER},
                                            format="json")
    assert r.status_code == 403, r.content
    assert check(doc, "/api/v1/invitations/", "post", r) == {"role": ["only an owner can grant the owner role"]}
    # 409: a conflict names the field
    r = as_user(operator).post("/api/v1/tiers/", {"key": "h100-1g", "name": "again", "gpu_model": "h100-sxm-80gb"},
                               format="json")
    assert r.status_code == 409
    assert "key" in check(doc, "/api/v1/tiers/", "post", r)
    # 415 and 406
    r = as_key(key).generic("POST", "/api/v1/orders/", "tier=x", content_type="text/plain")
    assert r.status_code == 415
    check(doc, "/api/v1/orders/", "post", r)
    r = as_key(key).get("/api/v1/orders/", HTTP_ACCEPT="application/xml")
    assert r.status_code == 406
    check(doc, "/api/v1/orders/", "get", r)


def test_throttled_and_database_errors_match_the_documented_components(doc, as_key, world, settings, monkeypatch):
    settings.TESSERA_API_RATE = "1/min"
    api = as_key(world["secret_a"])
    assert api.get("/api/v1/me/").status_code == 200
    r = api.get("/api/v1/me/")
    assert r.status_code == 429 and int(r["Retry-After"]) > 0
    check(doc, "/api/v1/me/", "get", r)

    settings.TESSERA_API_RATE = ""
    from tenants.api import views

    def down(*args, **kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(views.MeView, "get", down)
    r = api.get("/api/v1/me/")
    assert r.status_code == 503 and r["Retry-After"] == "5"
    check(doc, "/api/v1/me/", "get", r)


# --- bugs the stricter fuzzing found --------------------------------------------------------------

@pytest.mark.parametrize("query, field", [
    ("hours=abc", "hours"), ("hours=nan", "hours"), ("hours=1e300", "hours"), ("hours=0", "hours"),
    ("end=2020-13-45T00:00:00", "end"), ("end=yesterday", "end"), ("start=nope", "start"),
])
def test_chart_parameters_are_field_errors_not_500(doc, as_user, operator, query, field):
    r = as_user(operator).get(f"/api/v1/charts/fleet-utilization/?{query}")
    assert r.status_code == 400, r.content
    body = check(doc, "/api/v1/charts/{name}/", "get", r)
    assert set(body) == {field} and isinstance(body[field], list)


def test_unknown_tenant_in_a_usage_batch_is_a_documented_404(doc, as_key, world, usage_key):
    r = as_key(usage_key).post("/api/v1/usage/events/", {"tenant": "nope", "events": []}, format="json")
    assert r.status_code == 404
    check(doc, "/api/v1/usage/events/", "post", r)
