"""Template filters for the one formatting rule (``marketplace.formatting``):
``{{ amount|money:currency }}``, ``{{ price|unit_price:currency }}``, ``{{ n|count }}``,
``{{ start|period:end }}`` (an exclusive end shown as the last day included). Loaded as a builtin."""
from django import template

from marketplace import formatting

register = template.Library()


@register.filter
def money(value, currency=None):
    return formatting.money(value, currency)


@register.filter
def money_amount(value, currency=None):
    return formatting.money_amount(value, currency)


@register.filter
def unit_price(value, currency=None):
    return formatting.unit_price(value, currency)


@register.filter
def unit_price_amount(value, currency=None):
    return formatting.unit_price_amount(value, currency)


@register.filter
def count(value):
    return formatting.count(value)


@register.filter
def period(start, end):
    return formatting.period(start, end)


@register.filter
def last_day(end):
    return formatting.last_day(end)


@register.filter
def gpu_label(value, index=None):
    """``{{ gpu|gpu_label }}`` (a Gpu) or ``{{ hostname|gpu_label:index }}``: the one GPU naming."""
    from marketplace.models import Gpu

    if isinstance(value, Gpu):
        return value.label
    return Gpu.label_for(value, index) if index is not None else value


@register.filter
def plain(value):
    return formatting.plain(value)


@register.filter
def unit_price_4(value, currency=None):
    return formatting.unit_price_4(value, currency)
