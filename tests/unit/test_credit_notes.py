"""Credit notes (issue 14): an operator corrects a finalized invoice (which never changes) with a
numbered, immutable credit note, optionally with corrected charges the next invoice carries; in the
API (with CSV/JSON export), webhooks (credit_note.issued), console and portal. Late usage that would
have lowered a finalized reserved top-up is credited on the invoice that charges it."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from marketplace.models import (
    CreditNote,
    InvoiceLine,
    PricePlan,
    WebhookDelivery,
    WebhookEndpoint,
)
from marketplace.services import billing
from telemetry.models import UsageHourly
from tenants.errors import Conflict, Forbidden
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import (
    AllocationFactory,
    DeploymentFactory,
    MembershipFactory,
    OrderFactory,
    PricePlanFactory,
    TenantFactory,
    UsageHourlyFactory,
    make_key,
)

pytestmark = pytest.mark.django_db
D = Decimal
T0 = datetime(2026, 10, 1, tzinfo=UTC)
OCT, NOV = date(2026, 10, 1), date(2026, 11, 1)
NOV2, DEC2 = datetime(2026, 11, 2, tzinfo=UTC), datetime(2026, 12, 2, tzinfo=UTC)


@pytest.fixture
def billed(catalog, tiers):
    tenant = TenantFactory(slug="acme")
    owner = MembershipFactory(tenant=tenant, role=Role.OWNER).user
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).update(effective_from=T0 - timedelta(days=30),
                                               price_per_slice_hour=D("2.0000"))
    order = OrderFactory(tenant=tenant, tier=tier)
    AllocationFactory(order=order, tenant=tenant, tier=tier, state="active", activated_at=T0,
                      released_at=T0 + timedelta(hours=10))
    inv = billing.finalize(billing.draft_for(tenant, OCT), now=NOV2)
    return tenant, owner, inv


def test_credit_note_numbered_immutable_and_corrected_charge_on_the_next_invoice(billed, operator, as_user):
    tenant, owner, inv = billed
    assert inv.total == D("20.00")
    ep = WebhookEndpoint.objects.create(tenant=tenant, url="https://hooks.example.com/", secret="s",
                                        events=["credit_note.issued"])
    r = as_user(operator).post(f"/api/v1/invoices/{inv.pk}/credit-note/", {
        "reason": "slice-hour price was wrong", "recharge": [{"description": "10 h at 1.50", "amount": "15.00"}]},
        format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["number"] == f"CN-{datetime.now(UTC).year}-000001" and D(body["total"]) == D("20.00")
    inv.refresh_from_db()
    assert inv.total == D("20.00") and inv.status == "finalized"  # the invoice itself never changes
    d = WebhookDelivery.objects.get(endpoint=ep, event="credit_note.issued")
    assert d.payload["data"]["number"] == body["number"] and d.payload["data"]["invoice"] == inv.number
    # fully credited: nothing left
    again = as_user(operator).post(f"/api/v1/invoices/{inv.pk}/credit-note/", {"reason": "again"}, format="json")
    assert again.status_code == 400
    nov = billing.finalize(billing.draft_for(tenant, NOV), now=DEC2)
    corr = nov.lines.get(kind="correction")
    assert corr.amount == D("15.00") and body["number"] in corr.description
    cn = CreditNote.objects.get(number=body["number"])
    assert cn.recharged_on_id == nov.pk
    dec = billing.refresh(billing.draft_for(tenant, date(2026, 12, 1)), now=DEC2)
    assert not dec.lines.filter(kind="correction").exists()  # carried once


def test_partial_credit_by_line_and_who_may_issue(billed, operator, as_user, as_key):
    tenant, owner, inv = billed
    line = inv.lines.get()
    with pytest.raises(Forbidden):
        billing.issue_credit_note(principal_for_user(owner), inv, reason="x")
    assert as_user(owner).post(f"/api/v1/invoices/{inv.pk}/credit-note/", {"reason": "x"},
                               format="json").status_code == 403
    op = principal_for_user(operator)
    cn = billing.issue_credit_note(op, inv, reason="goodwill", lines=[(line.pk, D("5.00"))])
    assert cn.total == D("5.00")
    with pytest.raises(Exception, match="between 0.01 and 15.00"):
        billing.issue_credit_note(op, inv, reason="too much", lines=[(line.pk, D("15.01"))])
    draft = billing.draft_for(tenant, NOV)
    with pytest.raises(Conflict):
        billing.issue_credit_note(op, draft, reason="a draft")
    _, key = make_key(tenant, ["billing:read"])
    api = as_key(key)
    listed = api.get("/api/v1/credit-notes/").json()
    assert [x["number"] for x in listed["results"]] == [cn.number]
    assert api.get(f"/api/v1/invoices/{inv.pk}/").json()["credit_notes"][0]["number"] == cn.number
    csv = api.get(f"/api/v1/credit-notes/{cn.pk}/export/csv/")
    assert csv.status_code == 200 and csv["Content-Type"].startswith("text/csv") and cn.number in csv.content.decode()
    assert api.get(f"/api/v1/credit-notes/{cn.pk}/export/?format=csv").content == csv.content  # the older link
    js = api.get(f"/api/v1/credit-notes/{cn.pk}/export/?format=json").json()
    assert js["total"] == "5.00" and js["invoice"] == inv.number
    other = TenantFactory(slug="other")
    _, other_key = make_key(other, ["billing:read"])
    assert as_key(other_key).get(f"/api/v1/credit-notes/{cn.pk}/").status_code == 404
    page = as_user(owner).get(f"/portal/invoices/{inv.pk}/")
    assert page.status_code == 200 and cn.number in page.content.decode()
    console = as_user(operator).get(f"/console/invoices/{inv.pk}/")
    assert console.status_code == 200 and cn.number in console.content.decode()


def test_console_issues_a_credit_note(billed, operator, as_user):
    tenant, owner, inv = billed
    r = as_user(operator).post(f"/console/invoices/{inv.pk}/credit-note/", {"reason": "duplicate billing"},
                               format="multipart")  # a browser form
    assert r.status_code == 302
    cn = CreditNote.objects.get(invoice=inv)
    assert cn.total == inv.total and cn.reason == "duplicate billing"


def test_late_usage_that_would_lower_a_finalized_top_up_is_credited(catalog, tiers):
    tier = tiers["3g"]
    since = T0 - timedelta(days=30)
    PricePlanFactory(tier=tier, kind="reserved", currency="USD", effective_from=since,
                     price_per_slice_hour=D("0"), price_per_1m_input_tokens=D("1.0000"),
                     price_per_1m_output_tokens=D("1.0000"), monthly_commit=D("100.00"))
    t = TenantFactory(slug="resv")
    order = OrderFactory(tenant=t, tier=tier, plan_kind="reserved")
    a = AllocationFactory(order=order, tenant=t, tier=tier, state="active", activated_at=T0,
                          released_at=datetime(2026, 11, 1, tzinfo=UTC))  # all October
    dep = DeploymentFactory(allocation=a, tenant=t, name="llm", backend="python", spec={},
                            memory_mb=10, state="ready")
    row = UsageHourlyFactory(tenant=t, deployment=dep, hour=T0 + timedelta(hours=3),
                             input_tokens=30_000_000, output_tokens=0, requests=1)  # 30.00 at the plan
    oct_inv = billing.finalize(billing.draft_for(t, OCT), now=NOV2)
    assert oct_inv.lines.get(kind="commitment_topup").amount == D("70.00")
    UsageHourly.objects.filter(pk=row.pk).update(input_tokens=50_000_000)  # 20.00 more, late
    nov = billing.refresh(billing.draft_for(t, NOV), now=datetime(2026, 11, 20, tzinfo=UTC))
    assert nov.lines.get(kind="adjustment_input").amount == D("20.00")
    credit = nov.lines.get(kind="commitment_credit")
    assert credit.amount == D("-20.00")  # October owed 100.00 in all: 30 + 20 of usage + a 50.00 top-up
    nov = billing.finalize(nov, now=DEC2)
    UsageHourly.objects.filter(pk=row.pk).update(input_tokens=150_000_000)  # 100.00 more, late again
    dec = billing.refresh(billing.draft_for(t, date(2026, 12, 1)), now=datetime(2026, 12, 20, tzinfo=UTC))
    assert dec.lines.get(kind="commitment_credit").amount == D("-50.00")  # only what is left of the top-up
    assert InvoiceLine.objects.filter(invoice=oct_inv).get(kind="commitment_topup").amount == D("70.00")


def test_invoice_list_and_detail_answer_what_their_serializers_write(billed, operator, as_user):
    """The invoice reads answer from rows (issue 17): the same content as InvoiceListSerializer and
    InvoiceSerializer give for the same invoices, a finalized one with lines and two credit notes and a draft
    (no number, no finalized_at), so the schema the serializers document stays the answer."""
    from marketplace.api.billing import InvoiceListSerializer, InvoiceSerializer
    from marketplace.selectors import billing as selectors

    tenant, _owner, inv = billed
    op = principal_for_user(operator)
    line = inv.lines.get()
    billing.issue_credit_note(op, inv, reason="goodwill", lines=[(line.pk, D("5.00"))])
    billing.issue_credit_note(op, inv, reason="more", lines=[(line.pk, D("2.50"))])
    draft = billing.draft_for(tenant, NOV)
    api = as_user(operator)
    listed = api.get("/api/v1/invoices/?ordering=period_start").json()["results"]
    want = InvoiceListSerializer(selectors.invoices(op).order_by("period_start"), many=True).data
    assert listed == [dict(x) for x in want]
    assert [len(x["credit_notes"]) for x in listed] == [2, 0] and listed[1]["number"] is None
    for i in (inv, draft):
        want_one = InvoiceSerializer(selectors.invoices(op).get(pk=i.pk)).data
        assert api.get(f"/api/v1/invoices/{i.pk}/").json() == want_one
    assert api.get(f"/api/v1/invoices/{inv.pk}/").json()["lines"][0]["amount"] == "20.00"
    # one invoice asked for with filters is still filtered (a finalized invoice is no draft)
    assert api.get(f"/api/v1/invoices/{inv.pk}/?status=draft").status_code == 404
    assert api.get(f"/api/v1/invoices/{inv.pk}/?status=finalized").status_code == 200


def test_one_sign_for_a_credit_note_everywhere(billed, operator, as_user):
    """A credit note's amounts are what it credits, positive, in the model, the API, both exports, the webhook and
    the invoice's CSV and pages (issue 30: its JSON export said 0.01 where its CSV said -0.01)."""
    import csv
    import io

    tenant, owner, inv = billed
    line = inv.lines.get()
    cn = billing.issue_credit_note(principal_for_user(operator), inv, reason="goodwill", lines=[(line.pk, D("0.01"))])
    api = as_user(operator)
    js = api.get(f"/api/v1/credit-notes/{cn.pk}/export/").json()
    assert (js["total"], [x["amount"] for x in js["lines"]]) == ("0.01", ["0.01"])
    assert [x["id"] for x in js["lines"]] == [cn.lines.get().pk]  # the schema requires it
    rows = list(csv.reader(io.StringIO(api.get(f"/api/v1/credit-notes/{cn.pk}/export/csv/").content.decode())))
    assert rows[2] == [str(line.pk), line.description, "0.01"] and rows[3] == ["total", "", "0.01"]
    assert api.get(f"/api/v1/credit-notes/{cn.pk}/").json()["total"] == "0.01"
    assert billing.credit_note_payload(cn)["total"] == "0.01"  # the credit_note.issued webhook's body
    invoice_rows = list(csv.reader(io.StringIO(api.get(f"/api/v1/invoices/{inv.pk}/export/csv/").content.decode())))
    assert [r[7] for r in invoice_rows if r[0] == "credit_note"] == ["0.01"]
    for page in (as_user(owner).get(f"/portal/invoices/{inv.pk}/"),
                 as_user(operator).get(f"/console/invoices/{inv.pk}/")):
        html = page.content.decode()
        table = html[html.index('id="credit-notes"'):]
        assert "0.01" in table and "-$" not in table and "-0.01" not in table


