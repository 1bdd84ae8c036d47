"""One rule for showing money and counts: every template (filters in ``marketplace.templatetags.tessera``) and
every chart (the Plotly formats below) use it, so a figure reads the same on every page.

- Money totals: the currency's minor units (ISO 4217: 2 for USD/EUR/GBP, 0 for JPY/KRW, 3 for BHD/KWD...),
  thousands separators, the ISO code after the amount: ``1,234.50 USD``, ``-3.64 EUR``, ``1,200 JPY``.
- Unit prices (per slice-hour, per 1M tokens): at least the minor units, more where the price needs them, up to
  ``UNIT_PRICE_MAX_PLACES`` places (or, for a price below that, ``UNIT_PRICE_SIGNIFICANT`` significant digits, so a
  tiny per-token price never reads as zero), no trailing zeros beyond the minor units: ``0.00015 USD``,
  ``2.50 USD``, ``0.0000002 USD``.
- Counts: integers with thousands separators: ``1,963,270``.
- Billing periods (a start date and an exclusive end, as invoices store them): the inclusive end, the month and
  year written once where they are shared: ``1–30 Nov 2026``, ``28 Nov – 3 Dec 2026``.

Pure functions (no Django), Decimal in and str out; floats are accepted and converted through ``str``.
"""
from __future__ import annotations

import datetime as dt
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

# ISO 4217 minor units that are not 2 (the default). Source: ISO 4217 list of currency codes (SIX Group, the
# maintenance agency), column "Minor unit".
MINOR_UNITS = {
    "BHD": 3, "BIF": 0, "CLP": 0, "DJF": 0, "GNF": 0, "IQD": 3, "ISK": 0, "JOD": 3, "JPY": 0, "KMF": 0, "KRW": 0,
    "KWD": 3, "LYD": 3, "OMR": 3, "PYG": 0, "RWF": 0, "TND": 3, "UGX": 0, "UYI": 0, "VND": 0, "VUV": 0, "XAF": 0,
    "XOF": 0, "XPF": 0,
}
UNIT_PRICE_MAX_PLACES = 6
UNIT_PRICE_SIGNIFICANT = 3  # for prices too small for UNIT_PRICE_MAX_PLACES


def minor_units(currency: str | None) -> int:
    return MINOR_UNITS.get((currency or "").upper(), 2)


def _decimal(value: object) -> Decimal | None:
    if value is None or value == "":
        return None
    if isinstance(value, Decimal):
        d = value
    else:
        try:
            d = Decimal(str(value))
        except (InvalidOperation, ValueError):
            return None
    return d if d.is_finite() else None


def _grouped(amount: Decimal, places: int) -> str:
    q = amount.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP) if places else amount.quantize(
        Decimal(1), rounding=ROUND_HALF_UP)
    if q == 0:
        q = abs(q)  # never "-0.00"
    return f"{q:,.{places}f}"


def money_amount(value: object, currency: str | None = None) -> str:
    """The amount alone, rounded to the currency's minor units: ``1,234.50``."""
    d = _decimal(value)
    if d is None:
        return "—"
    return _grouped(d, minor_units(currency))


def money(value: object, currency: str | None = None) -> str:
    """A total: ``1,234.50 USD``."""
    text = money_amount(value, currency)
    return f"{text} {currency.upper()}" if currency and text != "—" else text


def unit_price_amount(value: object, currency: str | None = None) -> str:
    """A unit price with the digits it needs: at least the minor units, at most 6 places."""
    d = _decimal(value)
    if d is None:
        return "—"
    low = minor_units(currency)
    most = UNIT_PRICE_MAX_PLACES
    if d and abs(d) < Decimal(1).scaleb(-most):  # 0.0000002: enough places for its significant digits
        most = UNIT_PRICE_SIGNIFICANT - 1 - d.adjusted()
    q = d.quantize(Decimal(1).scaleb(-most), rounding=ROUND_HALF_UP)
    exponent = q.normalize().as_tuple().exponent
    needed = -exponent if isinstance(exponent, int) and q else 0
    places = max(low, min(most, needed))
    return _grouped(q, places)


def unit_price(value: object, currency: str | None = None) -> str:
    """A unit price: ``0.00015 USD``."""
    text = unit_price_amount(value, currency)
    return f"{text} {currency.upper()}" if currency and text != "—" else text


def count(value: object) -> str:
    """A count: ``1,963,270`` (a fractional value is rounded half up)."""
    d = _decimal(value)
    if d is None:
        return "—"
    return _grouped(d, 0)


def period(start: dt.date | None, end: dt.date | None) -> str:
    """A billing period from its start and its exclusive end (the next period's start), as people read one:
    the last day it includes, month and year written once where shared: ``1–30 Nov 2026``,
    ``28 Nov – 3 Dec 2026``, ``28 Dec 2026 – 3 Jan 2027``. A datetime is taken by its date."""
    if start is None or end is None:
        return "—"
    if isinstance(start, dt.datetime):
        start = start.date()
    if isinstance(end, dt.datetime):
        end = end.date()
    last = max(start, end - dt.timedelta(days=1))
    if start == last:
        return f"{start.day} {start:%b %Y}"
    if (start.year, start.month) == (last.year, last.month):
        return f"{start.day}–{last.day} {last:%b %Y}"
    if start.year == last.year:
        return f"{start.day} {start:%b} – {last.day} {last:%b %Y}"
    return f"{start.day} {start:%b %Y} – {last.day} {last:%b %Y}"


def last_day(end: dt.date | None) -> str:
    """The last day a period with this exclusive end includes: ``30 Nov 2026``."""
    if end is None:
        return "—"
    if isinstance(end, dt.datetime):
        end = end.date()
    last = end - dt.timedelta(days=1)
    return f"{last.day} {last:%b %Y}"


def plotly_money_format(currency: str | None = None) -> str:
    """d3-format for money axes and hover labels: fixed minor units with separators, never SI prefixes."""
    return f",.{minor_units(currency)}f"


def plotly_unit_price_format(currency: str | None = None) -> str:
    """d3-format for unit-price axes (cost per 1K / 1M tokens): up to 6 places, trailing zeros trimmed, no SI."""
    return f",.{UNIT_PRICE_MAX_PLACES}~f"


COUNT_FORMAT = ",d"  # d3-format for counts


def plain(value: object) -> str:
    """A value as people read it (the audit log's details are JSON): none as "—", yes/no, lists joined with
    commas ("none" when empty), mappings as "key: value", text and numbers as they are."""
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(plain(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {plain(v)}" for k, v in value.items()) if value else "none"
    return str(value)


def significant(value: Decimal, digits: int = 4) -> Decimal:
    """``value`` rounded half up to ``digits`` significant digits (0.000034567 -> 0.00003457): unit prices too
    small for fixed decimal places keep their precision."""
    if not value:
        return Decimal(0)
    return value.quantize(Decimal(1).scaleb(value.adjusted() - digits + 1), rounding=ROUND_HALF_UP)


def unit_price_4(value: object, currency: str | None = None) -> str:
    """A unit price to 4 significant digits (per 1M tokens: ``1.687 USD``; ``0.00003457 USD``)."""
    d = _decimal(value)
    return "—" if d is None else unit_price(significant(d, 4), currency)
