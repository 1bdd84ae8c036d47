"""An integrator's view of the billing API: a client generated with openapi-python-client from
/api/schema/ parses every billing answer (usage, spend, the invoice and credit-note exports as JSON and as CSV,
errors) into its models, or returns the CSV as text."""

from __future__ import annotations

import csv
import importlib
import io
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from marketplace.models import PricePlan
from marketplace.services import billing
from tenants.scoping import principal_for_user
from tests.factories import (
    AllocationFactory,
    DeploymentFactory,
    OperatorFactory,
    OrderFactory,
    TenantFactory,
    UsageHourlyFactory,
    make_key,
)

GENERATOR = shutil.which("openapi-python-client") or str(Path(sys.executable).with_name("openapi-python-client"))
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(GENERATOR).exists(), reason="openapi-python-client is not installed (dev extra)"),
]
T0 = datetime(2026, 10, 1, tzinfo=UTC)


@pytest.fixture
def generated_client(live_server, tmp_path):
    import urllib.request

    schema = tmp_path / "schema.json"
    schema.write_bytes(urllib.request.urlopen(f"{live_server.url}/api/schema/?format=json").read())
    out = tmp_path / "tessera_billing_client"
    run = subprocess.run([GENERATOR, "generate", "--path", str(schema), "--meta", "none", "--output-path", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("tessera_billing_client")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("tessera_billing_client")]:
            del sys.modules[name]


def test_generated_client_calls_the_billing_endpoints(generated_client, live_server, catalog, tiers):
    c = generated_client
    tenant = TenantFactory(slug="integrator")
    tier = tiers["3g"]
    PricePlan.objects.filter(tier=tier).update(effective_from=T0 - timedelta(days=30))
    order = OrderFactory(tenant=tenant, tier=tier)
    alloc = AllocationFactory(order=order, tenant=tenant, tier=tier, state="active", activated_at=T0,
                              released_at=T0 + timedelta(hours=3))
    dep = DeploymentFactory(allocation=alloc, tenant=tenant, name="llm", backend="python", spec={},
                            memory_mb=10, state="ready", created_at=T0)
    UsageHourlyFactory(tenant=tenant, deployment=dep, hour=T0 + timedelta(hours=1), input_tokens=1_000_000,
                       output_tokens=500_000, requests=3)
    inv = billing.finalize(billing.draft_for(tenant, T0.date()), now=datetime(2026, 11, 2, tzinfo=UTC))
    line = inv.lines.order_by("pk").first()
    cn = billing.issue_credit_note(principal_for_user(OperatorFactory()), inv, reason="goodwill",
                                   lines=[(line.pk, Decimal("0.01"))],
                                   recharge=[{"description": "corrected", "amount": "1.00"}])
    _, secret = make_key(tenant, ["billing:read"])
    api = c.AuthenticatedClient(base_url=live_server.url, token=secret, raise_on_unexpected_status=True)

    from tessera_billing_client.api.v1 import (
        v1_billing_spend_list,
        v1_billing_usage_retrieve,
        v1_credit_notes_export_csv_retrieve,
        v1_credit_notes_export_retrieve,
        v1_invoices_export_csv_retrieve,
        v1_invoices_export_retrieve,
    )
    from tessera_billing_client.models import (
        CreditNoteExport,
        Error,
        InvoiceExport,
        PaginatedSpendRowList,
        UsageSummary,
        V1BillingUsageRetrieveGroupBy,
    )

    usage = v1_billing_usage_retrieve.sync(client=api, start=T0, end=T0 + timedelta(days=31),
                                           group_by=V1BillingUsageRetrieveGroupBy.DAY)
    assert isinstance(usage, UsageSummary)
    assert [(r.input_tokens, r.requests) for r in usage.results] == [(1_000_000, 3)]

    spend = v1_billing_spend_list.sync(client=api)  # paginated, like every list
    assert isinstance(spend, PaginatedSpendRowList) and spend.count == 1 and spend.results[0].tenant == "integrator"

    export = v1_invoices_export_retrieve.sync(inv.pk, client=api)
    assert isinstance(export, InvoiceExport)
    assert export.number == inv.number and Decimal(str(export.total)) == inv.total
    assert sum(Decimal(str(li.amount)) for li in export.lines) == inv.total

    # the CSV exports come back as text (they raised JSONDecodeError while the schema called them JSON)
    rows = list(csv.reader(io.StringIO(v1_invoices_export_csv_retrieve.sync(inv.pk, client=api))))
    assert rows[0][:2] == ["invoice", inv.number] and ["total", "", "", "", "", "", "", str(inv.total), "", ""] in rows
    assert [r[7] for r in rows if r[0] == "credit_note"] == ["0.01"]  # what it credits: positive
    note = list(csv.reader(io.StringIO(v1_credit_notes_export_csv_retrieve.sync(cn.pk, client=api))))
    assert note[0][:2] == ["credit_note", cn.number] and note[2] == [str(line.pk), line.description, "0.01"]
    assert ["total", "", "0.01"] in note and ["recharge", "corrected", "1.00"] in note
    cn_json = v1_credit_notes_export_retrieve.sync(cn.pk, client=api)
    assert isinstance(cn_json, CreditNoteExport) and cn_json.number == cn.number
    assert [(li.id, li.invoice_line, Decimal(str(li.amount))) for li in cn_json.lines] == [
        (cn.lines.get().pk, line.pk, Decimal("0.01"))]  # the same sign as in the CSV
    assert Decimal(str(cn_json.total)) == Decimal("0.01")

    for call in (v1_invoices_export_csv_retrieve, v1_invoices_export_retrieve):
        missing = call.sync_detailed(inv.pk + 999, client=api)
        assert missing.status_code == 404
        assert missing.headers["content-type"].startswith("application/json")
        assert isinstance(missing.parsed, Error) and missing.parsed.detail
