import datetime as dt
from decimal import Decimal

import pytest
from django.template import Context, Template

from marketplace import formatting as f


@pytest.mark.parametrize("value,currency,expected", [
    (Decimal("3.64000000000000"), "USD", "3.64 USD"),
    (Decimal("1234.5"), "EUR", "1,234.50 EUR"),
    (Decimal("-3.645"), "USD", "-3.65 USD"),
    (Decimal("-0.001"), "USD", "0.00 USD"),
    (Decimal("1200.4"), "JPY", "1,200 JPY"),
    (Decimal("1.2345"), "KWD", "1.235 KWD"),
    (2.5, "usd", "2.50 USD"),
    (None, "USD", "—"),
])
def test_money(value, currency, expected):
    assert f.money(value, currency) == expected


@pytest.mark.parametrize("value,currency,expected", [
    (Decimal("0.000150"), "USD", "0.00015 USD"),
    (Decimal("2.5"), "USD", "2.50 USD"),
    (Decimal("0.12345678"), "EUR", "0.123457 EUR"),
    (Decimal("1500"), "USD", "1,500.00 USD"),
    (Decimal("0"), "USD", "0.00 USD"),
    (Decimal("12.5"), "JPY", "12.5 JPY"),
])
def test_unit_price(value, currency, expected):
    assert f.unit_price(value, currency) == expected


def test_count_and_formats():
    assert f.count(1963270) == "1,963,270"
    assert f.count("12.5") == "13"
    assert f.count(None) == "—"
    assert f.plotly_money_format("USD") == ",.2f"
    assert f.plotly_money_format("JPY") == ",.0f"
    assert "~" in f.plotly_unit_price_format("USD")


def test_template_filters_are_builtin():
    out = Template("{{ a|money:c }} · {{ p|unit_price:c }} · {{ n|count }}").render(
        Context({"a": Decimal("3.64000000000000"), "p": Decimal("0.00015"), "c": "USD", "n": 1963270}))
    assert out == "3.64 USD · 0.00015 USD · 1,963,270"


@pytest.mark.parametrize("value,expected", [
    (Decimal("0.000002"), "0.000002 USD"),
    (Decimal("0.0000002"), "0.0000002 USD"),
    (Decimal("0.00000012345"), "0.000000123 USD"),
    (Decimal("-0.0000002"), "-0.0000002 USD"),
    (Decimal("Infinity"), "—"),
    ("not a number", "—"),
])
def test_unit_price_never_reads_as_zero(value, expected):
    assert f.unit_price(value, "USD") == expected


@pytest.mark.parametrize("start,end,expected", [
    (dt.date(2026, 11, 1), dt.date(2026, 12, 1), "1–30 Nov 2026"),
    (dt.date(2026, 12, 1), dt.date(2027, 1, 1), "1–31 Dec 2026"),
    (dt.date(2026, 11, 28), dt.date(2026, 12, 4), "28 Nov – 3 Dec 2026"),
    (dt.date(2026, 12, 28), dt.date(2027, 1, 4), "28 Dec 2026 – 3 Jan 2027"),
    (dt.date(2026, 11, 5), dt.date(2026, 11, 6), "5 Nov 2026"),
    (dt.datetime(2026, 2, 1, tzinfo=dt.UTC), dt.datetime(2026, 3, 1, tzinfo=dt.UTC), "1–28 Feb 2026"),
    (None, dt.date(2026, 12, 1), "—"),
])
def test_period_shows_the_inclusive_end(start, end, expected):
    assert f.period(start, end) == expected


def test_period_template_filters():
    out = Template("{{ s|period:e }} · open until {{ e|last_day }}").render(
        Context({"s": dt.date(2026, 11, 1), "e": dt.date(2026, 12, 1)}))
    assert out == "1–30 Nov 2026 · open until 30 Nov 2026"
