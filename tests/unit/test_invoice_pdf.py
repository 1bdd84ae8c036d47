"""Invoice and credit-note PDFs (issue 34 item 3) and the credits' net balance: the PDF names the MSP (settings) and
the tenant's billing details, carries the lines per tier and per API key, the totals and the currency, a draft a
DRAFT watermark; a finalized invoice's PDF never changes (its parties are frozen at finalization); the tenant
downloads them (portal, API), operators too (console); another tenant's is a 404; the invoice.finalized webhook
links it; without the PDF library the pages say why instead of a 500. A fully credited invoice offers no credit
form, and the pages and the API show the net balance."""

from __future__ import annotations

import io
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from pypdf import PdfReader

from marketplace.models import InvoiceLineKey, PricePlan, WebhookDelivery, WebhookEndpoint
from marketplace.services import billing
from marketplace.services.billing import documents
from tenants import services as tenant_services
from tenants.errors import ServiceError
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import (
    AllocationFactory,
    InvoiceFactory,
    InvoiceLineFactory,
    MembershipFactory,
    OrderFactory,
    TenantFactory,
    make_key,
)

pytestmark = [pytest.mark.django_db,
              pytest.mark.skipif(documents.unavailable() is not None, reason=str(documents.unavailable()))]
D = Decimal
T0 = datetime(2026, 10, 1, tzinfo=UTC)
OCT = date(2026, 10, 1)
NOV2 = datetime(2026, 11, 2, tzinfo=UTC)


def text(pdf: bytes) -> str:
    assert pdf.startswith(b"%PDF-")
    return " ".join(" ".join((p.extract_text() or "").split()) for p in PdfReader(io.BytesIO(pdf)).pages)


@pytest.fixture
def msp(settings):
    settings.TESSERA_MSP_NAME = "Northwind GPU Cloud GmbH"
    settings.TESSERA_MSP_ADDRESS = "Hafenstrasse 12; 20457 Hamburg; Germany"
    settings.TESSERA_MSP_TAX_IDS = "VAT DE811907980, HRB 123456"
    return settings


@pytest.fixture
def acme(catalog, tiers, operator, msp):
    """Tenant acme with billing details, an owner, and October finalized: 10 h of 3g at 2.00 = 20.00 USD."""
    tenant = TenantFactory(slug="acme", name="Acme")
    owner = MembershipFactory(tenant=tenant, role=Role.OWNER).user
    tenant_services.update_tenant(principal_for_user(owner), tenant, billing_legal_name="Acme Robotics Ltd",
                                  billing_address="  1 Forge Lane\n\nSheffield S1 2AB \nUnited Kingdom",
                                  billing_tax_id="GB123456789")
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).update(effective_from=T0 - timedelta(days=30),
                                               price_per_slice_hour=D("2.0000"))
    order = OrderFactory(tenant=tenant, tier=tier)
    AllocationFactory(order=order, tenant=tenant, tier=tier, state="active", activated_at=T0,
                      released_at=T0 + timedelta(hours=10))
    WebhookEndpoint.objects.create(tenant=tenant, url="https://hooks.example.com/", secret="s",
                                   events=["invoice.finalized", "credit_note.issued"])
    inv = billing.finalize(billing.draft_for(tenant, OCT), now=NOV2)
    return {"tenant": tenant, "owner": owner, "invoice": inv, "op": principal_for_user(operator)}


