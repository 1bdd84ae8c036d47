"""Billing REST API (scope billing:read; operators see all): invoices with lines, CSV/JSON export,
finalize (operators), current spend against the limit, webhook endpoints and their delivery log."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import mixins, renderers, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.generics import GenericAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from marketplace.api.disclosure import reader_is_operator
from marketplace.filters import InvoiceFilter
from marketplace.models import CreditNote, CreditNoteLine, Invoice, InvoiceLine, Tier, WebhookDelivery, WebhookEndpoint
from marketplace.selectors import billing as selectors
from marketplace.selectors.exports import credit_note_csv, invoice_csv
from marketplace.services import billing, webhooks
from marketplace.services.billing import documents
from marketplace.services.billing.spend import Spend
from telemetry.selectors import usage_summary
from tenants.api.serializers import ScopedTenantField
from tenants.models import Tenant
from tenants.scoping import principal_for

from .pagination import OneQueryPagination
from .viewsets import ScopedViewSetMixin, reject_unsettable_fields


class InvoiceLineSerializer(serializers.ModelSerializer):
    tier: serializers.SlugRelatedField[Tier] = serializers.SlugRelatedField(slug_field="key", read_only=True)

    class Meta:
        model = InvoiceLine
        fields = ["id", "kind", "tier", "allocation", "deployment", "description", "quantity", "unit", "unit_price",
                  "amount", "usage_from", "usage_to"]


class CreditNoteBriefSerializer(serializers.ModelSerializer):
    class Meta:
        model = CreditNote
        fields = ["id", "number", "total", "issued_at"]


class InvoiceSerializer(serializers.ModelSerializer):
    """An invoice with its lines and credit notes: the schema of the invoice reads. The reads themselves answer
    through its SECOND COPY kept for speed, `InvoiceRows` (below), held equal to this serializer and
    InvoiceListSerializer by the property test tests/unit/test_invoice_rows.py."""

    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    lines = InvoiceLineSerializer(many=True, read_only=True)
    credit_notes = CreditNoteBriefSerializer(many=True, read_only=True, help_text="credit notes correcting it")
    credited = serializers.SerializerMethodField(help_text="what its credit notes credit in all (positive)")
    net_total = serializers.SerializerMethodField(help_text="what is owed: total less credited "
                                                            "(billing.credit_notes.net_balance)")

    class Meta:
        model = Invoice
        fields = ["id", "number", "tenant", "status", "period_start", "period_end", "currency", "total", "credited",
                  "net_total", "rated_at", "finalized_at", "lines", "credit_notes"]

    @extend_schema_field(serializers.DecimalField(max_digits=14, decimal_places=2))
    def get_credited(self, obj) -> str:
        return _dec(_MONEY, billing.money(sum((cn.total for cn in obj.credit_notes.all()), Decimal(0))))

    @extend_schema_field(serializers.DecimalField(max_digits=14, decimal_places=2))
    def get_net_total(self, obj) -> str:
        return _dec(_MONEY, billing.net_balance(obj.total, [cn.total for cn in obj.credit_notes.all()]))


class InvoiceKeyShareSerializer(serializers.Serializer):
    key = serializers.CharField(allow_null=True, help_text="the API key's prefix; null: usage served without a key "
                                "(recorded before keys were metered)")
    key_name = serializers.CharField(allow_null=True, help_text="the key's name (null: no key)")
    input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    amount = serializers.DecimalField(max_digits=14, decimal_places=2,
                                      help_text="its share of the invoice's token lines, in the invoice's currency")


class InvoiceKeysSerializer(serializers.Serializer):
    """An invoice's charges per API key: each token line's amount split over the keys served under it in
    proportion to their tokens, largest remainder to the cent (the shares of a line sum to it); `not_per_key` is the
    rest (slice-hours, commitments, corrections). keys' amounts + not_per_key = total."""

    invoice = serializers.IntegerField()
    currency = serializers.CharField()
    total = serializers.DecimalField(max_digits=14, decimal_places=2)
    keys = InvoiceKeyShareSerializer(many=True)
    not_per_key = serializers.DecimalField(max_digits=14, decimal_places=2)


