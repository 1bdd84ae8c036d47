"""One rule for showing money and counts: every template (filters in ``marketplace.templatetags.tessera``) and
every chart (the Plotly formats below) use it, so a figure reads the same on every page.

- Money totals: the currency's minor units (ISO 4217: 2 for USD/EUR/GBP, 0 for JPY/KRW, 3 for BHD/KWD...),
  thousands separators, the ISO code after the amount: ``1,234.50 USD``, ``-3.64 EUR``, ``1,200 JPY``.
- Unit prices (per slice-hour, per 1M tokens): at least the minor units, more where the price needs them, never
  more than ``UNIT_PRICE_MAX_PLACES`` and no trailing zeros beyond the minor units: ``0.00015 USD``, ``2.50 USD``.
- Counts: integers with thousands separators: ``1,963,270``.

Pure functions (no Django), Decimal in and str out; floats are accepted and converted through ``str``.
"""
from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

# ISO 4217 minor units that are not 2 (the default). Source: ISO 4217 list of currency codes (SIX Group, the
# maintenance agency), column "Minor unit".
MINOR_UNITS = {
    "BHD": 3, "BIF": 0, "CLP": 0, "DJF": 0, "GNF": 0, "IQD": 3, "ISK": 0, "JOD": 3, "JPY": 0, "KMF": 0, "KRW": 0,
    "KWD": 3, "LYD": 3, "OMR": 3, "PYG": 0, "RWF": 0, "TND": 3, "UGX": 0, "UYI": 0, "VND": 0, "VUV": 0, "XAF": 0,
    "XOF": 0, "XPF": 0,
}
UNIT_PRICE_MAX_PLACES = 6


def minor_units(currency: str | None) -> int:
    return MINOR_UNITS.get((currency or "").upper(), 2)


def _decimal(value: object) -> Decimal | None:
    if value is None or value == "":
        return None
    if isinstance(value, Decimal):
        return value
    try:
        return Decimal(str(value))
    except (InvalidOperation, ValueError):
        return None


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
    q = d.quantize(Decimal(1).scaleb(-UNIT_PRICE_MAX_PLACES), rounding=ROUND_HALF_UP)
    places = max(low, min(UNIT_PRICE_MAX_PLACES, -q.normalize().as_tuple().exponent if q else 0))
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


def plotly_money_format(currency: str | None = None) -> str:
    """d3-format for money axes and hover labels: fixed minor units with separators, never SI prefixes."""
    return f",.{minor_units(currency)}f"


def plotly_unit_price_format(currency: str | None = None) -> str:
    """d3-format for unit-price axes (cost per 1K / 1M tokens): up to 6 places, trailing zeros trimmed, no SI."""
    return f",.{UNIT_PRICE_MAX_PLACES}~f"


COUNT_FORMAT = ",d"  # d3-format for counts
