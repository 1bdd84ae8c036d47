"""The console's metered-vs-served page in a real browser: out-of-tolerance deployments first, flagged, 50 rows a
page with a pager that walks to the rest; no console errors."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from telemetry.models import TritonServedHourly, UsageHourly
from tests.factories import DeploymentFactory, OperatorFactory
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db(transaction=True)


def test_metering_page_pages_through_the_deployments(browser, page, live_server, login, shot, catalog, tiers):
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    node = make_node("meter-a")
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    deps = [DeploymentFactory(allocation__order__tier=tiers["1g"], allocation__node=node) for _ in range(53)]
    for i, dep in enumerate(deps):
        served = 160 if i == 40 else 100  # one deployment served 60 requests it never metered
        UsageHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=hour, requests=100, events=100,
                                   input_tokens=120_000, output_tokens=4_000)
        TritonServedHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=hour, requests=served)
    op = OperatorFactory(email="meter@msp.example")
    login(page, op.email)

    page.goto(f"{live_server.url}/console/allocations/metering/")
    rows = page.locator("#metering tbody tr")
    assert rows.count() == 50
    first = rows.nth(0)
    assert "warn" in (first.get_attribute("class") or "") and f"#{deps[40].allocation_id}" in first.inner_text()
    assert "1 deployment out of tolerance" in page.inner_text("main")
    pager = page.locator("nav.pager")
    assert "page 1 of 2" in pager.inner_text() and "53 rows" in pager.inner_text()
    shot(page, "console-metering")
    pager.locator("a[rel=next]").click()
    page.wait_for_load_state("networkidle")
    assert page.locator("#metering tbody tr").count() == 3 and "page 2 of 2" in page.inner_text("nav.pager")
    assert not errors, errors