class InvoiceListSerializer(InvoiceSerializer):
    class Meta(InvoiceSerializer.Meta):
        fields = [f for f in InvoiceSerializer.Meta.fields if f != "lines"]


# The invoice reads (list, detail) answer from rows (selectors' .values()) through these: a SECOND COPY, kept for
# speed, of what the serializers above write for the same rows (their fields' own to_representation), without
# building model instances and walking the serializer's fields for each. The serializers stay the schema;
# tests/unit/test_invoice_rows.py holds the two equal (a property test).
_DATE = serializers.DateField()
_DATETIME = serializers.DateTimeField()
_MONEY = serializers.DecimalField(max_digits=14, decimal_places=2)
_QUANTITY = serializers.DecimalField(max_digits=24, decimal_places=6)
_UNIT_PRICE = serializers.DecimalField(max_digits=12, decimal_places=4)


def _dec(field, value):
    """DRF's DecimalField.to_representation: a value the database gives at the field's scale is its own
    quantization, written '{:f}'; anything else through the field."""
    if value is None:
        return None
    if isinstance(value, Decimal) and value.as_tuple().exponent == -field.decimal_places:
        return f"{value:f}"
    return field.to_representation(value)


class InvoiceRows:
    """Writes rows as the serializers would, made once per answer: the current time zone and DRF's date and
    datetime formats are read once, not per value (an invoice list of 500 looked the time zone up 1,000 times)."""

    def __init__(self) -> None:
        from rest_framework.settings import api_settings

        self.tz = timezone.get_current_timezone()
        self.iso_dates = (api_settings.DATE_FORMAT or "").lower() == "iso-8601"
        self.iso_datetimes = (api_settings.DATETIME_FORMAT or "").lower() == "iso-8601"

    def date(self, value):
        if value is None:
            return None
        return value.isoformat() if self.iso_dates else _DATE.to_representation(value)

    def dt(self, value):
        """DRF's DateTimeField.to_representation (ISO 8601 in the current time zone, "Z" for UTC) for the aware
        datetimes the database gives; anything else through the field."""
        if value is None:
            return None
        if value.tzinfo is None or not self.iso_datetimes:
            return _DATETIME.to_representation(value)
        s = value.astimezone(self.tz).isoformat()
        return s[:-6] + "Z" if s.endswith("+00:00") else s

    def credit_note_brief(self, r: dict) -> dict:
        """A credit_notes_of row as CreditNoteBriefSerializer writes it."""
        return {"id": r["id"], "number": r["number"], "total": _dec(_MONEY, r["total"]),
                "issued_at": self.dt(r["issued_at"])}

    def line(self, r: dict) -> dict:
        """An invoice_lines row as InvoiceLineSerializer writes it."""
        return {"id": r["id"], "kind": r["kind"], "tier": r["tier__key"], "allocation": r["allocation_id"],
                "deployment": r["deployment_id"], "description": r["description"],
                "quantity": _dec(_QUANTITY, r["quantity"]), "unit": r["unit"],
                "unit_price": _dec(_UNIT_PRICE, r["unit_price"]),
                "amount": _dec(_MONEY, r["amount"]), "usage_from": self.dt(r["usage_from"]),
                "usage_to": self.dt(r["usage_to"])}

    def invoice(self, r: dict, credit_notes: list[dict], lines: list[dict] | None = None) -> dict:
        """An invoice_list row (selectors.INVOICE_ROW) as InvoiceListSerializer writes it, or with `lines` (rows
        of invoice_lines) as InvoiceSerializer does."""
        out = {"id": r["id"], "number": r["number"], "tenant": r["tenant__slug"], "status": r["status"],
               "period_start": self.date(r["period_start"]), "period_end": self.date(r["period_end"]),
               "currency": r["currency"], "total": _dec(_MONEY, r["total"]),
               "credited": _dec(_MONEY, billing.money(sum((c["total"] for c in credit_notes), Decimal(0)))),
               "net_total": _dec(_MONEY, billing.net_balance(r["total"], [c["total"] for c in credit_notes])),
               "rated_at": self.dt(r["rated_at"]), "finalized_at": self.dt(r["finalized_at"])}
        if lines is not None:
            out["lines"] = [self.line(x) for x in lines]
        out["credit_notes"] = [self.credit_note_brief(c) for c in credit_notes]
        return out


class ExportLineSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=InvoiceLine.Kind.choices)
    tier = serializers.CharField()
    deployment = serializers.IntegerField(allow_null=True)
    description = serializers.CharField()
    quantity = serializers.DecimalField(max_digits=24, decimal_places=6)
    unit = serializers.CharField()
    unit_price = serializers.DecimalField(max_digits=12, decimal_places=4)
    amount = serializers.DecimalField(max_digits=14, decimal_places=2)
    usage_from = serializers.DateTimeField()
    usage_to = serializers.DateTimeField()


class CreditNoteBriefExportSerializer(serializers.Serializer):
    number = serializers.CharField()
    total = serializers.DecimalField(max_digits=14, decimal_places=2)


class InvoiceExportSerializer(serializers.Serializer):
    """The JSON export (the same body the invoice.finalized webhook carries)."""

    number = serializers.CharField(allow_null=True)
    tenant = serializers.CharField()
    status = serializers.ChoiceField(choices=Invoice.Status.choices)
    period_start = serializers.DateField()
    period_end = serializers.DateField()
    currency = serializers.CharField()
    total = serializers.DecimalField(max_digits=14, decimal_places=2)
    pdf_url = serializers.CharField(help_text="its PDF (GET, the API's authentication); absolute when "
                                              "TESSERA_SITE_URL is set")
    credit_notes = CreditNoteBriefExportSerializer(many=True)
    lines = ExportLineSerializer(many=True)


class SpendRowSerializer(serializers.Serializer):
    """One tenant's spend figure against its limit (billing.spend: the same figure and rule orders, the gateway,
    the console and the portal use)."""

    tenant = serializers.CharField()
    spend = serializers.DecimalField(max_digits=14, decimal_places=2,
                                     help_text="the month's invoice as last rated (see rated_at); 0: no invoice")
    currency = serializers.CharField()
    limit = serializers.DecimalField(max_digits=14, decimal_places=2, allow_null=True,
                                     help_text="null: no limit; 0: nothing may be spent (blocked from the start)")
    ratio = serializers.FloatField(allow_null=True, help_text="spend / limit; null without a limit or with a limit "
                                                              "of 0")
    warn = serializers.BooleanField(help_text="spend >= limit x the warning ratio (never without a limit)")
    blocked = serializers.BooleanField(help_text="spend >= limit x the block ratio (never without a limit; always "
                                                 "with a limit of 0): new orders and inference are refused")
    period_start = serializers.DateField()
    status = serializers.ChoiceField(choices=Invoice.Status.choices, allow_null=True,
                                     help_text="the month's invoice; null: no usage this month")
    rated_at = serializers.DateTimeField(
        allow_null=True, help_text="how fresh the figure is: when the month's invoice was last rated (the rating beat "
                                   "re-rates drafts every TESSERA_RATING_INTERVAL_S); null: no invoice this month")


class UsageRowSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    deployment = serializers.IntegerField(required=False, help_text="group_by=deployment")
    model = serializers.CharField(required=False, allow_null=True, help_text="group_by=deployment")
    allocation = serializers.IntegerField(required=False, allow_null=True, help_text="group_by=deployment")
    tier = serializers.CharField(required=False, allow_null=True, help_text="group_by=deployment or tier")
    hour = serializers.DateTimeField(required=False, help_text="group_by=hour")
    day = serializers.DateTimeField(required=False, help_text="group_by=day")
    key = serializers.CharField(required=False, allow_null=True,
                                help_text="group_by=key: the API key's prefix; null: usage served for no key")
    key_name = serializers.CharField(required=False, allow_null=True, help_text="group_by=key: the key's name")
    input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    requests = serializers.IntegerField()
    events = serializers.IntegerField()
    billed_input_tokens = serializers.IntegerField()
    billed_output_tokens = serializers.IntegerField()
    billed_requests = serializers.IntegerField()
    unbilled_input_tokens = serializers.IntegerField()
    unbilled_output_tokens = serializers.IntegerField()
    unbilled_requests = serializers.IntegerField()