def test_a_draft_pdf_has_the_parties_the_lines_per_tier_and_per_key_the_total_and_a_watermark(tiers, msp):
    tenant = TenantFactory(slug="globex", name="Globex", billing_legal_name="Globex Corporation",
                           billing_address="742 Evergreen Terrace\nSpringfield", billing_tax_id="US-EIN 12-3456789",
                           currency="EUR")
    inv = InvoiceFactory(tenant=tenant, period_start=OCT, total=D("1239.57"), rated_at=T0)
    InvoiceLineFactory(invoice=inv, tier=tiers["3g"], description="3g.40gb slice-hours", quantity=D("100"),
                       unit="hour", unit_price=D("2.5000"), amount=D("250.00"))
    tokens = InvoiceLineFactory(invoice=inv, tier=tiers["1g"], kind="output_tokens", description="Output tokens",
                                quantity=D("2473.9"), unit="1M tokens", unit_price=D("0.4000"), amount=D("989.57"))
    key, _ = make_key(tenant, ["inference"], name="chat-backend")
    InvoiceLineKey.objects.create(line=tokens, api_key=key.prefix, tokens=2_000_000_000, amount=D("800.00"))
    InvoiceLineKey.objects.create(line=tokens, api_key="", tokens=473_900_000, amount=D("189.57"))
    t = text(documents.invoice_pdf(inv))
    for want in ("Northwind GPU Cloud GmbH", "Hafenstrasse 12", "20457 Hamburg", "VAT DE811907980", "HRB 123456",
                 "Globex Corporation", "742 Evergreen Terrace", "Springfield", "US-EIN 12-3456789",
                 "Draft invoice", "DRAFT", "3g.40gb slice-hours", "Output tokens", "250.00", "989.57",
                 "1,239.57 EUR", "chat-backend", key.prefix, "800.00", "189.57", "By tier", tiers["3g"].name,
                 tiers["1g"].name):
        assert want in t, (want, t)


def test_a_finalized_invoice_pdf_never_changes_and_names_what_it_was_issued_to(acme, msp):
    inv, tenant = acme["invoice"], acme["tenant"]
    assert inv.parties["customer"]["address"] == ["1 Forge Lane", "Sheffield S1 2AB", "United Kingdom"]
    first = documents.invoice_pdf(inv)
    t = text(first)
    for want in (f"Invoice {inv.number}", "Acme Robotics Ltd", "1 Forge Lane", "Sheffield S1 2AB", "GB123456789",
                 "Northwind GPU Cloud GmbH", "VAT DE811907980", "20.00 USD", "USD", "20.00"):
        assert want in t, (want, t)
    assert "DRAFT" not in t
    # the tenant moves, the MSP renames itself: the issued invoice is what it was, byte for byte
    tenant_services.update_tenant(acme["op"], tenant, billing_legal_name="Acme Holdings", billing_address="Elsewhere 9")
    msp.TESSERA_MSP_NAME = "Renamed Cloud"
    inv.refresh_from_db()
    assert documents.invoice_pdf(inv) == first
    # a draft prints the current details
    assert "Acme Holdings" in text(documents.invoice_pdf(billing.draft_for(tenant, date(2026, 11, 1))))


def test_a_credit_note_pdf_and_its_frozen_parties(acme):
    inv = acme["invoice"]
    cn = billing.issue_credit_note(acme["op"], inv, reason="price of the slice-hours was wrong",
                                   recharge=[{"description": "10 h at 1.50", "amount": "15.00"}])
    pdf = documents.credit_note_pdf(cn)
    t = text(pdf)
    for want in (f"Credit note {cn.number}", inv.number, "price of the slice-hours was wrong", "20.00 USD",
                 "10 h at 1.50", "15.00", "Acme Robotics Ltd", "1 Forge Lane", "GB123456789",
                 "Northwind GPU Cloud GmbH", "VAT DE811907980"):
        assert want in t, (want, t)
    tenant_services.update_tenant(acme["op"], acme["tenant"], billing_address="Elsewhere 9")
    cn.refresh_from_db()
    assert documents.credit_note_pdf(cn) == pdf


