"""Charts that read on a phone (issue 34): at 390 px the legend sits under the plot, there is no toolbar over the
titles, and titles wrap; at 1440 px the toolbar is there. Spend in two currencies is drawn on two axes, each line
in its bar's colour."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tests.factories import OperatorFactory
from tests.unit.test_telemetry import many_tenants_with_usage

pytestmark = pytest.mark.django_db(transaction=True)

GEOMETRY = """() => {
  const box = s => { const e = document.querySelector(s); return e ? e.getBoundingClientRect() : null; };
  const plot = box('#chart .nsewdrag'), legend = box('#chart .legend'), bar = document.querySelector('#chart .modebar');
  return {plotBottom: plot && plot.bottom, legendTop: legend && legend.top, legendWidth: legend && legend.width,
          plotWidth: plot && plot.width, toolbar: !!bar && getComputedStyle(bar).display !== 'none',
          width: document.documentElement.scrollWidth};
}"""


def test_tenant_usage_reads_on_a_phone(page, login, live_server, tiers, shot):
    from tenants.models import Tenant

    op = OperatorFactory(email="op@msp.example")
    start = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=6)
    many_tenants_with_usage(tiers["1g"], start, 4, 3)
    Tenant.objects.filter(slug="many01").update(currency="EUR")
    end = start + timedelta(hours=6)
    url = f"{live_server.url}/charts/tenant-usage/?start={start:%Y-%m-%dT%H:%M}&end={end:%Y-%m-%dT%H:%M}"
    page.set_viewport_size({"width": 390, "height": 844})
    login(page, op.email)
    page.goto(url)
    page.wait_for_selector("#chart .main-svg")
    g = page.evaluate(GEOMETRY)
    shot(page, "chart-tenant-usage-390")
    assert not g["toolbar"], g
    assert g["legendTop"] >= g["plotBottom"] - 1, g  # the legend under the plot, not beside it
    assert g["plotWidth"] > 220 and g["width"] <= 390, g  # was ~80 px with the legend beside it
    titles = page.locator("#chart .annotation-text").all_text_contents()
    assert {"spend (EUR)", "spend (USD)"} <= set(titles), titles
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(url)
    page.wait_for_selector("#chart .main-svg")
    shot(page, "chart-tenant-usage-1440")
    assert page.evaluate(GEOMETRY)["toolbar"]