class UsageSummarySerializer(serializers.Serializer):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    group_by = serializers.CharField()
    results = UsageRowSerializer(many=True)


class CreditNoteLineSerializer(serializers.ModelSerializer):
    amount = serializers.DecimalField(max_digits=14, decimal_places=2, read_only=True,
                                      help_text="what is credited on the invoice line: positive")

    class Meta:
        model = CreditNoteLine
        fields = ["id", "invoice_line", "description", "amount"]


class RechargeSerializer(serializers.Serializer):
    description = serializers.CharField(max_length=200)
    amount = serializers.DecimalField(max_digits=14, decimal_places=2, min_value=Decimal("0.01"))


class CreditNoteSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    invoice_number = serializers.CharField(source="invoice.number", read_only=True)
    recharged_on: serializers.SlugRelatedField[Invoice] = serializers.SlugRelatedField(
        slug_field="number", read_only=True, allow_null=True,
        help_text="the invoice that carried the corrected charges")
    lines = CreditNoteLineSerializer(many=True, read_only=True)
    recharge = RechargeSerializer(many=True, read_only=True)

    class Meta:
        model = CreditNote
        fields = ["id", "number", "tenant", "invoice", "invoice_number", "currency", "total", "reason", "issued_at",
                  "issued_by", "lines", "recharge", "recharged_on"]


class CreditLineRequestSerializer(serializers.Serializer):
    line = serializers.IntegerField(help_text="an invoice line id")
    amount = serializers.DecimalField(max_digits=14, decimal_places=2)


class CreditNoteRequestSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500)
    lines = CreditLineRequestSerializer(many=True, required=False,
                                        help_text="what to credit per line; omitted: every line in full")
    recharge = RechargeSerializer(many=True, required=False,
                                  help_text="the corrected charges, carried by the tenant's next invoice")


class CreditNoteExportSerializer(serializers.Serializer):
    """The JSON export (the same body the credit_note.issued webhook carries). Amounts are what is credited,
    positive, as in the CSV export and the credit note itself (billing.credit_notes: one sign convention)."""

    number = serializers.CharField()
    invoice = serializers.CharField()
    tenant = serializers.CharField()
    currency = serializers.CharField()
    total = serializers.DecimalField(max_digits=14, decimal_places=2, help_text="what is credited in all: positive")
    reason = serializers.CharField()
    issued_at = serializers.DateTimeField()
    lines = CreditNoteLineSerializer(many=True)
    recharge = RechargeSerializer(many=True)
    recharged_on = serializers.CharField(allow_null=True)
    pdf_url = serializers.CharField(help_text="its PDF (GET, the API's authentication); absolute when "
                                              "TESSERA_SITE_URL is set")




class PdfRenderer(renderers.BaseRenderer):
    media_type = "application/pdf"
    format = "pdf"
    charset = None
    render_style = "binary"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return data


def pdf_answer(make, doc) -> Response:
    """A document's PDF (billing.documents), or a 503 saying why the PDF library cannot be loaded here."""
    try:
        body = make(doc)
    except documents.PdfUnavailable as exc:
        return Response({"detail": str(exc), "code": "pdf_unavailable"}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
    resp = Response(body, content_type="application/pdf")
    resp["Content-Disposition"] = f'attachment; filename="{documents.filename(doc)}"'
    return resp


PDF = OpenApiResponse(response=OpenApiTypes.BINARY, description=(
    "The document as a PDF (billing.documents): the MSP and the tenant's billing details, the lines, totals and "
    "currency; an invoice also per tier and per API key, a draft with a DRAFT watermark. A finalized invoice's or "
    "a credit note's PDF never changes (the parties printed are frozen when it is finalized or issued). 503 with "
    "`code` pdf_unavailable when the PDF library cannot be loaded on the server."))


class CsvRenderer(renderers.BaseRenderer):
    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, str | bytes):
            return data
        return "\n".join(f"{k},{v}" for k, v in (data or {}).items())  # (errors are rendered as JSON: below)


