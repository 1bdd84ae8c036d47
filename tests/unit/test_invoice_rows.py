"""The invoice reads' JSON written by hand (api.billing.InvoiceRows: from the selectors' rows, no model instances or
serializer fields per value) is a SECOND COPY, kept for speed, of what InvoiceListSerializer and InvoiceSerializer
write: held equal to them here whatever the amounts' digits, the times (microseconds, the current time zone),
numbers, statuses, lines and credit notes (property test)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.conf import settings as django_settings
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.api.billing import InvoiceListSerializer, InvoiceSerializer
from marketplace.selectors import billing as selectors
from tenants.scoping import principal_for_user
from tests.factories import CreditNoteFactory, InvoiceFactory, InvoiceLineFactory, TenantFactory

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 10, 1, tzinfo=UTC)


def scaled(places: int, digits: int, signed: bool = False):
    """Decimals of `places` decimal places and at most `digits` digits, as a DecimalField stores them."""
    top = 10 ** (digits - places) * 10**places - 1
    return st.integers(min_value=-top if signed else 0, max_value=top).map(lambda n: Decimal(n).scaleb(-places))


moments = st.integers(min_value=-10**6, max_value=10**6).flatmap(
    lambda s: st.integers(0, 999_999).map(lambda us: T0 + timedelta(seconds=s, microseconds=us)))
lines = st.lists(st.tuples(scaled(6, 12), scaled(4, 12), scaled(2, 12, signed=True), moments, st.integers(0, 10**6)),
                 max_size=3)
invoices = st.lists(st.tuples(st.booleans(), scaled(2, 14, signed=True), st.one_of(st.none(), moments), lines,
                              st.lists(st.tuples(scaled(2, 12), moments), max_size=2)), min_size=1, max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(invoices=invoices, tz=st.sampled_from(["UTC", "Europe/Paris", "Asia/Kolkata", "America/St_Johns"]),
       iso=st.booleans())
def test_invoice_rows_are_what_the_serializers_write(catalog, tiers, operator, api, invoices, tz, iso):
    fmt = {} if iso else {"DATETIME_FORMAT": "%Y-%m-%d %H:%M:%S.%f%z", "DATE_FORMAT": "%d.%m.%Y"}
    with transaction.atomic(), timezone.override(tz), override_settings(REST_FRAMEWORK={
            **django_settings.REST_FRAMEWORK, **fmt}):
        tenant = TenantFactory()
        for i, (final, total, rated, its_lines, notes) in enumerate(invoices):
            month = date(2026, 1 + i, 1)
            inv = InvoiceFactory(tenant=tenant, period_start=month, total=total, rated_at=rated,
                                 status="finalized" if final else "draft", finalized_at=rated if final else None,
                                 number=f"TSR-2026-{i:06d}" if final else None)
            for quantity, unit_price, amount, start, seconds in its_lines:
                InvoiceLineFactory(invoice=inv, tier=tiers["3g"], quantity=quantity, unit_price=unit_price,
                                   amount=amount, usage_from=start, usage_to=start + timedelta(seconds=seconds))
            for credited, issued in notes:
                CreditNoteFactory(invoice=inv, total=credited, issued_at=issued)
        op = principal_for_user(operator)
        client = api
        client.force_authenticate(operator)
        listed = client.get("/api/v1/invoices/?ordering=period_start&page_size=10").json()["results"]
        assert listed == [dict(x) for x in InvoiceListSerializer(selectors.invoices(op).order_by("period_start"),
                                                                  many=True).data]
        for inv in selectors.invoices(op):
            assert client.get(f"/api/v1/invoices/{inv.pk}/").json() == InvoiceSerializer(inv).data
        transaction.set_rollback(True)