def test_the_tenant_downloads_both_in_the_api_and_the_portal_and_another_tenant_gets_404(acme, as_user, as_key,
                                                                                         client, operator):
    inv = acme["invoice"]
    cn = billing.issue_credit_note(acme["op"], inv, reason="goodwill")
    _, secret = make_key(acme["tenant"], ["billing:read"])
    api = as_key(secret)
    for url, name in ((f"/api/v1/invoices/{inv.pk}/pdf/", inv.number), (f"/api/v1/credit-notes/{cn.pk}/pdf/",
                                                                         cn.number)):
        r = api.get(url)
        assert r.status_code == 200 and r["Content-Type"] == "application/pdf", r.content[:200]
        assert f'filename="{name}.pdf"' in r["Content-Disposition"] and name in text(r.content)
    other = TenantFactory(slug="other")
    _, other_secret = make_key(other, ["billing:read"])
    api = as_key(other_secret)
    assert api.get(f"/api/v1/invoices/{inv.pk}/pdf/").status_code == 404
    assert api.get(f"/api/v1/credit-notes/{cn.pk}/pdf/").status_code == 404
    client.force_login(acme["owner"])
    for url in (f"/portal/invoices/{inv.pk}/pdf/", f"/portal/credit-notes/{cn.pk}/pdf/"):
        r = client.get(url)
        assert r.status_code == 200 and r["Content-Type"] == "application/pdf"
    page = client.get(f"/portal/invoices/{inv.pk}/").content.decode()
    assert f"/portal/invoices/{inv.pk}/pdf/" in page and f"/portal/credit-notes/{cn.pk}/pdf/" in page
    stranger = MembershipFactory(tenant=other, role=Role.OWNER).user
    client.force_login(stranger)
    assert client.get(f"/portal/invoices/{inv.pk}/pdf/").status_code == 404
    assert client.get(f"/portal/credit-notes/{cn.pk}/pdf/").status_code == 404
    client.force_login(operator)
    for url in (f"/console/invoices/{inv.pk}/pdf/", f"/console/credit-notes/{cn.pk}/pdf/"):
        r = client.get(url)
        assert r.status_code == 200 and r["Content-Type"] == "application/pdf"


def test_the_finalized_webhook_and_the_exports_link_the_pdf(acme, settings, as_key):
    inv = acme["invoice"]
    d = WebhookDelivery.objects.get(event="invoice.finalized")
    assert d.payload["data"]["pdf_url"] == f"/api/v1/invoices/{inv.pk}/pdf/"
    settings.TESSERA_SITE_URL = "https://tessera.msp.example"
    cn = billing.issue_credit_note(acme["op"], inv, reason="goodwill")
    d = WebhookDelivery.objects.get(event="credit_note.issued")
    assert d.payload["data"]["pdf_url"] == f"https://tessera.msp.example/api/v1/credit-notes/{cn.pk}/pdf/"
    _, secret = make_key(acme["tenant"], ["billing:read"])
    assert as_key(secret).get(f"/api/v1/invoices/{inv.pk}/export/").json()["pdf_url"] == (
        f"https://tessera.msp.example/api/v1/invoices/{inv.pk}/pdf/")


def test_without_the_pdf_library_the_pages_say_why_and_the_api_answers_503(acme, client, as_key, monkeypatch,
                                                                            operator):
    inv = acme["invoice"]
    monkeypatch.setattr(documents, "_weasyprint", lambda: (None, "the PDF library (WeasyPrint) cannot be loaded: "
                                                                 "no libpango"))
    _, secret = make_key(acme["tenant"], ["billing:read"])
    r = as_key(secret).get(f"/api/v1/invoices/{inv.pk}/pdf/")
    assert r.status_code == 503 and r.json()["code"] == "pdf_unavailable" and "no libpango" in r.json()["detail"]
    client.force_login(acme["owner"])
    page = client.get(f"/portal/invoices/{inv.pk}/").content.decode()
    assert "PDF unavailable" in page and "no libpango" in page and f"/portal/invoices/{inv.pk}/pdf/" not in page
    r = client.get(f"/portal/invoices/{inv.pk}/pdf/", follow=True)
    assert r.status_code == 200 and "No PDF: the PDF library" in r.content.decode()
    client.force_login(operator)
    page = client.get(f"/console/invoices/{inv.pk}/").content.decode()
    assert "PDF unavailable" in page and "no libpango" in page