class JsonErrorsMixin:
    """Errors are JSON whatever format was asked (an integrator's client parses them as JSON, CSV export included),
    a 406 too (the request named no media type the operation renders, so none was chosen)."""

    def finalize_response(self, request, response, *args, **kwargs):
        if response.status_code >= 400 and getattr(getattr(request, "accepted_renderer", None), "format",
                                                   "csv") in ("csv", "pdf"):
            request.accepted_renderer = renderers.JSONRenderer()
            request.accepted_media_type = "application/json"
        return super().finalize_response(request, response, *args, **kwargs)


def csv_answer(text: str, filename: str) -> Response:
    resp = Response(text, content_type="text/csv; charset=utf-8")
    resp["Content-Disposition"] = f'attachment; filename="{filename}.csv"'
    return resp


#: The exports' CSV, documented as what it is (text/csv, a string): a generated client returns it as text.
INVOICE_CSV = OpenApiResponse(response=OpenApiTypes.STR, description=(
    "The invoice as CSV (UTF-8): a header row (invoice, its number or `draft`, tenant, period, currency, status), "
    "a column row (kind, tier, deployment, description, quantity, unit, unit_price, amount, usage_from, usage_to), "
    "one row per line (usage first, then commitment top-ups), a `total` row, then one `credit_note` row per credit "
    "note correcting it (number, reason, the amount credited: positive, issued_at); then, when it has token lines, "
    "the charges per API key (as `keys/`): a `by_key` column row (key, key_name, input_tokens, output_tokens, "
    "amount), one `key` row per key (an empty key: usage served without one) and a `not_per_key` row (slice-hours, "
    "commitments, corrections); the keys' amounts and not_per_key sum to the total."))
CREDIT_NOTE_CSV = OpenApiResponse(response=OpenApiTypes.STR, description=(
    "The credit note as CSV (UTF-8): a header row (credit_note, number, invoice, tenant, currency), a column row "
    "(invoice_line, description, amount), one row per line (the amount credited: positive), a `total` row, then "
    "one `recharge` row per corrected charge the next invoice carries."))
LEGACY_CSV = ("`?format=csv` is still answered with the CSV of `export/csv/` for links made before it existed; "
              "it is not part of this operation's documented answer (a generated client calls `export/csv/`).")
LEGACY_FORMAT = OpenApiParameter("format", exclude=True)  # (drf-spectacular would offer format=csv here)


