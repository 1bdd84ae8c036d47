"""Invoice pages with PDFs, credits and billing details in a real browser, at 1440x900 and 390x844 (issue 34):
the tenant owner sets the billing details and downloads the invoice's PDF (which names them) and a credit note's;
an operator downloads the PDF, credits the rest of the invoice, and then no credit form is offered; both pages show
the net balance. No page is wider than the viewport (the layout test's measure). Screenshots go to
test-artifacts/screenshots/documents-*.png."""

from __future__ import annotations

import io
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from pypdf import PdfReader

from marketplace.models import Allocation, Order
from marketplace.services import billing
from marketplace.services.billing import documents
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.browser.test_layout_widths import MEASURE
from tests.factories import MembershipFactory, OperatorFactory, TenantFactory, UserFactory
from tests.fleet_fixtures import make_tier

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(documents.unavailable() is not None, reason=str(documents.unavailable()))]
SIZES = [(1440, 900), (390, 844)]


@pytest.fixture
def billed(catalog, settings):
    settings.TESSERA_MSP_NAME = "Northwind GPU Cloud GmbH"
    settings.TESSERA_MSP_ADDRESS = "Hafenstrasse 12; 20457 Hamburg; Germany"
    settings.TESSERA_MSP_TAX_IDS = "VAT DE811907980"
    tier = make_tier("h100-3g", "h100-sxm-80gb", "3g.40gb", hour="2.0000",
                     since=timezone.now() - timedelta(days=120))
    acme = TenantFactory(slug="acme-international-research", name="Acme International Research Laboratories")
    MembershipFactory(tenant=acme, role=Role.OWNER, user=UserFactory(email="owner@acme.example"))
    op = OperatorFactory(email="ops@msp.example")
    month = billing.month_of(timezone.now())
    last = billing.month_of(month - timedelta(days=1))
    start = datetime.combine(last, time.min, tzinfo=UTC)
    order = Order.objects.create(tenant=acme, tier=tier)
    Allocation.objects.create(order=order, tenant=acme, tier=tier, state="released", activated_at=start,
                              released_at=start + timedelta(hours=10))
    invoice = billing.finalize(billing.draft_for(acme, last), principal=principal_for_user(op))
    line = invoice.lines.get()
    cn = billing.issue_credit_note(principal_for_user(op), invoice, reason="goodwill for an outage",
                                   lines=[(line.pk, Decimal("5.00"))])
    return {"acme": acme, "op": op, "invoice": invoice, "cn": cn}


def _measure(page, base, path, name, shot) -> None:
    for width, height in SIZES:
        page.set_viewport_size({"width": width, "height": height})
        resp = page.goto(f"{base}{path}")
        assert resp is not None and resp.status == 200, (path, resp and resp.status)
        page.wait_for_load_state("networkidle")
        m = page.evaluate(MEASURE)
        assert m["scrollWidth"] <= width and not m["offscreen"], (path, width, m)
        shot(page, f"documents-{name}-{width}")


def _download(page, selector: str) -> str:
    with page.expect_download() as d:
        page.click(selector)
    body = open(d.value.path(), "rb").read()
    assert body.startswith(b"%PDF-")
    return " ".join(" ".join((p.extract_text() or "").split()) for p in PdfReader(io.BytesIO(body)).pages)


def test_owner_sets_billing_details_and_downloads_the_pdfs(page, live_server, login, shot, billed):
    base, inv, cn = live_server.url, billed["invoice"], billed["cn"]
    login(page, "owner@acme.example")
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{base}/portal/invoices/")
    page.click("#billing-details-link")
    page.fill("#id_billing_legal_name", "Acme International Research Laboratories Ltd")
    page.fill("#id_billing_address", "1 Forge Lane\nSheffield S1 2AB\nUnited Kingdom")
    page.fill("#id_billing_tax_id", "not a tax id!")
    page.click("#billing-details button[type=submit]")
    assert "a tax id" in page.locator("#billing-details").inner_text()
    shot(page, "documents-portal-billing-error-390")
    page.fill("#id_billing_tax_id", "GB123456789")
    page.click("#billing-details button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert "Billing details saved" in page.content()
    _measure(page, base, "/portal/billing/", "portal-billing", shot)
    _measure(page, base, f"/portal/invoices/{inv.pk}/", "portal-invoice", shot)
    net = page.locator("#net-balance").inner_text()
    assert "15.00 USD" in net and "5.00 USD credited" in net
    text = _download(page, "#pdf")
    # finalized before the details were set: the PDF is made out as it was issued (the tenant's name, no address)
    assert f"Invoice {inv.number}" in text and "Acme International Research Laboratories" in text
    assert "1 Forge Lane" not in text and "Northwind GPU Cloud GmbH" in text and "20.00 USD" in text
    text = _download(page, f"a[href='/portal/credit-notes/{cn.pk}/pdf/']")
    assert f"Credit note {cn.number}" in text and "goodwill for an outage" in text and "5.00 USD" in text
    # a draft prints the details now on record
    draft = billing.current_invoice(billed["acme"])
    page.goto(f"{base}/portal/invoices/{draft.pk}/")
    text = _download(page, "#pdf")
    assert "DRAFT" in text and "1 Forge Lane" in text and "GB123456789" in text


def test_operator_credits_the_rest_and_then_no_credit_form(page, live_server, login, shot, billed):
    base, inv = live_server.url, billed["invoice"]
    login(page, "ops@msp.example")
    _measure(page, base, f"/console/invoices/{inv.pk}/", "console-invoice", shot)
    assert "15.00 USD" in page.locator("#net-balance").inner_text()
    assert "Northwind GPU Cloud GmbH" in _download(page, "#pdf")
    page.set_viewport_size({"width": 1440, "height": 900})
    page.on("dialog", lambda d: d.accept())
    page.fill("input[name=reason]", "the rest: wrong price")
    page.click("#credit-note")
    page.wait_for_load_state("networkidle")
    assert page.locator("#credit-note").count() == 0
    assert "Fully credited" in page.locator("#fully-credited").inner_text()
    assert "0.00 USD" in page.locator("#net-balance").inner_text()
    _measure(page, base, f"/console/invoices/{inv.pk}/", "console-invoice-credited", shot)
    _measure(page, base, f"/console/tenants/{billed['acme'].pk}/", "console-tenant", shot)
    page.fill("#billing-details #id_billing_tax_id", "GB999")
    page.click("#save-billing")
    page.wait_for_load_state("networkidle")
    assert "Billing details saved" in page.content()
