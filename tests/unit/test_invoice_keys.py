"""An invoice's per-key breakdown: each token line's amount split over the API keys served under it, in proportion
to their tokens, largest remainder to the cent; the shares of a line sum to it, the keys' amounts and what belongs
to no key sum to the invoice's total; a finalized invoice keeps its shares; the API, the CSV and both invoice pages
show the same split, and another tenant's invoice is not readable."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.urls import reverse
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from marketplace.models import InvoiceLine, InvoiceLineKey
from marketplace.selectors.billing import key_breakdown
from marketplace.services import billing
from marketplace.services.billing.keys import split_cents
from telemetry.services.ingest import store_rows
from tenants.models import ApiKey
from tenants.roles import Role
from tests.factories import make_key


@settings(max_examples=300, deadline=None)
@given(cents=st.integers(0, 10**9), weights=st.lists(st.integers(1, 10**12), min_size=1, max_size=12))
def test_a_split_sums_to_the_amount_and_each_share_is_within_a_cent_of_its_part(cents, weights):
    amount = Decimal(cents) / 100
    named = {f"k{i}": w for i, w in enumerate(weights)}
    shares = split_cents(amount, named)
    assert sum(shares.values()) == amount and set(shares) == set(named)
    total = sum(weights)
    for k, w in named.items():
        exact = amount * w / total
        assert shares[k] >= 0 and abs(shares[k] - exact) < Decimal("0.01"), (k, shares[k], exact)
        assert shares[k] == shares[k].quantize(Decimal("0.01"))
    assert split_cents(amount, dict(reversed(list(named.items())))) == shares  # the order given changes nothing


def test_a_split_refuses_what_is_not_a_sum_of_cents():
    with pytest.raises(ValueError):
        split_cents(Decimal("1.005"), {"a": 1})
    with pytest.raises(ValueError):
        split_cents(Decimal("1.00"), {"a": 0})


def test_the_largest_remainders_get_the_cents_left_over():
    assert split_cents(Decimal("1.00"), {"a": 3_333_333, "b": 3_333_333, "c": 3_333_334}) == {
        "a": Decimal("0.33"), "b": Decimal("0.33"), "c": Decimal("0.34")}
    assert split_cents(Decimal("0.01"), {"a": 1, "b": 1}) == {"a": Decimal("0.01"), "b": Decimal("0.00")}


@pytest.mark.django_db(transaction=True)
def test_an_invoice_splits_its_token_lines_per_key_and_the_splits_add_up(gateway_fleet, client, operator):
    a, dep = gateway_fleet["a"], gateway_fleet["gen"]
    mine = ApiKey.objects.get(tenant=a)
    team, _ = make_key(a, ["inference"], name="team-b")
    now = timezone.now()
    t = max(now - timedelta(minutes=1), now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    # 10M input tokens (1.00 at 0.10 per 1M) in thirds, output 7M (2.80 at 0.40) unevenly, and usage without a key
    store_rows(a.pk, [("e1", dep.pk, t, 3_333_333, 1_000_000, 1, None, "", mine.prefix),
                      ("e2", dep.pk, t, 3_333_333, 5_999_999, 1, None, "", team.prefix),
                      ("e3", dep.pk, t, 3_333_334, 1, 1, None, "", "")])
    invoice = billing.current_invoice(a)
    tokens = InvoiceLine.objects.filter(invoice=invoice, kind__in=("input_tokens", "output_tokens"))
    assert {li.kind: li.amount for li in tokens} == {"input_tokens": Decimal("1.00"), "output_tokens": Decimal("2.80")}
    for li in tokens:
        assert li.key_shares.aggregate(s=Sum("amount"))["s"] == li.amount
    shares = {(s.line.kind, s.api_key): s.amount for s in InvoiceLineKey.objects.filter(line__invoice=invoice)}
    assert shares[("input_tokens", "")] == Decimal("0.34")  # the largest remainder
    assert shares[("input_tokens", mine.prefix)] == shares[("input_tokens", team.prefix)] == Decimal("0.33")
    assert shares[("output_tokens", team.prefix)] == Decimal("2.40")
    split = key_breakdown(invoice)
    rows = {r["key"]: r for r in split["keys"]}
    assert set(rows) == {mine.prefix, team.prefix, None}
    assert rows[team.prefix]["key_name"] == "team-b" and rows[None]["key_name"] is None
    assert (rows[mine.prefix]["input_tokens"], rows[mine.prefix]["output_tokens"]) == (3_333_333, 1_000_000)
    no_key = InvoiceLine.objects.filter(invoice=invoice).exclude(kind__in=("input_tokens", "output_tokens"))
    assert split["not_per_key"] == sum((li.amount for li in no_key), Decimal(0))  # the slice-hours of its slice
    assert sum(r["amount"] for r in split["keys"]) + split["not_per_key"] == invoice.total
    # re-rating keeps one set of shares; finalizing freezes them
    billing.refresh(invoice)
    assert InvoiceLineKey.objects.filter(line__invoice=invoice).count() == 6  # 3 keys x 2 lines
    final = billing.finalize(invoice, force=True)
    store_rows(a.pk, [("e4", dep.pk, t, 5_000_000, 0, 1, None, "", mine.prefix)])  # late: the next invoice's
    assert key_breakdown(final) == split

    # the API, the CSV and both pages show the same split
    owner = a.memberships.get(role=Role.OWNER).user
    client.force_login(owner)
    r = client.get(f"/api/v1/invoices/{final.pk}/keys/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["total"] == str(final.total) and body["not_per_key"] == str(split["not_per_key"])
    assert {k["key"]: k["amount"] for k in body["keys"]} == {r["key"]: str(r["amount"]) for r in split["keys"]}
    text = client.get(f"/api/v1/invoices/{final.pk}/export/csv/").content.decode()
    rows_csv = list(csv.reader(io.StringIO(text)))
    keyed = {r[1]: r for r in rows_csv if r[0] == "key"}
    assert keyed[team.prefix][2:] == ["team-b", "3333333", "5999999", str(rows[team.prefix]["amount"])]
    not_per_key = [r for r in rows_csv if r[0] == "not_per_key"][0][5]
    assert sum(Decimal(r[5]) for r in keyed.values()) + Decimal(not_per_key) == final.total
    page = client.get(reverse("portal:invoice", args=[final.pk])).content.decode()
    assert 'id="by-key"' in page and "team-b" in page and team.prefix in page
    client.force_login(operator)
    page = client.get(reverse("console:invoice_detail", args=[final.pk])).content.decode()
    assert 'id="by-key"' in page and "team-b" in page
    # another tenant's owner reads none of it
    b_owner = gateway_fleet["b"].memberships.get(role=Role.OWNER).user
    client.force_login(b_owner)
    assert client.get(f"/api/v1/invoices/{final.pk}/keys/").status_code == 404
