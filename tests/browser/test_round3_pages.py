"""The pages issue 34 changed, at 1440 and 390 px: nodes (state, port pool, edit), the node form, the audit log,
the planner with a plan, the power cost chart and find-a-tier. Each fits its width; screenshots go to
test-artifacts/screenshots/round3-*.png for a reviewer."""

from __future__ import annotations

import pytest

from tenants.models import AuditEvent
from tenants.roles import Role
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_node, make_tier

pytestmark = pytest.mark.django_db(transaction=True)

PLAN = ("plan=1&w-TOTAL_FORMS=1&w-INITIAL_FORMS=0&w-0-name=chat&w-0-tokens_per_s=20000&w-0-min_memory_gib=30"
        "&target_utilization=70&growth=1&window_days=7&price_per_kwh=0.12&currency=USD&gpu_models=h100-sxm-80gb")


def test_round3_pages_fit_a_phone_and_a_desktop(page, login, live_server, catalog, sim_dir, shot):
    node = make_node("gpu-h100-edge-07")
    for key, profile in (("h100-1g", "1g.10gb"), ("h100-3g", "3g.40gb"), ("h100-7g", "7g.80gb")):
        make_tier(key, "h100-sxm-80gb", profile)
    op = OperatorFactory(email="op@msp.example")
    tenant = TenantFactory(slug="alpha", name="Alpha Labs")
    owner = UserFactory(email="owner@alpha.example")
    MembershipFactory(tenant=tenant, user=owner, role=Role.OWNER)
    AuditEvent.objects.create(actor="user:op@msp.example", action="api_key.create", target="key:abc", tenant=tenant,
                              detail={"scopes": ["read", "inference"], "expires": None, "forced": False})
    operator_pages = [("nodes", "/console/nodes/"), ("node-edit", f"/console/nodes/{node.pk}/edit/"),
                      ("audit", "/console/audit/"), ("planner", f"/console/planner/?{PLAN}"),
                      ("power-cost", "/charts/power-cost/")]
    login(page, op.email)
    for width, height in ((1440, 900), (390, 844)):
        page.set_viewport_size({"width": width, "height": height})
        for name, url in operator_pages:
            page.goto(live_server.url + url)
            page.wait_for_load_state("networkidle")
            shot(page, f"round3-{name}-{width}")
            assert page.evaluate("document.documentElement.scrollWidth") <= width, (name, width)
    assert "Awaiting its worker" not in page.content()  # the node's own registration is a heartbeat
    page.goto(f"{live_server.url}/console/planner/?{PLAN}")
    assert "per 1M tokens" in page.inner_text("#best-cost + .label")
    page.context.clear_cookies()
    login(page, owner.email)
    for width, height in ((1440, 900), (390, 844)):
        page.set_viewport_size({"width": width, "height": height})
        page.goto(f"{live_server.url}/portal/find-tier/?library_model=llama-3.1-8b-instruct&context=8192")
        page.wait_for_load_state("networkidle")
        shot(page, f"round3-find-tier-{width}")
        assert page.evaluate("document.documentElement.scrollWidth") <= width
