"""OneQueryPaginator: a page and the whole list's count in one query, the same pages as Django's paginator."""

import pytest
from django.core.paginator import EmptyPage, PageNotAnInteger, Paginator
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.api.pagination import TOTAL, OneQueryPaginator
from tenants.models import Tenant
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db


def _page(paginator, number):
    p = paginator.page(number)
    return list(p.object_list), p.has_next(), p.has_previous(), paginator.count, paginator.num_pages


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 11), per_page=st.integers(1, 4), orphans=st.integers(0, 2),
       rows=st.sampled_from(["instances", "dicts"]))
def test_pages_and_counts_are_django_s_in_one_query(n, per_page, orphans, rows):
    """OneQueryPaginator (a second copy of Django's paginator, kept for speed) gives Django's pages and counts for
    any list length, page size, orphans and row shape; every page but an orphan-folded one in one query."""
    with transaction.atomic():
        for i in range(n):
            TenantFactory(slug=f"t{i:02d}")
        qs = Tenant.objects.order_by("slug")
        if rows == "dicts":
            qs = qs.values("slug", "currency")
        last = Paginator(qs, per_page, orphans=orphans).num_pages
        for number in range(1, last + 1):
            with CaptureQueriesContext(connection) as q:
                got = _page(OneQueryPaginator(qs, per_page, orphans=orphans), number)
            want = _page(Paginator(qs, per_page, orphans=orphans), number)
            assert got == want
            folded = number == last and n - (number - 1) * per_page > per_page  # orphans folded in: read again
            assert len(q.captured_queries) == (2 if folded else 1)
            assert not any(TOTAL in (r if isinstance(r, dict) else vars(r)) for r in got[0])  # no count field
        transaction.set_rollback(True)


def test_a_page_past_the_end_or_not_a_number_is_refused():
    for i in range(4):
        TenantFactory(slug=f"t{i}")
    qs = Tenant.objects.order_by("slug")
    with pytest.raises(EmptyPage):
        OneQueryPaginator(qs, 3).page(3)
    with pytest.raises(EmptyPage):
        OneQueryPaginator(qs, 3).page(0)
    with pytest.raises(PageNotAnInteger):
        OneQueryPaginator(qs, 3).page("x")
    assert [t.slug for t in OneQueryPaginator(qs, 3).page(2).object_list] == ["t3"]


def test_a_distinct_list_is_counted_the_default_way():
    """COUNT(*) OVER () counts before DISTINCT: a distinct list keeps its separate COUNT."""
    for i in range(4):
        TenantFactory(slug=f"t{i}", currency="EUR" if i % 2 else "USD")
    qs = Tenant.objects.order_by("currency").values("currency").distinct()
    p = OneQueryPaginator(qs, 10).page(1)
    assert p.paginator.count == 2 and list(p.object_list) == [{"currency": "EUR"}, {"currency": "USD"}]


def test_the_spend_list_is_one_query_a_page(priced_for_spend, as_user, operator):
    api = as_user(operator)
    api.get("/api/v1/billing/spend/?page_size=2")  # (the session and user are read once)
    with CaptureQueriesContext(connection) as q:
        r = api.get("/api/v1/billing/spend/?page_size=2&page=2")
    body = r.json()
    assert r.status_code == 200 and body["count"] == 5 and body["previous"] and body["next"]
    assert len(body["results"]) == 2
    spend = [x["sql"] for x in q.captured_queries if "marketplace_invoice" in x["sql"]]
    assert len(spend) == 1 and "OVER ()" in spend[0] and not any("COUNT(*) AS" in x["sql"] for x in q.captured_queries)
    assert api.get("/api/v1/billing/spend/?page_size=2&page=4").status_code == 404


@pytest.fixture
def priced_for_spend():
    for i in range(5):
        TenantFactory(slug=f"s{i}")
