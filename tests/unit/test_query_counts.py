"""NetBox-style query counts: every API list route and every console/portal list page (a GET without
path parameters) makes the same number of queries with one object of each kind as with four. A page
whose count grows with the data has an N+1 query."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace.models import (
    Allocation,
    CreditNote,
    DriftEvent,
    Invoice,
    InvoiceLine,
    ModelDeployment,
    PricePlan,
    SpendNotice,
    WebhookDelivery,
    WebhookEndpoint,
)
from marketplace.services import orders
from telemetry.models import UsageEvent, UsageHourly
from tenants.models import AuditEvent, Invitation
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, UserFactory, make_key
from tests.security.test_isolation_matrix import endpoints

pytestmark = pytest.mark.django_db

#: GETs without path parameters that are not list pages (or do heavy work that is not a list: the planner
#: solves a MILP) are left out; everything else under these prefixes is measured.
PREFIXES = ("api/v1/", "console/", "portal/")
SKIP = {"api/v1/planner/", "api/v1/planner/inputs/", "console/planner/", "api/v1/usage/events/",
        "api/v1/invitations/accept/", "portal/models/new/", "portal/keys/new/", "portal/members/invite/"}


def list_routes() -> list[str]:
    out = []
    for ep in endpoints():
        route = ep.route.replace("^", "").replace("$", "")
        if ep.kwargs or not route.startswith(PREFIXES) or route in SKIP or "(?P" in route:
            continue
        if "GET" in ep.methods() or ep.actions is None:
            out.append("/" + route)
    return sorted(set(out))


def seed(n: int, k0: int, world, node, tier, owner, operator) -> None:
    """n more objects of every kind for tenant A (numbered from k0)."""
    a = world["a"]
    p = principal_for_user(owner)
    plan = PricePlan.objects.filter(tier=tier).first()
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    for k in range(k0, k0 + n):
        order = orders.create_order(p, tenant=a, tier=tier)
        alloc = order.allocations.get()
        Allocation.objects.filter(pk=alloc.pk).update(state=Allocation.State.ACTIVE, activated_at=timezone.now())
        dep = ModelDeployment.objects.create(allocation=alloc, tenant=a, name=f"m{k}", backend="python", spec={},
                                             memory_mb=10, state="ready", created_at=hour - timedelta(days=1))
        UsageHourly.objects.create(tenant=a, deployment=dep, hour=hour, input_tokens=10, output_tokens=5, requests=1)
        UsageEvent.objects.create(tenant=a, deployment=dep, event_id=f"e{k}", ts=hour, input_tokens=10,
                                  output_tokens=5)
        month = date(2025, 1 + k, 1)
        inv = Invoice.objects.create(tenant=a, period_start=month, period_end=date(2025, 2 + k, 1), currency="USD",
                                     total=Decimal("1.00"), rated_at=timezone.now())
        InvoiceLine.objects.create(invoice=inv, kind="slice_hours", tier=tier, plan=plan, allocation=alloc,
                                   description="x", quantity=Decimal(1), unit="hour", unit_price=Decimal(1),
                                   amount=Decimal("1.00"), usage_from=datetime(2025, 1, 1, tzinfo=UTC),
                                   usage_to=datetime(2025, 1, 2, tzinfo=UTC))
        CreditNote.objects.create(tenant=a, invoice=inv, number=f"CN-2025-{k:06d}", currency="USD",
                                  total=Decimal("1.00"), reason="r", issued_by="user:op", recharged_on=inv)
        ep = WebhookEndpoint.objects.create(tenant=a, url=f"https://h{k}.example/", secret="s",
                                            events=["invoice.finalized"])
        WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key=f"k{k}", payload={})
        MembershipFactory(tenant=a, role=Role.VIEWER, user=UserFactory(email=f"v{k}@alpha.example"))
        make_key(a, ["read"], name=f"key {k}")
        Invitation.objects.create(tenant=a, email=f"i{k}@alpha.example", role=Role.MEMBER, token_hash=f"h{k}",
                                  expires_at=timezone.now() + timedelta(days=3))
        AuditEvent.objects.create(tenant=a, actor="user:x", action=f"thing.{k}", target="t")
        SpendNotice.objects.create(tenant=a, period_start=month, level="warn", spend=1, limit=2)
        DriftEvent.objects.create(node=node, kind="adopted", detail=f"d{k}")


def count(client, url) -> tuple[int, int]:
    with CaptureQueriesContext(connection) as q:
        r = client.get(url)
    return r.status_code, len(q.captured_queries)


def test_list_routes_and_pages_make_a_constant_number_of_queries(world, members_a, operator, h100_node, tiers,
                                                                  as_user):
    owner = members_a[Role.OWNER]
    routes = list_routes()
    assert len(routes) > 30
    seed(1, 0, world, h100_node, tiers["1g"], owner, operator)
    from django.test import Client

    op, ten = Client(), Client()
    op.force_login(operator)
    ten.force_login(owner)
    who = {r: (ten if r.startswith("/portal/") else op) for r in routes}
    for r in routes:  # warm caches (content types, sessions, rate-limit buckets) before measuring
        who[r].get(r)
    small = {r: count(who[r], r) for r in routes}
    seed(3, 1, world, h100_node, tiers["1g"], owner, operator)
    large = {r: count(who[r], r) for r in routes}
    broken = {r: s for r, s in small.items() if s[0] >= 500}
    assert not broken
    grows = {r: (small[r][1], large[r][1]) for r in routes if large[r][1] > small[r][1]}
    assert not grows, f"queries grow with the data (1 object -> 4): {grows}"
