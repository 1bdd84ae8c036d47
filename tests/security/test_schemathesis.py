"""Schema fuzzing: schemathesis over /api/schema/ against a live server, as a tenant API key (all
scopes) and as an operator API key. Checks: no 5xx (not_a_server_error), every answer matches the
schema documented for its status (response_schema_conformance) and every status is documented
(status_code_conformance: the error answers come from marketplace/api/schema.py, so an error the
schema does not document fails here).

Each operation is fuzzed twice when its path has parameters: once with generated values (nearly
always a 404) and once with the parameters pinned to objects seeded for the run (a tenant with an
active slice, a deployment, usage, an invoice, an invitation, a webhook...), so the answers of real
objects (200/202/400/403/409) are checked too. Collections without a seeded object (e.g. an endpoint
added later) get the first pass only.

Bounded (max_examples, derandomized, no deadline) so it runs in well under five minutes.
TESSERA_FUZZ_EXAMPLES=60 runs deeper; TESSERA_FUZZ_MODE=negative generates inputs that violate the schema."""

from __future__ import annotations

import os
import re

import pytest
from django.test import override_settings

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

from tests.factories import make_key  # noqa: E402
from tests.security.fuzz import fuzz_operation  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("TESSERA_FUZZ_EXAMPLES", "10"))
MODE = GenerationMode(os.environ.get("TESSERA_FUZZ_MODE", "positive"))
# Operations with external effects or that would tear down the fixture mid-run.
SKIP = {
    ("POST", "/api/v1/webhooks/"),  # would register endpoints that the delivery task POSTs to
}
# With generated ids these could hit the fuzzing principal's own key; pinned, they act on a spare key.
SKIP_UNPINNED = {
    ("POST", "/api/v1/api-keys/{id}/revoke/"),
    ("DELETE", "/api/v1/api-keys/{id}/"),
}
ALL_SCOPES = ["read", "billing:read", "deployments:write", "inference"]
STATS: dict[str, dict] = {}
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance]


def _schema(live_server):
    return schemathesis.openapi.from_url(f"{live_server.url}/api/schema/?format=json")