class InvoiceViewSet(JsonErrorsMixin, ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Invoices, one per tenant and month. Drafts are re-rated on request (POST refresh) and by beat;
    a finalized invoice never changes."""

    queryset_model = Invoice
    selector = selectors.invoices
    serializer_class = InvoiceSerializer
    filterset_class = InvoiceFilter
    ordering_fields = ["period_start", "total", "number"]
    ordering = ["-period_start", "tenant__slug"]
    capabilities = {"list": "billing", "retrieve": "billing", "export": "billing", "export_csv": "billing",
                    "keys": "billing", "pdf": "billing",
                    "refresh": "refresh_billing", "finalize": "operate", "credit_note": "operate"}

    def get_serializer_class(self):
        return InvoiceListSerializer if self.action == "list" else InvoiceSerializer

    def get_queryset(self):
        if not getattr(self, "swagger_fake_view", False):
            if self.action == "list":  # rows, no lines: a list shows none, and they grow with usage
                return selectors.invoice_list(self.principal)
            if self.action == "retrieve":  # its lines and credit notes are read as rows
                return selectors.invoice_head(self.principal)
        return super().get_queryset()

    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        notes = selectors.credit_notes_of(r["id"] for r in page if r["has_credit_notes"])
        rows = InvoiceRows()
        return self.get_paginated_response([rows.invoice(r, notes.get(r["id"], [])) for r in page])

    def retrieve(self, request, *args, **kwargs):
        inv = self.get_object()
        row = {f: getattr(inv, f) for f in selectors.INVOICE_ROW if f != "tenant__slug"}
        row["tenant__slug"] = inv.tenant.slug
        notes = selectors.credit_notes_of([inv.pk] if inv.has_credit_notes else [])
        return Response(InvoiceRows().invoice(row, notes.get(inv.pk, []), list(selectors.invoice_lines(inv.pk))))

    def filter_queryset(self, queryset):
        # One invoice asked for without query parameters: the filters (a FilterSet and its form built per
        # request, ~1 ms) would filter nothing and its ordering order one row.
        if self.action == "retrieve" and not self.request.query_params:
            return queryset
        return super().filter_queryset(queryset)

    @extend_schema(description=f"The invoice as JSON (the body of the invoice.finalized webhook). {LEGACY_CSV}",
                   parameters=[LEGACY_FORMAT], responses={(200, "application/json"): InvoiceExportSerializer})
    @action(detail=True, methods=["get"], renderer_classes=[renderers.JSONRenderer, CsvRenderer])
    def export(self, request, pk=None):
        invoice = self.get_object()
        if request.accepted_renderer.format == "csv":
            return csv_answer(invoice_csv(invoice), invoice.number or f"draft-{invoice.pk}")
        return Response(billing.invoice_payload(invoice))

    @extend_schema(summary="The invoice's charges per API key", responses=InvoiceKeysSerializer)
    @action(detail=True, methods=["get"])
    def keys(self, request, pk=None):
        invoice = self.get_object()
        split = selectors.key_breakdown(invoice)
        return Response(InvoiceKeysSerializer({"invoice": invoice.pk, "currency": invoice.currency,
                                               "total": invoice.total, **split}).data)

    @extend_schema(summary="The invoice as CSV", responses={(200, "text/csv"): INVOICE_CSV})
    @action(detail=True, methods=["get"], url_path="export/csv", url_name="export-csv",
            renderer_classes=[CsvRenderer])
    def export_csv(self, request, pk=None):
        invoice = self.get_object()
        return csv_answer(invoice_csv(invoice), invoice.number or f"draft-{invoice.pk}")

    @extend_schema(summary="The invoice as PDF", responses={(200, "application/pdf"): PDF})
    @action(detail=True, methods=["get"], renderer_classes=[PdfRenderer])
    def pdf(self, request, pk=None):
        return pdf_answer(documents.invoice_pdf, self.get_object())

    @extend_schema(request=None, responses=InvoiceSerializer)
    @action(detail=True, methods=["post"])
    def refresh(self, request, pk=None):
        invoice = billing.refresh(self.get_object())
        return Response(InvoiceSerializer(self.get_queryset().get(pk=invoice.pk)).data)

    @extend_schema(request=CreditNoteRequestSerializer, responses={201: CreditNoteSerializer})
    @action(detail=True, methods=["post"], url_path="credit-note", url_name="credit-note")
    def credit_note(self, request, pk=None):
        """Operators: correct a finalized invoice with a numbered, immutable credit note."""
        invoice = self.get_object()  # another tenant's invoice is a 404 before the body is looked at
        body = CreditNoteRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        reject_unsettable_fields(body, request.data)
        d = body.validated_data
        cn = billing.issue_credit_note(
            principal_for(request), invoice, reason=d["reason"],
            lines=[(x["line"], x["amount"]) for x in d["lines"]] if "lines" in d else None,
            recharge=[dict(x) for x in d.get("recharge", [])])
        return Response(CreditNoteSerializer(cn).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=InvoiceSerializer)
    @action(detail=True, methods=["post"])
    def finalize(self, request, pk=None):
        invoice = billing.finalize(self.get_object(), force=request.query_params.get("force") == "1",
                                   principal=principal_for(request))
        return Response(InvoiceSerializer(self.get_queryset().get(pk=invoice.pk)).data)


class CreditNoteViewSet(JsonErrorsMixin, ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Credit notes (scope billing:read; operators see all): numbered, immutable corrections of finalized
    invoices, with CSV/JSON export."""

    queryset_model = CreditNote
    selector = selectors.credit_notes
    serializer_class = CreditNoteSerializer
    filterset_fields = ["invoice", "currency"]
    ordering_fields = ["issued_at", "number", "total"]
    ordering = ["-issued_at"]
    capabilities = {"list": "billing", "retrieve": "billing", "export": "billing", "export_csv": "billing",
                    "pdf": "billing"}

    @extend_schema(description=f"The credit note as JSON (the body of the credit_note.issued webhook). "
                               f"{LEGACY_CSV}",
                   parameters=[LEGACY_FORMAT], responses={(200, "application/json"): CreditNoteExportSerializer})
    @action(detail=True, methods=["get"], renderer_classes=[renderers.JSONRenderer, CsvRenderer])
    def export(self, request, pk=None):
        cn = self.get_object()
        if request.accepted_renderer.format == "csv":
            return csv_answer(credit_note_csv(cn), cn.number)
        return Response(billing.credit_note_payload(cn))

    @extend_schema(summary="The credit note as CSV", responses={(200, "text/csv"): CREDIT_NOTE_CSV})
    @action(detail=True, methods=["get"], url_path="export/csv", url_name="export-csv",
            renderer_classes=[CsvRenderer])
    def export_csv(self, request, pk=None):
        cn = self.get_object()
        return csv_answer(credit_note_csv(cn), cn.number)

    @extend_schema(summary="The credit note as PDF", responses={(200, "application/pdf"): PDF})
    @action(detail=True, methods=["get"], renderer_classes=[PdfRenderer])
    def pdf(self, request, pk=None):
        return pdf_answer(documents.credit_note_pdf, self.get_object())


class SpendQuery(serializers.Serializer):
    tenant = serializers.SlugField(required=False, help_text="one tenant (slug)")
    warning = serializers.BooleanField(required=False, allow_null=True, default=None,
                                       help_text="only tenants at (true) or below (false) their warning ratio")
    over_limit = serializers.BooleanField(required=False, allow_null=True, default=None,
                                          help_text="only tenants at (true) or below (false) their block ratio")


class SpendView(GenericAPIView):
    """Month-to-date spend against each visible tenant's limit, paginated (page, page_size): the month's
    invoice as last rated (see rated_at; the rating beat re-rates drafts every TESSERA_RATING_INTERVAL_S)
    or its final total. A read: nothing is rated or written, one query per page (its count included)."""

    capabilities = {"get": "billing"}
    pagination_class = OneQueryPagination  # one row per tenant: the page and its count in one query
    serializer_class = SpendRowSerializer
    queryset = Tenant.objects.none()  # for the schema; get() reads selectors.spend
    filter_backends: list = []  # its filters are SpendQuery's (no ordering or search)

    @extend_schema(parameters=[SpendQuery], responses={200: SpendRowSerializer(many=True)})
    def get(self, request):
        query = SpendQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        q = query.validated_data
        period = billing.month_of(timezone.now())
        rows = selectors.spend(principal_for(request), period, tenant=q.get("tenant"), warning=q.get("warning"),
                               blocked=q.get("over_limit"))
        out = []
        for row in self.paginate_queryset(rows):
            s = Spend.from_row(row, period)
            ratio = s.ratio
            out.append({"tenant": s.slug, "spend": str(s.spend), "currency": s.currency,
                        "limit": None if s.limit is None else str(s.limit),
                        "ratio": None if ratio is None else float(round(ratio, 4)),
                        "warn": s.warn, "blocked": s.blocked, "period_start": period, "status": s.status,
                        "rated_at": s.rated_at})
        return self.get_paginated_response(out)


class UsageSummaryQuery(serializers.Serializer):
    start = serializers.DateTimeField(required=False, help_text="default: start of this month (UTC)")
    end = serializers.DateTimeField(required=False, help_text="default: now")
    group_by = serializers.ChoiceField(choices=["tenant", "deployment", "tier", "hour", "day", "key"],
                                       default="deployment")
    tenant = serializers.CharField(required=False, help_text="tenant slug")
    deployment = serializers.IntegerField(required=False)
    model = serializers.CharField(required=False)
    tier = serializers.CharField(required=False, help_text="tier key")

    def validate(self, attrs):
        from django.utils import timezone

        now = timezone.now()
        attrs.setdefault("end", now)
        attrs.setdefault("start", now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
        if attrs["start"] >= attrs["end"]:
            raise serializers.ValidationError({"start": ["must be before end"]})
        if attrs["end"] - attrs["start"] > timedelta(days=400):
            raise serializers.ValidationError({"end": ["at most 400 days per query"]})
        return attrs


class UsageSummaryView(APIView):
    """Usage (tokens, requests, and what is already billed) by tenant, deployment, tier, hour or day,
    from the hourly rollups. Scope billing:read; operators see every tenant."""

    capabilities = {"get": "billing"}

    @extend_schema(parameters=[UsageSummaryQuery], responses={200: UsageSummarySerializer})
    def get(self, request):
        q = UsageSummaryQuery(data=request.query_params)
        q.is_valid(raise_exception=True)
        d = q.validated_data
        filters = {k: d[k] for k in ("tenant", "deployment", "model", "tier") if k in d}
        rows = usage_summary(principal_for(request), d["start"], d["end"], d["group_by"], filters)
        return Response({"start": d["start"], "end": d["end"], "group_by": d["group_by"], "results": rows})


class WebhookEndpointSerializer(serializers.ModelSerializer):
    tenant = ScopedTenantField(required=False, allow_null=True, help_text="omit for an MSP-wide endpoint")
    events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEndpoint.EVENTS), allow_empty=False)

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "tenant", "url", "events", "active", "created_at"]
        read_only_fields = ["id", "created_at"]