def test_billing_details_are_validated_and_edited_by_owners_and_operators_only(acme, client, operator, as_user):
    tenant = acme["tenant"]
    with pytest.raises(ServiceError, match="tax id"):
        tenant_services.update_tenant(acme["op"], tenant, billing_tax_id="DE<script>")
    with pytest.raises(ServiceError, match="at most 6 lines"):
        tenant_services.update_tenant(acme["op"], tenant, billing_address="\n".join("abcdefg"))
    client.force_login(acme["owner"])
    r = client.post("/portal/billing/", {"billing_legal_name": "Acme Robotics Limited", "billing_address": "2 Mill Rd",
                                         "billing_tax_id": "GB 987 6543 21", "billing_email": "ap@acme.example"})
    assert r.status_code == 302
    tenant.refresh_from_db()
    assert (tenant.billing_legal_name, tenant.billing_address, tenant.billing_tax_id) == (
        "Acme Robotics Limited", "2 Mill Rd", "GB 987 6543 21")
    r = client.post("/portal/billing/", {"billing_legal_name": "x", "billing_address": "",
                                         "billing_tax_id": "??", "billing_email": "ap@acme.example"})
    assert r.status_code == 400 and "a tax id" in r.content.decode()
    billing_member = MembershipFactory(tenant=tenant, role=Role.BILLING).user
    client.force_login(billing_member)
    page = client.get("/portal/billing/")
    assert page.status_code == 200 and "Acme Robotics Limited" in page.content.decode()
    assert client.post("/portal/billing/", {"billing_legal_name": "pwned"}).status_code == 403
    client.force_login(MembershipFactory(tenant=tenant, role=Role.VIEWER).user)
    assert client.get("/portal/billing/").status_code == 403
    api = as_user(acme["owner"])  # the API: the tenant's owners PATCH them too, checked by the same rule
    r = api.patch(f"/api/v1/tenants/{tenant.slug}/", {"billing_tax_id": "<b>"}, format="json")
    assert r.status_code == 400 and "billing_tax_id" in r.content.decode()
    r = api.patch(f"/api/v1/tenants/{tenant.slug}/", {"billing_address": "  4 Quay St \n\n Bristol "}, format="json")
    assert r.status_code == 200 and r.json()["billing_address"] == "4 Quay St\nBristol"
    client.force_login(operator)
    r = client.post(f"/console/tenants/{tenant.pk}/billing/", {
        "billing_legal_name": "Acme Robotics PLC", "billing_address": "3 Steel St\nLeeds", "billing_tax_id": "GB1",
        "billing_email": "ap@acme.example"})
    assert r.status_code == 302
    tenant.refresh_from_db()
    assert tenant.billing_legal_name == "Acme Robotics PLC" and tenant.billing_address == "3 Steel St\nLeeds"
    assert "Acme Robotics PLC" in client.get(f"/console/tenants/{tenant.pk}/").content.decode()


def test_net_balance_and_no_credit_form_once_fully_credited(acme, client, operator, as_key):
    inv = acme["invoice"]
    client.force_login(operator)
    page = client.get(f"/console/invoices/{inv.pk}/").content.decode()
    assert 'id="credit-note"' in page and "20.00 USD left" in page
    billing.issue_credit_note(acme["op"], inv, reason="goodwill", lines=[(inv.lines.get().pk, D("5.00"))])
    assert billing.left_to_credit(inv) == D("15.00")
    page = client.get(f"/console/invoices/{inv.pk}/").content.decode()
    assert "15.00 USD left" in page and 'id="net-balance"' in page and "15.00 USD" in page
    billing.issue_credit_note(acme["op"], inv, reason="the rest")
    assert billing.left_to_credit(inv) == 0
    with pytest.raises(ServiceError, match="nothing left to credit"):
        billing.issue_credit_note(acme["op"], inv, reason="once more")
    with pytest.raises(ServiceError, match="between 0.01 and 0.00"):  # over-crediting a line is refused
        billing.issue_credit_note(acme["op"], inv, reason="more", lines=[(inv.lines.get().pk, D("0.01"))])
    page = client.get(f"/console/invoices/{inv.pk}/").content.decode()
    assert 'id="credit-note"' not in page and 'id="fully-credited"' in page and "0.00 USD" in page
    client.force_login(acme["owner"])
    page = client.get(f"/portal/invoices/{inv.pk}/").content.decode()
    assert 'id="net-balance"' in page and "0.00 USD" in page and "20.00 USD credited" in page
    _, secret = make_key(acme["tenant"], ["billing:read"])
    api = as_key(secret)
    one = api.get(f"/api/v1/invoices/{inv.pk}/").json()
    assert (one["total"], one["credited"], one["net_total"]) == ("20.00", "20.00", "0.00")
    listed = api.get("/api/v1/invoices/").json()["results"]
    assert [(x["credited"], x["net_total"]) for x in listed if x["id"] == inv.pk] == [("20.00", "0.00")]


def test_a_draft_has_nothing_to_credit(tiers):
    inv = InvoiceFactory(total=D("3.00"))
    InvoiceLineFactory(invoice=inv, tier=tiers["3g"], amount=D("3.00"))
    assert billing.left_to_credit(inv) == 0