def _inline(node, doc):
    """A schema of /api/schema/ with its $refs replaced by what they name."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(doc["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]], doc)
        return {k: _inline(v, doc) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, doc) for v in node]
    return node


def _fields(schema) -> set[str]:
    return set(schema.get("properties", {}))


def test_the_json_exports_answer_what_the_schema_documents(billed, operator, api):
    """invoice_payload and credit_note_payload (the JSON exports and the webhooks' bodies, written in billing) are
    valid InvoiceExport and CreditNoteExport documents of /api/schema/ (the schema a generated client parses with:
    every required field, its type and format), with no field the schema does not name."""
    from openapi_schema_validator import OAS30ReadValidator

    tenant, _owner, inv = billed
    cn = billing.issue_credit_note(principal_for_user(operator), inv, reason="goodwill",
                                   recharge=[{"description": "10 h at 1.50", "amount": "15.00"}])
    doc = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for payload, name, nested in ((billing.invoice_payload(inv), "InvoiceExport", ("lines", "credit_notes")),
                                  (billing.credit_note_payload(cn), "CreditNoteExport", ("lines", "recharge"))):
        schema = _inline(doc["components"]["schemas"][name], doc)
        OAS30ReadValidator(schema).validate(payload)
        assert set(payload) == _fields(schema), name
        for key in nested:
            assert payload[key] and all(set(x) == _fields(schema["properties"][key]["items"]) for x in payload[key])
