"""The console's tiers & prices list: a comparable table, one column per price component, one block
per currency, a constant number of queries."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from marketplace.models import PricePlan
from marketplace.selectors import orders as orders_sel
from marketplace.web.catalog_pages import PRICE_COLUMNS, price_table
from tests.fleet_fixtures import make_tier

pytestmark = pytest.mark.django_db


def _plan(tier, kind="on_demand", currency="USD", hour="1.0000", commit=None, days=-1):
    return PricePlan.objects.create(tier=tier, kind=kind, currency=currency, price_per_slice_hour=Decimal(hour),
                                    price_per_1m_input_tokens=Decimal("0.20"),
                                    price_per_1m_output_tokens=Decimal("0.80"),
                                    monthly_commit=Decimal(commit) if commit else None,
                                    effective_from=timezone.now() + timedelta(days=days))


def test_one_column_per_component_one_block_per_currency(catalog):
    t1 = make_tier("h100-1g", "h100-sxm-80gb", "1g.10gb", hour="0.9000")
    _plan(t1, "reserved", "USD", "0.7000", commit="400.00")
    _plan(t1, "on_demand", "EUR", "0.8500")
    _plan(t1, "on_demand", "USD", "1.1000", days=3)  # scheduled, not in force
    bare = make_tier("h100-7g", "h100-sxm-80gb", "7g.80gb")
    bare.plans.all().delete()

    blocks, currencies, unpriced = price_table(orders_sel.tiers(), timezone.now())
    assert currencies == ["EUR", "USD"] and unpriced == [bare]
    usd = next(b for b in blocks if b.currency == "USD").rows
    assert len(usd) == 1 and usd[0].scheduled == 1
    cells = dict(zip([c[2] for c in PRICE_COLUMNS], usd[0].cells, strict=True))
    assert cells["On demand · slice-hour"] == Decimal("0.9000")
    assert cells["Reserved · slice-hour"] == Decimal("0.7000")
    assert cells["Reserved · monthly commit"] == Decimal("400.00")
    eur = next(b for b in blocks if b.currency == "EUR").rows[0]
    assert eur.cells[0] == Decimal("0.8500") and eur.cells[3] is None  # no reserved price in EUR

    only_eur, _, _ = price_table(orders_sel.tiers(), timezone.now(), "EUR")
    assert [b.currency for b in only_eur] == ["EUR"]


def test_page_renders_the_table_in_constant_queries(client, operator, catalog, django_assert_max_num_queries):
    client.force_login(operator)
    for i in range(3):
        make_tier(f"t-{i}", "h100-sxm-80gb", "1g.10gb")
    client.get(reverse("console:tiers"))
    with django_assert_max_num_queries(12) as few:
        r = client.get(reverse("console:tiers"))
    n_few = len(few.captured_queries)
    for i in range(3, 12):
        t = make_tier(f"t-{i}", "h100-sxm-80gb", "1g.10gb")
        _plan(t, "reserved", "USD", commit="100.00")
    with django_assert_max_num_queries(n_few) as many:
        r = client.get(reverse("console:tiers"))
    assert len(many.captured_queries) == n_few
    html = r.content.decode()
    assert html.count('data-tier="t-') == 12 and "Reserved · monthly commit" in html
