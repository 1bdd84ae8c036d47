"""The console's metered-vs-served page: one row per deployment (out-of-tolerance ones first, flagged), escaped
text, grouped counts, a link to the allocation, 50 rows a page; and a query count that does not grow with the
deployments, tenants or nodes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from marketplace.web import console
from telemetry.models import TritonServedHourly, UsageHourly
from tests.factories import DeploymentFactory, TenantFactory
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db

URL = "/console/allocations/metering/"


def _hour(back: int = 2):
    return timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=back)


def _deployment(tier, node, metered: int | None, served: int | None, *, name: str | None = None, tenant=None):
    extra = {"name": name} if name else {}
    if tenant is not None:
        extra["allocation__order__tenant"] = tenant
    dep = DeploymentFactory(allocation__order__tier=tier, allocation__node=node, **extra)
    for back in (2, 3):  # two hours inside the page's 24
        if metered is not None:
            UsageHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=_hour(back), requests=metered,
                                       events=metered, input_tokens=metered * 1000, output_tokens=metered * 10)
        if served is not None:
            TritonServedHourly.objects.create(tenant=dep.tenant, deployment=dep, hour=_hour(back), requests=served)
    return dep


def _queries(client) -> int:
    with CaptureQueriesContext(connection) as q:
        assert client.get(URL).status_code == 200
    return len(q.captured_queries)


def test_metering_page_queries_do_not_grow_with_the_deployments(h100_node, tiers, operator):
    client = Client()
    client.force_login(operator)
    for _ in range(2):
        _deployment(tiers["1g"], h100_node, 10, 10)
    client.get(URL)  # warm (session, content types)
    small = _queries(client)
    nodes = [make_node("node-b"), make_node("node-c")]
    for i in range(10):
        _deployment(tiers["3g"], nodes[i % 2], 10 + i, 10, tenant=TenantFactory())
    r = client.get(URL)
    assert r.content.decode().count("<tr") == 1 + 12  # the header row and one per deployment
    assert _queries(client) == small


def test_metering_page_rows(h100_node, tiers, operator):
    client = Client()
    client.force_login(operator)
    assert "Nothing metered or served in these hours." in client.get(URL).content.decode()
    fine = _deployment(tiers["1g"], h100_node, 750_000, 750_000, name="<b>chat</b>")
    off = _deployment(tiers["3g"], h100_node, 100, 160)  # 60 an hour served and never metered
    unplaced = _deployment(tiers["1g"], None, None, 2)  # served only (4: within tolerance), on no node
    body = client.get(URL).content.decode()
    assert "1 deployment out of tolerance" in body
    rows = body.split("<tbody>")[1].split("</tbody>")[0].split("<tr")[1:]
    assert len(rows) == 3
    assert rows[0].startswith(' class="warn">') and '<span class="badge warn">-120</span>' in rows[0]
    link = reverse("console:allocation_detail", args=[off.allocation_id])
    assert f'<a href="{link}">#{off.allocation_id}</a>' in rows[0] and f"<td>{off.name}</td>" in rows[0]
    assert f"<td>{off.tenant.slug}</td>" in rows[0] and "<td>node-a</td>" in rows[0]
    assert '<td class="num">200</td><td class="num">320</td>' in rows[0]  # two hours each
    assert '<td class="num">200,000 / 2,000</td>' in rows[0]
    # then by the size of the difference: the served-only deployment (-4), then the exact one (0)
    assert f"#{unplaced.allocation_id}</a>" in rows[1] and "<td>—</td>" in rows[1] and "<td>None</td>" not in rows[1]
    assert '<td class="num">0</td><td class="num">4</td>' in rows[1] and '<td class="num">-4</td>' in rows[1]
    assert "<td>&lt;b&gt;chat&lt;/b&gt;</td>" in rows[2] and "<b>chat</b>" not in body
    assert '<td class="num">1,500,000</td><td class="num">1,500,000</td>' in rows[2]
    assert not rows[1].startswith(' class="warn"') and f"#{fine.allocation_id}</a>" in rows[2]


def test_metering_page_paginates_with_the_out_of_tolerance_rows_first(h100_node, tiers, operator, monkeypatch):
    monkeypatch.setattr(console, "METERING_PER_PAGE", 2)
    client = Client()
    client.force_login(operator)
    exact = [_deployment(tiers["1g"], h100_node, 10, 10) for _ in range(2)]
    off = _deployment(tiers["3g"], h100_node, 100, 160)

    def rows(page: int) -> list[str]:
        body = client.get(URL, {"page": page}).content.decode()
        assert "3 rows" in body and f"page {page} of 2" in body
        return body.split("<tbody>")[1].split("</tbody>")[0].split("<tr")[1:]

    first, second = rows(1), rows(2)
    assert len(first) == 2 and len(second) == 1
    assert first[0].startswith(' class="warn">') and f"#{off.allocation_id}</a>" in first[0]
    shown = {d.allocation_id for d in exact if any(f"#{d.allocation_id}</a>" in r for r in first[1:] + second)}
    assert shown == {d.allocation_id for d in exact}
    assert 'rel="next"' in client.get(URL, {"page": 1}).content.decode()
    assert client.get(URL, {"page": "junk"}).status_code == 200  # an edited URL gets the first page