class WebhookCreatedSerializer(WebhookEndpointSerializer):
    secret = serializers.CharField(read_only=True, help_text="verify X-Tessera-Signature with it")

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]


class WebhookDeliverySerializer(serializers.ModelSerializer):
    """Operators read the detail (status code, connection error); tenants the status class ("2xx",
    "3xx", "4xx", "5xx", null: no answer) and a generic reason, so the log is no port scanner."""

    last_status_class = serializers.SerializerMethodField()
    last_status_code = serializers.SerializerMethodField(help_text="operators only (null for tenants)")
    last_error = serializers.SerializerMethodField(help_text="operators: the detail; tenants: a generic reason")

    class Meta:
        model = WebhookDelivery
        fields = ["id", "endpoint", "event", "event_key", "status", "attempts", "last_status_class",
                  "last_status_code", "last_error", "created_at", "delivered_at", "payload"]

    def get_last_status_class(self, obj) -> str | None:
        return f"{obj.last_status_code // 100}xx" if obj.last_status_code else None

    def get_last_status_code(self, obj) -> int | None:
        return obj.last_status_code if reader_is_operator(self.context) else None

    def get_last_error(self, obj) -> str:
        return obj.last_error if reader_is_operator(self.context) else obj.last_reason


class WebhookEndpointViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                             mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Webhook endpoints (owners/admins for their tenant, operators MSP-wide). The secret is shown once."""

    queryset_model = WebhookEndpoint
    selector = selectors.webhook_endpoints
    serializer_class = WebhookEndpointSerializer
    ordering = ["-created_at"]
    capabilities = {"list": "manage_tenant", "retrieve": "manage_tenant", "create": "manage_tenant",
                    "destroy": "manage_tenant", "deliveries": "manage_tenant"}

    def create(self, request, *args, **kwargs):
        s = self.get_serializer(data=request.data)
        s.is_valid(raise_exception=True)
        ep = webhooks.create_endpoint(self.principal, tenant=s.validated_data.get("tenant"),
                                      url=s.validated_data["url"], events=s.validated_data["events"])
        return Response(WebhookCreatedSerializer(ep).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=WebhookDeliverySerializer(many=True))
    @action(detail=True, methods=["get"])
    def deliveries(self, request, pk=None):
        ep = self.get_object()
        page = self.paginate_queryset(ep.deliveries.order_by("-created_at"))
        return self.get_paginated_response(WebhookDeliverySerializer(page, many=True,
                                                                     context=self.get_serializer_context()).data)
