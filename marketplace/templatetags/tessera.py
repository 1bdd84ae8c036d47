"""Template filters for the one formatting rule (``marketplace.formatting``):
``{{ amount|money:currency }}``, ``{{ price|unit_price:currency }}``, ``{{ n|count }}``. Loaded as a builtin."""
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
def count(value):
    return formatting.count(value)