def _seed(operator, tiers):
    """The principals' keys, and an object of each collection for the pinned pass: {path prefix: params}."""
    from datetime import timedelta
    from decimal import Decimal

    from django.utils import timezone

    from marketplace.models import GpuInstance, MigProfile
    from marketplace.services import billing, deployments, offers, orders, provisioning, webhooks
    from telemetry.models import UsageHourly
    from telemetry.services import ingest
    from tenants import services
    from tenants.models import AuditEvent
    from tenants.roles import Role
    from tenants.scoping import principal_for_user
    from tests.factories import MembershipFactory, TenantFactory, UserFactory

    tenant = TenantFactory(slug="fuzz", name="Fuzz")
    owner = UserFactory(email="owner@fuzz.example")
    MembershipFactory(tenant=tenant, role=Role.OWNER, user=owner)
    viewer = MembershipFactory(tenant=tenant, role=Role.VIEWER, user=UserFactory(email="viewer@fuzz.example"))
    _, tenant_secret = make_key(tenant, ALL_SCOPES)
    _, op_secret = make_key(None, ALL_SCOPES, created_by=operator)
    spare_key, _ = make_key(tenant, ["read"], name="spare")

    owner_p, op_p = principal_for_user(owner), principal_for_user(operator)
    allocation = orders.create_order(owner_p, tenant=tenant, tier=tiers["1g"]).allocations.get()
    provisioning.provision(allocation.pk)
    allocation.refresh_from_db()
    dep = deployments.deploy(owner_p, allocation, "fuzz-gen", template="tiny-gen")
    deployments.load(dep.pk)
    ingest.ingest_batch(op_p, tenant, [{"event_id": "fuzz-1", "deployment": dep.pk, "input_tokens": 10,
                                           "output_tokens": 5, "ts": timezone.now().isoformat()}])
    invoice = billing.current_invoice(tenant)
    invitation, _ = services.invite(op_p, tenant=tenant, email="new@fuzz.example", send=False)
    plan = offers.add_price_plan(op_p, tier=tiers["1g"], currency="USD", price_per_slice_hour=Decimal("2.0000"),
                                 price_per_1m_input_tokens=Decimal("0.10"), price_per_1m_output_tokens=Decimal("0.40"),
                                 effective_from=timezone.now() + timedelta(days=30))
    with override_settings(TESSERA_WEBHOOK_ALLOW_NETWORKS=["127.0.0.1/32"]):  # a loopback target, on purpose
        hook = webhooks.create_endpoint(owner_p, tenant=tenant, url="http://127.0.0.1:9/hook",
                                        events=["spend_limit.warning"])
    instance = GpuInstance.objects.filter(tenant=tenant).select_related("gpu").first()
    pinned = {
        "/api/v1/tenants/": {"slug": tenant.slug},
        "/api/v1/memberships/": {"id": viewer.pk},
        "/api/v1/invitations/": {"id": invitation.pk},
        "/api/v1/api-keys/": {"id": spare_key.pk},
        "/api/v1/audit/": {"id": AuditEvent.objects.order_by("pk").first().pk},
        "/api/v1/catalog/gpu-models/": {"key": tiers["1g"].gpu_model.key},
        "/api/v1/catalog/mig-profiles/": {"id": MigProfile.objects.order_by("pk").first().pk},
        "/api/v1/catalog/platforms/": {"key": allocation.node.platform.key},
        "/api/v1/fleet/nodes/": {"id": allocation.node_id},
        "/api/v1/fleet/gpus/": {"id": instance.gpu_id},
        "/api/v1/fleet/instances/": {"id": instance.pk},
        "/api/v1/tiers/": {"key": tiers["1g"].key},
        "/api/v1/price-plans/": {"id": plan.pk},
        "/api/v1/orders/": {"id": allocation.order_id},
        "/api/v1/allocations/": {"id": allocation.pk},
        "/api/v1/deployments/": {"id": dep.pk},
        "/api/v1/usage/hourly/": {"id": UsageHourly.objects.get(tenant=tenant).pk},
        "/api/v1/invoices/": {"id": invoice.pk},
        "/api/v1/webhooks/": {"id": hook.pk},
        "/api/v1/charts/": {"name": "tenant-usage"},
    }
    return {"tenant": tenant_secret, "operator": op_secret}, pinned


def _collection(path: str) -> str:
    """/api/v1/allocations/{id}/release/ -> /api/v1/allocations/"""
    return re.split(r"\{", path, maxsplit=1)[0]


def _run(schema, base_url, secret, label, pinned):
    failures, cases = [], {"n": 0, "ops": 0, "pinned": 0}
    unseeded = set()

    def fuzz(op, path_parameters, tag):
        fuzz_operation(op, path_parameters, tag, base_url=base_url, secret=secret, checks=CHECKS,
                       max_examples=MAX_EXAMPLES, failures=failures, cases=cases, mode=MODE)

    for result in schema.get_all_operations():
        op = result.ok()
        method_path = (op.method.upper(), op.path)
        if method_path in SKIP:
            continue
        cases["ops"] += 1
        if method_path not in SKIP_UNPINNED:
            fuzz(op, None, "")
        if "{" in op.path:
            params = pinned.get(_collection(op.path))
            if params is None:
                unseeded.add(_collection(op.path))
                continue
            cases["pinned"] += 1
            fuzz(op, params, " [seeded]")
    STATS[label] = {"operations": cases["ops"], "pinned": cases["pinned"], "cases": cases["n"],
                    "failures": len(failures), "unseeded": sorted(unseeded)}
    print(f"\n[schemathesis] {label}: {cases['ops']} operations ({cases['pinned']} also on seeded objects), "
          f"{cases['n']} cases, {len(failures)} failing"
          + (f"; no seeded object for {', '.join(sorted(unseeded))}" if unseeded else ""))
    return failures


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("who", ["tenant", "operator"])
def test_api_fuzz(who, live_server, operator, h100_node, tiers, capsys):
    secrets, pinned = _seed(operator, tiers)
    schema = _schema(live_server)
    with capsys.disabled():
        failures = _run(schema, live_server.url, secrets[who], who, pinned)
    assert not failures, "\n".join(failures)
