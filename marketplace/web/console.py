"""The MSP operator console: server-rendered pages over the selectors and services.

Every view requires a signed-in operator (the tenants.operate permission): anonymous people are sent
to the login page, everyone else gets 403. Writes are POST only (CSRF), go through the services and
redirect back with a message; forms re-render with their field errors.
"""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta
from decimal import Decimal
from functools import wraps
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Avg, BooleanField, Count, ExpressionWrapper, Max, Prefetch, Q, QuerySet, Sum
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.utils.html import format_html
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_GET, require_POST
from django_filters import FilterSet

from marketplace.filters import AllocationFilter, DeploymentFilter, DriftEventFilter, InvoiceFilter, NodeFilter
from marketplace.models import (
    Allocation,
    BillingAlert,
    DriftEvent,
    Gpu,
    GpuInstance,
    GpuModel,
    Invoice,
    MigProfile,
    ModelDeployment,
    Node,
    PricePlan,
    ServerPlatform,
    Tier,
    TritonServer,
)
from marketplace.models.orders import LIVE_STATES, live_slices
from marketplace.selectors import billing as billing_sel
from marketplace.selectors import catalog as catalog_sel
from marketplace.selectors import orders as orders_sel
from marketplace.selectors.exports import invoice_csv
from marketplace.services import billing, fleet, offers, orders
from marketplace.services.billing import documents, spend
from marketplace.services.billing.plans import in_force
from marketplace.services.billing.spend import Spend
from marketplace.services.fleet import DiscoveredGpu
from marketplace.web.documents import pdf_response
from marketplace.web.portal_forms import BillingDetailsForm, KeyLimitsForm, error_summary
from marketplace.web.tables import Column, Filtered, Table, filtered, table
from telemetry.charts import CHARTS
from telemetry.models import GpuSample
from telemetry.selectors import key_tokens
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services
from tenants.errors import ServiceError
from tenants.filters import AuditEventFilter, TenantFilter
from tenants.models import CURRENCIES, SPEND_LIMIT_HELP, ApiKey, AuditEvent, Tenant
from tenants.scoping import principal_for

RELEASABLE = (Allocation.State.PLACED, Allocation.State.PROVISIONING, Allocation.State.READY, Allocation.State.ACTIVE,
              Allocation.State.FAILED)


def operator_required(view):
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        principal = principal_for(request)
        if not (principal.is_operator and principal.can("operate")):
            raise PermissionDenied("The console is for MSP operators.")
        request.principal = principal
        return view(request, *args, **kwargs)
    return wrapped


def _page(request, template: str, ctx: dict, status: int = 200):
    return render(request, f"console/{template}", ctx, status=status)


def _filter(request, filterset_class: type[FilterSet], qs: QuerySet, *,
            defaults: dict[str, str] | None = None) -> Filtered:
    """The list's FilterSet (the API's) on the query string; a rejected value is said in a message (in a
    live list's refresh, by the list itself: a message would wait for the next whole page)."""
    f = filtered(request, filterset_class, qs, defaults=defaults)
    if not _live(request):
        for problem in f.problems:
            messages.warning(request, problem)
    return f


def _live(request) -> bool:
    """An htmx refresh of a live list (not a boosted page load): answer with the list alone."""
    htmx = getattr(request, "htmx", None)
    return htmx is not None and bool(htmx) and not htmx.boosted


def _live_page(request, template: str, partial: str, ctx: dict):
    """A live list: the whole page, or (htmx refresh) the list part alone; one URL for both, so the
    browser's cache tells them apart by HX-Request."""
    resp = render(request, f"console/{partial}" if _live(request) else f"console/{template}", ctx)
    patch_vary_headers(resp, ["HX-Request"])
    return resp


def _service_error(request, exc: ServiceError) -> None:
    messages.error(request, exc.text_for(operator=True))  # the console is for operators: the diagnostic


def tenant_color(slug: str) -> str:
    """A stable colour per tenant for slot maps."""
    h = int(hashlib.md5(slug.encode(), usedforsecurity=False).hexdigest()[:4], 16) % 360
    return f"hsl({h} 55% 42%)"


def _month_start():
    return billing.month_of(timezone.now())


# --- overview -----------------------------------------------------------------------------------

def spend_alerts(limit: int = 20) -> list[Spend]:
    """Tenants at or past their warning ratio (billing.spend's figure and rule: the month's invoice as last rated,
    not re-rated here; a limit of 0 is always past it), in name order. One query, however many tenants."""
    month = _month_start()
    rows = spend.figures(Tenant.objects.all(), month, warn=True).order_by("name").values(*spend.FULL_ROW)
    return [Spend.from_row(r, month) for r in rows[:limit]]


@require_GET
@operator_required
def overview(request):
    now = timezone.now()
    models = {m.pk: m for m in GpuModel.objects.all()}
    occupancy = []
    for row in (Gpu.objects.values("gpu_model_id").annotate(gpus=Count("id", distinct=True), used=Count("slots"))
                .order_by("gpu_model_id")):
        m = models[row["gpu_model_id"]]
        total = row["gpus"] * m.memory_slices
        occupancy.append({"model": m, "gpus": row["gpus"], "used": row["used"], "total": total,
                          "percent": round(100 * row["used"] / total) if total else 0})
    since = now - timedelta(minutes=10)
    utilization = []
    for row in (GpuSample.objects.filter(resolution="raw", ts__gte=since)
                .values("gpu__gpu_model_id")
                .annotate(activity=Avg("activity"), power=Avg("power_w"), gpus=Count("gpu_id", distinct=True),
                          last=Max("ts"))
                .order_by("gpu__gpu_model_id")):
        utilization.append({"model": models[row["gpu__gpu_model_id"]], "activity": round(100 * row["activity"]),
                            "power": round(row["power"]), "gpus": row["gpus"], "last": row["last"]})
    month = _month_start()
    revenue = list(Invoice.objects.filter(period_start=month).values("currency")
                   .annotate(total=Sum("total"), invoices=Count("id"), rated=Max("rated_at")).order_by("currency"))
    states = dict(Allocation.objects.filter(state__in=LIVE_STATES).values_list("state").annotate(n=Count("id"))
                  .order_by())
    return _page(request, "overview.html", {
        "occupancy": occupancy, "utilization": utilization, "since": since, "revenue": revenue, "month": month,
        "live": sum(states.values()), "states": states,
        "node_count": Node.objects.count(), "tenant_count": Tenant.objects.count(),
    } | _alerts(request))


def _alerts(request) -> dict[str, Any]:
    """The overview's alerts: unresolved drift, failed allocations, spend limits, billing alerts."""
    drift_qs = orders_sel.drift_events(request.principal).filter(resolved=False)
    failed_qs = (Allocation.objects.filter(state=Allocation.State.FAILED)
                 .select_related("tenant", "tier", "node").order_by("-updated_at"))
    open_alerts = BillingAlert.objects.filter(resolved_at__isnull=True).select_related("tenant").order_by("-at")
    return {"billing_alerts": list(open_alerts[:10]), "billing_alert_count": open_alerts.count(),
            "drift": list(drift_qs[:10]), "drift_count": drift_qs.count(),
            "failed": list(failed_qs[:10]), "failed_count": failed_qs.count(), "spend_alerts": spend_alerts()}


@require_GET
@operator_required
def overview_alerts(request):
    """The overview's alerts alone: what its live region fetches every few seconds."""
    resp = _page(request, "_alerts.html", _alerts(request))
    patch_vary_headers(resp, ["HX-Request"])
    return resp


# --- nodes --------------------------------------------------------------------------------------

def slot_cells(gpu: Gpu) -> list[dict]:
    """The GPU's 8 memory slices as cells: one per instance (spanning its slices), one per free slice."""
    cells: list[dict | None] = [{"used": False, "start": i, "size": 1} for i in range(8)]
    for inst in gpu.instances.all():
        profile = inst.placement.profile.name if inst.placement is not None else "whole GPU"
        cells[inst.start] = {"used": True, "start": inst.start, "size": inst.size, "tenant": inst.tenant.slug,
                             "profile": profile, "color": tenant_color(inst.tenant.slug), "state": inst.state}
        for s in range(inst.start + 1, inst.start + inst.size):
            cells[s] = None
    return [c for c in cells if c is not None]


def slot_map_html(cells: list[dict]) -> str:
    """The slot map markup, built here rather than in the template: a 1,000-GPU fleet shows many."""
    parts = []
    for c in cells:
        if c["used"]:
            last = c["start"] + c["size"] - 1
            parts.append(format_html(
                '<span class="used" style="grid-column:{} / span {};background:{}" title="slices {}–{}: {} {} ({})">'
                '{}<br><small>{}</small></span>', c["start"] + 1, c["size"], c["color"], c["start"], last,
                c["tenant"], c["profile"], c["state"], c["tenant"],
                c["profile"] if c["size"] > 1 else c["profile"].split(".")[0]))
        else:
            parts.append(format_html('<span style="grid-column:{}" title="slice {}: free">{}<br><small>free</small>'
                                     '</span>', c["start"] + 1, c["start"], c["start"]))
    return mark_safe("".join(parts))  # every part is format_html-escaped


@require_GET
@operator_required
def nodes(request):
    qs = Node.objects.select_related("platform", "platform__gpu_model").prefetch_related(
        Prefetch("gpus", queryset=Gpu.objects.select_related("gpu_model", "dedicated_tenant").order_by("index")
                 .prefetch_related(Prefetch("instances", queryset=GpuInstance.objects.select_related(
                     "tenant", "placement__profile").order_by("start")))),
        Prefetch("triton_servers", to_attr="live_servers", queryset=TritonServer.objects.exclude(
            state=TritonServer.State.STOPPED).defer("log_tail").order_by("http_port", "pk"))
    ).annotate(working=ExpressionWrapper(catalog_sel.working_nodes_q(), output_field=BooleanField()))
    f = _filter(request, NodeFilter, qs)
    t = table(request, f.qs, [Column("hostname", "Node"), Column("platform__name", "Platform"),
                            Column("state", "State"), Column("last_heartbeat", "Last heartbeat")],
              default_sort="hostname", per_page=10)
    rows = []
    for node in t.page:
        gpus = [{"gpu": g, "slotmap": slot_map_html(slot_cells(g)), "used": sum(i.size for i in g.instances.all())}
                for g in node.gpus.all()]
        rows.append({"node": node, "gpus": gpus, "used": sum(g["used"] for g in gpus), "total": 8 * len(gpus),
                     "servers": node.live_servers})
    return _page(request, "nodes.html", {"table": t, "rows": rows, "f": f.values, "states": Node.State.choices})


# --- allocations --------------------------------------------------------------------------------

def filter_options() -> dict:
    return {"tenant": list(Tenant.objects.order_by("slug").values_list("slug", flat=True)),
            "tier": list(Tier.objects.order_by("key").values_list("key", flat=True)),
            "node": list(Node.objects.order_by("hostname").values_list("hostname", flat=True))}


ALLOCATION_COLUMNS = [
    Column("id", "#"), Column("tenant__slug", "Tenant"), Column("tier__key", "Tier"), Column("state", "State"),
    Column("node__hostname", "Node"), Column("", "Slice"), Column("created_at", "Created"),
    Column("updated_at", "Updated"),
]


@require_GET
@operator_required
def allocations(request):
    f = _filter(request, AllocationFilter, orders_sel.allocations(request.principal).prefetch_related(None))
    t = table(request, f.qs, ALLOCATION_COLUMNS, default_sort="-created_at")
    return _live_page(request, "allocations.html", "_allocations_list.html", {
        "table": t, "f": f.values, "problems": f.problems, "states": Allocation.State.choices,
        "options": {} if _live(request) else filter_options()})  # a refresh redraws the list, not the form


@require_GET
@operator_required
def allocation_detail(request, pk: int):
    a = get_object_or_404(orders_sel.allocations(request.principal).select_related(
        "instance__gpu", "instance__placement__profile", "order"), pk=pk)
    deployments = ModelDeployment.objects.filter(allocation=a).order_by("-created_at")
    return _page(request, "allocation_detail.html", {
        "a": a, "events": a.events.all(), "deployments": deployments,
        "servers": TritonServer.objects.filter(allocation=a),
        "can_retry": a.state == Allocation.State.FAILED, "can_release": a.state in RELEASABLE,
    })


@require_POST
@operator_required
def allocation_retry(request, pk: int):
    a = get_object_or_404(Allocation, pk=pk)
    try:
        orders.retry(request.principal, a)
        messages.success(request, f"Allocation {a.pk} is being retried.")
    except ServiceError as exc:
        _service_error(request, exc)
    return redirect("console:allocation_detail", pk=a.pk)


@require_POST
@operator_required
def allocation_release(request, pk: int):
    a = get_object_or_404(Allocation, pk=pk)
    try:
        orders.request_release(request.principal, a, reason=request.POST.get("reason", "").strip()
                       or "released by an operator")
        messages.success(request, f"Allocation {a.pk} is being released.")
    except ServiceError as exc:
        _service_error(request, exc)
    return redirect("console:allocation_detail", pk=a.pk)


@require_GET
@operator_required
def drift(request):
    f = _filter(request, DriftEventFilter, orders_sel.drift_events(request.principal).select_related("allocation"),
                defaults={"resolved": "false"})  # the open ones unless asked: they need an operator
    t = table(request, f.qs, [Column("at", "When"), Column("node__hostname", "Node"), Column("gpu_index", "GPU"),
                            Column("kind", "Kind"), Column("", "Detail"), Column("allocation_id", "Allocation"),
                            Column("resolved", "Resolved")], default_sort="-at")
    return _live_page(request, "drift.html", "_drift_list.html", {"table": t, "f": f.values, "problems": f.problems,
                                                                   "kinds": DriftEvent.Kind.choices})


METERING_PER_PAGE = 50


@require_GET
@operator_required
def metering(request):
    """Per deployment, the last 24 complete hours: requests Tessera metered against what Triton served."""
    from django.conf import settings

    from telemetry.selectors import metered_vs_served

    until = timezone.now().replace(minute=0, second=0, microsecond=0)
    rows = metered_vs_served(request.principal, until - timedelta(hours=24), until)
    tolerance = settings.TESSERA_METERING_TOLERANCE
    for r in rows:
        big = max(r["metered_requests"], r["served_requests"])
        r["off"] = abs(r["difference"]) >= 5 and abs(r["difference"]) > tolerance * big
    rows.sort(key=lambda r: (not r["off"], -abs(r["difference"]), r["deployment"]))
    # out-of-tolerance rows first, a page at a time (the fleet's whole list is ~1,000 rows at 1,000 GPUs)
    paginator = Paginator(rows, METERING_PER_PAGE)
    t = Table(page=paginator.get_page(request.GET.get("page")), columns=[], query=request.GET,
              total=paginator.count)
    return _page(request, "metering.html", {"table": t, "until": until, "tolerance_pct": tolerance * 100,
                                            "off": sum(r["off"] for r in rows)})


# --- tenants ------------------------------------------------------------------------------------

TENANT_COLUMNS = [
    Column("name", "Tenant"), Column("status", "Status"), Column("live", "Live slices"),
    Column("max_slices", "Max slices"), Column("max_slices_per_tier", "Per tier"),
    Column("max_memory_gb", "Memory GB"), Column("spend", "Spend this month"),
    Column("monthly_spend_limit", "Spend limit"),
]


@require_GET
@operator_required
def tenants(request):
    qs = spend.figures(Tenant.objects.visible_to(request.principal), _month_start()).annotate(
        live=live_slices("allocations__"))
    f = _filter(request, TenantFilter, qs)
    t = table(request, f.qs, TENANT_COLUMNS, default_sort="name")
    return _page(request, "tenants.html", {"table": t, "f": f.values, "statuses": Tenant.Status.choices})


class QuotaForm(forms.Form):
    max_slices = forms.IntegerField(min_value=0)
    max_slices_per_tier = forms.IntegerField(min_value=0)
    max_memory_gb = forms.IntegerField(min_value=0)
    monthly_spend_limit = forms.DecimalField(required=False, min_value=0, max_digits=14, decimal_places=2,
                                             help_text=SPEND_LIMIT_HELP)
    spend_warn_ratio = forms.DecimalField(min_value=0, max_digits=4, decimal_places=2)
    spend_block_ratio = forms.DecimalField(min_value=0, max_digits=4, decimal_places=2)
    max_concurrent_requests = forms.IntegerField(required=False, min_value=1, help_text="inference requests in "
                                                 "flight at once through the gateway, all the tenant's keys together")
    max_key_requests_per_minute = forms.IntegerField(
        required=False, min_value=1, help_text="the most requests per minute the tenant's admins may give one key "
        "(keys above it are lowered to it); empty: the gateway's default")
    max_key_tokens_per_minute = forms.IntegerField(
        required=False, min_value=1, help_text="the most tokens per minute the tenant's admins may give one key "
        "(keys above it are lowered to it); empty: the gateway's default")
    sso_email_domain = forms.CharField(
        required=False, max_length=253, label="SSO e-mail domain",
        help_text="single sign-on: people the identity provider signs in with an address at this domain join the "
        "tenant as members; empty: by invitation only")

    def clean_max_concurrent_requests(self):
        """Left out of a post (a form older than the field): unchanged, never empty."""
        value = self.cleaned_data.get("max_concurrent_requests")
        return self.initial.get("max_concurrent_requests") if value is None else value

    def clean_sso_email_domain(self):
        """Left out of a post (a form older than the field): unchanged."""
        if "sso_email_domain" not in self.data:
            return self.initial.get("sso_email_domain", "")
        return self.cleaned_data.get("sso_email_domain", "")


def _quota_initial(tenant: Tenant) -> dict:
    return {name: getattr(tenant, name) for name in QuotaForm.base_fields}


def _tenant_page(request, tenant: Tenant, form: QuotaForm, status: int = 200):
    allocs = (Allocation.objects.filter(tenant=tenant).select_related("tier", "node").order_by("-created_at")[:10])
    invoices = Invoice.objects.filter(tenant=tenant).order_by("-period_start")[:6]
    live = Allocation.objects.filter(tenant=tenant).aggregate(n=live_slices())["n"]
    keys = list(ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).order_by("-created_at")[:KEYS_SHOWN])
    used = key_tokens([k.prefix for k in keys], *billing.bounds(billing.month_of(timezone.now())))
    return _page(request, "tenant_detail.html", {
        "tenant": tenant, "form": form, "allocations": allocs, "invoices": invoices, "live": live,
        "spend": spend.of(tenant), "members": tenant.memberships.select_related("user").order_by("user__email"),
        "keys": [(k, used.get(k.prefix, 0)) for k in keys], "keys_shown": KEYS_SHOWN,
        "billing_form": BillingDetailsForm(instance=tenant),
    }, status=status)


#: live keys a tenant's page lists with their limits (the newest; the API lists them all)
KEYS_SHOWN = 50


@require_POST
@operator_required
def tenant_key_limits(request, pk: int):
    """An operator sets one of a tenant's keys' gateway limits and monthly token allowance (any value: the tenant's
    ceilings bind its own admins, tenants.services.update_api_key_limits)."""
    key = get_object_or_404(ApiKey.objects.filter(tenant__isnull=False), pk=pk)
    form = KeyLimitsForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"The limits of {key.name} were not changed — {error_summary(form)}")
    else:
        try:
            tenant_services.update_api_key_limits(request.principal, key, **form.cleaned_data)
            messages.success(request, f"Limits of {key.name} ({key.prefix}…) saved; the gateway applies them within "
                                      f"seconds.")
        except ServiceError as exc:
            _service_error(request, exc)
    return redirect("console:tenant_detail", pk=key.tenant_id)


@operator_required
def tenant_detail(request, pk: int):
    tenant = get_object_or_404(Tenant.objects.visible_to(request.principal), pk=pk)
    if request.method == "POST":
        form = QuotaForm(request.POST, initial=_quota_initial(tenant))
        if form.is_valid():
            changed = {name: form.cleaned_data[name] for name in form.changed_data}
            try:
                tenant_services.update_tenant(request.principal, tenant, **changed)
            except ServiceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
                tenant.refresh_from_db()
            else:
                messages.success(request, "Quotas and limits saved." if changed else "Nothing changed.")
                return redirect("console:tenant_detail", pk=tenant.pk)
        return _tenant_page(request, tenant, form, status=400)
    if request.method != "GET":
        return HttpResponse(status=405)
    return _tenant_page(request, tenant, QuotaForm(initial=_quota_initial(tenant)))


@require_POST
@operator_required
def tenant_billing(request, pk: int):
    """An operator edits a tenant's billing details (what its next invoices and credit notes print)."""
    tenant = get_object_or_404(Tenant.objects.visible_to(request.principal), pk=pk)
    form = BillingDetailsForm(request.POST, instance=Tenant.objects.get(pk=tenant.pk))
    if not form.is_valid():
        messages.error(request, f"Billing details not saved — {error_summary(form)}")
        return redirect("console:tenant_detail", pk=tenant.pk)
    changed = {name: form.cleaned_data[name] for name in form.changed_data}
    try:
        tenant_services.update_tenant(request.principal, tenant, **changed)
        messages.success(request, "Billing details saved." if changed else "Nothing changed.")
    except ServiceError as exc:
        _service_error(request, exc)
    return redirect("console:tenant_detail", pk=tenant.pk)


@require_POST
@operator_required
def tenant_suspend(request, pk: int):
    tenant = get_object_or_404(Tenant, pk=pk)
    try:
        tenant_services.suspend_tenant(request.principal, tenant, reason=request.POST.get("reason", "").strip()[:500])
        messages.success(request, f"{tenant.name} is suspended: no new orders; slices keep serving.")
    except ServiceError as exc:
        _service_error(request, exc)
    return redirect("console:tenant_detail", pk=tenant.pk)


@require_POST
@operator_required
def tenant_activate(request, pk: int):
    tenant = get_object_or_404(Tenant, pk=pk)
    try:
        tenant_services.activate_tenant(request.principal, tenant)
        messages.success(request, f"{tenant.name} is active again.")
    except ServiceError as exc:
        _service_error(request, exc)
    return redirect("console:tenant_detail", pk=tenant.pk)


# --- tiers and prices ---------------------------------------------------------------------------

def plan_rows(plans, now) -> list[dict]:
    """Plans (in their order) with their status: scheduled, in force (one per kind and currency, `in_force`),
    past."""
    plans = list(plans)
    current = {p.pk for p in in_force(plans, now).values()}
    return [{"plan": p, "status": "scheduled" if p.effective_from > now else "in force" if p.pk in current
             else "past"} for p in plans]


@require_GET
@operator_required
def tiers(request):
    from marketplace.web.catalog_pages import PRICE_COLUMNS, price_table

    qs = orders_sel.tiers().annotate(live=Count("allocations", filter=Q(allocations__state__in=LIVE_STATES)))
    currency = request.GET.get("currency", "")
    blocks, currencies, unpriced = price_table(qs, timezone.now(), currency)
    return _page(request, "tiers.html", {"blocks": blocks, "currencies": currencies, "currency": currency,
                                         "unpriced": unpriced, "columns": [c[2] for c in PRICE_COLUMNS]})


class PricePlanForm(forms.Form):
    kind = forms.ChoiceField(choices=PricePlan.Kind.choices)
    currency = forms.ChoiceField(choices=CURRENCIES)
    price_per_slice_hour = forms.DecimalField(min_value=0, max_digits=12, decimal_places=4)
    price_per_1m_input_tokens = forms.DecimalField(min_value=0, max_digits=12, decimal_places=4)
    price_per_1m_output_tokens = forms.DecimalField(min_value=0, max_digits=12, decimal_places=4)
    monthly_commit = forms.DecimalField(required=False, min_value=0, max_digits=14, decimal_places=2,
                                        help_text="reserved plans only")
    effective_from = forms.DateTimeField(widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
                                         help_text="UTC; in the past only over hours no finalized invoice holds")


@operator_required
def tier_detail(request, pk: int):
    tier = get_object_or_404(orders_sel.tiers(), pk=pk)
    status = 200
    if request.method == "POST":
        form = PricePlanForm(request.POST)
        if form.is_valid():
            try:
                plan = offers.add_price_plan(request.principal, tier=tier, **form.cleaned_data)
            except ServiceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                messages.success(request, f"New {plan.get_kind_display().lower()} price in {plan.currency} from "
                                          f"{plan.effective_from:%Y-%m-%d %H:%M} UTC.")
                return redirect("console:tier_detail", pk=tier.pk)
        status = 400
    elif request.method == "GET":
        in_force = next((p for p in tier.plans.all() if p.effective_from <= timezone.now()), None)
        initial = {"effective_from": (timezone.now() + timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
                   .strftime("%Y-%m-%dT%H:%M"), "kind": PricePlan.Kind.ON_DEMAND, "currency": "USD"}
        if in_force:
            initial |= {f: getattr(in_force, f) for f in ("kind", "currency", "price_per_slice_hour",
                                                          "price_per_1m_input_tokens", "price_per_1m_output_tokens")}
        form = PricePlanForm(initial=initial)
    else:
        return HttpResponse(status=405)
    from marketplace.selectors.catalog import platforms_by_gpu_model

    return _page(request, "tier_detail.html", {"tier": tier, "plans": plan_rows(tier.plans.all(), timezone.now()),
                                               "form": form,
                                               "platforms": platforms_by_gpu_model().get(tier.gpu_model_id, [])},
                 status=status)


# --- invoices -----------------------------------------------------------------------------------

INVOICE_COLUMNS = [
    Column("number", "Number"), Column("tenant__slug", "Tenant"), Column("period_start", "Period"),
    Column("status", "Status"), Column("total", "Total"), Column("currency", "Currency"),
    Column("rated_at", "Rated"),
]


@require_GET
@operator_required
def invoices(request):
    f = _filter(request, InvoiceFilter, billing_sel.invoices(request.principal).prefetch_related(None))
    t = table(request, f.qs, INVOICE_COLUMNS, default_sort="-period_start")
    tenants_ = list(Tenant.objects.order_by("slug").values_list("slug", flat=True))
    return _page(request, "invoices.html", {"table": t, "f": f.values, "tenants": tenants_,
                                            "statuses": Invoice.Status.choices})


def _finalizable(invoice: Invoice) -> bool:
    return invoice.status == Invoice.Status.DRAFT and invoice.period_end <= timezone.now().date()


@require_GET
@operator_required
def invoice_detail(request, pk: int):
    invoice = get_object_or_404(billing_sel.invoices(request.principal), pk=pk)
    notes = list(invoice.credit_notes.all())
    return _page(request, "invoice_detail.html", {
        "invoice": invoice, "lines": invoice.lines.all(), "can_finalize": _finalizable(invoice),
        "credit_notes": notes, "by_key": billing_sel.key_breakdown(invoice),
        "credited": sum((cn.total for cn in notes), Decimal(0)),
        "net": billing.net_balance(invoice.total, [cn.total for cn in notes]),
        "left_to_credit": billing.left_to_credit(invoice), "pdf_unavailable": documents.unavailable()})


@require_GET
@operator_required
def invoice_pdf(request, pk: int):
    invoice = get_object_or_404(billing_sel.invoices(request.principal), pk=pk)
    return pdf_response(request, documents.invoice_pdf, invoice, reverse("console:invoice_detail", args=[pk]))


@require_GET
@operator_required
def credit_note_pdf(request, pk: int):
    cn = get_object_or_404(billing_sel.credit_notes(request.principal), pk=pk)
    return pdf_response(request, documents.credit_note_pdf, cn,
                        reverse("console:invoice_detail", args=[cn.invoice_id]))


@require_GET
@operator_required
def invoice_download(request, pk: int):
    invoice = get_object_or_404(billing_sel.invoices(request.principal), pk=pk)
    resp = HttpResponse(invoice_csv(invoice), content_type="text/csv; charset=utf-8")
    name = invoice.number or f"draft-{invoice.tenant.slug}-{invoice.period_start:%Y-%m}"
    resp["Content-Disposition"] = f'attachment; filename="{name}.csv"'
    return resp


@require_POST
@operator_required
def invoice_finalize(request, pk: int):
    invoice = get_object_or_404(billing_sel.invoices(request.principal), pk=pk)
    try:
        invoice = billing.finalize(invoice, principal=request.principal)
        messages.success(request, f"Invoice {invoice.number} finalized: {invoice.total} {invoice.currency}.")
    except ServiceError as exc:
        _service_error(request, exc)
    return redirect("console:invoice_detail", pk=invoice.pk)


@require_POST
@operator_required
def invoice_credit_note(request, pk: int):
    """Credit a finalized invoice in full (the API also credits per line and adds corrected charges)."""
    invoice = get_object_or_404(billing_sel.invoices(request.principal), pk=pk)
    try:
        cn = billing.issue_credit_note(request.principal, invoice, reason=request.POST.get("reason", ""))
        messages.success(request, f"Credit note {cn.number} issued: {cn.total} {cn.currency}.")
    except ServiceError as exc:
        _service_error(request, exc)
    return redirect("console:invoice_detail", pk=invoice.pk)


# --- deployments and charts ---------------------------------------------------------------------

DEPLOYMENT_COLUMNS = [
    Column("tenant__slug", "Tenant"), Column("name", "Model"), Column("backend", "Backend"),
    Column("allocation_id", "Slice"), Column("allocation__node__hostname", "Node"), Column("state", "State"),
    Column("memory_mb", "Memory MB"), Column("updated_at", "Updated"),
]


@require_GET
@operator_required
def deployments(request):
    qs = orders_sel.deployments(request.principal).select_related(
        "allocation__node", "allocation__tier", "allocation__tier__profile")
    f = _filter(request, DeploymentFilter, qs)
    t = table(request, f.qs, DEPLOYMENT_COLUMNS, default_sort="-updated_at")
    return _live_page(request, "deployments.html", "_deployments_list.html", {
        "table": t, "f": f.values, "problems": f.problems, "states": ModelDeployment.State.choices})


@require_GET
@operator_required
def charts(request):
    return _page(request, "charts.html", {"charts": [{"name": c.name, "title": c.title, "url": f"/charts/{c.name}/"}
                                                     for c in CHARTS.values()]})


# --- create: tenants, tiers, nodes --------------------------------------------------------------
# Each form validates the input, then calls the same service as the API; the service writes in one
# transaction, so a refused request stores nothing, and its refusal is shown next to the field it names.

class TenantCreateForm(forms.ModelForm):
    owner_email = forms.EmailField(required=False, help_text="invite this person as the tenant's first owner")

    class Meta:
        model = Tenant
        fields = ["name", "slug", "billing_email", "currency", "max_slices", "max_slices_per_tier",
                  "max_memory_gb", "monthly_spend_limit"]
        labels = {"max_memory_gb": "Max GPU memory (GB)", "monthly_spend_limit": "Monthly spend limit"}


class TierCreateForm(forms.ModelForm):
    class Meta:
        model = Tier
        fields = ["key", "name", "gpu_model", "profile", "gpu_count", "dedicated", "description", "allowed_backends"]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        gpu_model = self.fields["gpu_model"]
        profile = self.fields["profile"]
        assert isinstance(gpu_model, forms.ModelChoiceField) and isinstance(profile, forms.ModelChoiceField)
        gpu_model.queryset = GpuModel.objects.order_by("memory_gb", "key")
        profile.queryset = MigProfile.objects.select_related("gpu_model").order_by("gpu_model__key", "memory_slices")
        profile.empty_label = "whole GPU (MIG off)"
        self.fields["gpu_count"].required = False  # absent: one slice or GPU
        self.fields["gpu_count"].label = "GPUs per allocation"

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        data["gpu_count"] = data.get("gpu_count") or 1
        if data["gpu_count"] > 1 and data.get("profile") is not None:
            self.add_error("gpu_count", "a tier of several GPUs sells whole GPUs: leave the profile empty")
        if data.get("profile") is not None and data.get("gpu_model") is not None \
                and data["profile"].gpu_model_id != data["gpu_model"].pk:
            self.add_error("profile", f"{data['profile'].name} is not a {data['gpu_model'].name} profile")
        return data


NVIDIA_SMI_GPU = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9A-Za-z-]+)\)$")


def parse_nvidia_smi_list(text: str) -> list[DiscoveredGpu]:
    """`nvidia-smi -L` as the node prints it: one "GPU i: NAME (UUID: GPU-...)" line per GPU, each
    followed by its "MIG ... Device" lines when MIG instances exist (then MIG mode is on)."""
    gpus: list[dict[str, Any]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if m := NVIDIA_SMI_GPU.match(line):
            gpus.append({"index": int(m[1]), "name": m[2], "uuid": m[3], "mig_mode": False})
        elif line.startswith("MIG ") and gpus:
            gpus[-1]["mig_mode"] = True
        else:
            raise forms.ValidationError(f"line {n} is not nvidia-smi -L output: “{line[:80]}”")
    if len({g["index"] for g in gpus}) != len(gpus) or len({g["uuid"] for g in gpus}) != len(gpus):
        raise forms.ValidationError("a GPU index or UUID is listed twice")
    return [DiscoveredGpu(**g) for g in gpus]


class NodeCreateForm(forms.Form):
    hostname = forms.CharField(max_length=253, help_text="as the node's worker will name itself")
    platform = forms.ModelChoiceField(queryset=ServerPlatform.objects.select_related("gpu_model").order_by("key"),
                                      help_text="the server model; its GPUs must match")
    gpus = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 6}), label="GPUs (nvidia-smi -L)",
                           help_text="paste `nvidia-smi -L` from the node; empty with the simulated NVML backend")

    def clean_hostname(self) -> str:
        hostname = fleet.normalize_hostname(self.cleaned_data["hostname"])
        if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", hostname):
            raise forms.ValidationError("letters, digits, dots and hyphens only")
        if Node.objects.filter(hostname=hostname).exists():
            raise forms.ValidationError("a node with this hostname is registered")
        return hostname

    def clean_gpus(self) -> list[DiscoveredGpu]:
        return parse_nvidia_smi_list(self.cleaned_data["gpus"])

    def discovered(self) -> list[DiscoveredGpu]:
        from django.conf import settings

        gpus: list[DiscoveredGpu] = self.cleaned_data["gpus"]
        if gpus:
            return gpus
        if settings.TESSERA_NVML_BACKEND == "sim":
            from marketplace.services.nodes import sim_discovery

            return sim_discovery(self.cleaned_data["hostname"], self.cleaned_data["platform"])
        raise ServiceError("paste the node's `nvidia-smi -L`, or run `manage.py register_node` on it", field="gpus")


def _create_page(request, form: forms.BaseForm, *, title: str, intro: str, button: str, status: int = 200):
    return _page(request, "create.html", {"form": form, "title": title, "intro": intro, "button": button},
                 status=status)


def _create(request, form_class: type[forms.BaseForm], save, *, title: str, intro: str, button: str):
    """GET: the empty form; POST: validate, `save(cleaned_data)` through a service, redirect to the new
    object's page; a refusal re-renders with the error next to its field (400)."""
    if request.method == "GET":
        return _create_page(request, form_class(), title=title, intro=intro, button=button)
    if request.method != "POST":
        return HttpResponse(status=405)
    form = form_class(request.POST)
    if form.is_valid():
        try:
            return save(form)
        except ServiceError as exc:
            form.add_error(exc.field if exc.field in form.fields else None, exc.text_for(operator=True))
    return _create_page(request, form, title=title, intro=intro, button=button, status=400)


@operator_required
def tenant_create(request):
    def save(form: forms.BaseForm):
        data = dict(form.cleaned_data)
        owner = data.pop("owner_email") or None
        tenant = tenant_services.create_tenant(request.principal, owner_email=owner, **data)
        invited = f" {owner} is invited as its owner." if owner else ""
        messages.success(request, f"Tenant {tenant.name} created.{invited}")
        return redirect("console:tenant_detail", pk=tenant.pk)

    return _create(request, TenantCreateForm, save, title="New tenant", button="Create tenant",
                   intro="A customer of the MSP: its quotas apply from the start; the owner gets an invitation.")


@operator_required
def tier_create(request):
    def save(form: forms.BaseForm):
        tier = offers.create_tier(request.principal, **form.cleaned_data)
        messages.success(request, f"Tier {tier.key} created. Add a price plan so tenants can order it.")
        return redirect("console:tier_detail", pk=tier.pk)

    return _create(request, TierCreateForm, save, title="New tier", button="Create tier",
                   intro="What tenants order: a GPU model and a MIG profile, or whole GPUs (1, 2, 4 or 8 on one "
                         "node). Prices come next.")


@operator_required
def node_create(request):
    def save(form: forms.BaseForm):
        assert isinstance(form, NodeCreateForm)
        node = fleet.register_node(form.cleaned_data["hostname"], form.cleaned_data["platform"], form.discovered(),
                                   principal=request.principal)
        messages.success(request, f"Node {node.hostname} registered. Start its worker: TESSERA_NODE_HOSTNAME="
                                  f"{node.hostname} celery -A marketplace worker -Q {node.queue} -c 1")
        return redirect(reverse("console:nodes") + f"?state={node.state}")

    return _create(request, NodeCreateForm, save, title="Register a node", button="Register node",
                   intro="A GPU server joins the fleet with the GPUs NVML reports on it.")


class NodeEditForm(forms.Form):
    state = forms.ChoiceField(choices=Node.State.choices, help_text="draining or maintenance: no new work is "
                              "placed there; what runs there stays")
    serving_address = forms.GenericIPAddressField(help_text="the node-private address its Triton servers bind")
    serving_port_min = forms.IntegerField(min_value=1024, max_value=65535, label="First serving port")
    serving_port_max = forms.IntegerField(min_value=1024, max_value=65535, label="Last serving port",
                                          help_text="each Triton server takes three ports of the pool")


@operator_required
def node_edit(request, pk: int):
    """An operator changes a node's state and serving port pool (fleet.update_node; the API's PATCH does the same)."""
    node = get_object_or_404(Node, pk=pk)
    title, intro = f"Node {node.hostname}", f"{node.platform.name}, queue {node.queue}."
    if request.method == "GET":
        form = NodeEditForm(initial={f: getattr(node, f) for f in fleet.NODE_EDITABLE})
        return _create_page(request, form, title=title, intro=intro, button="Save node")
    if request.method != "POST":
        return HttpResponse(status=405)
    form = NodeEditForm(request.POST)
    if form.is_valid():
        try:
            node = fleet.update_node(request.principal, node, **form.cleaned_data)
        except ServiceError as exc:
            form.add_error(exc.field if exc.field in form.fields else None, exc.text_for(operator=True))
        else:
            messages.success(request, f"Node {node.hostname} saved: {node.get_state_display()}, ports "
                                      f"{node.serving_port_min}-{node.serving_port_max}.")
            return redirect("console:nodes")
    return _create_page(request, form, title=title, intro=intro, button="Save node", status=400)


# --- audit log ----------------------------------------------------------------------------------

AUDIT_COLUMNS = [Column("at", "When"), Column("actor", "Who"), Column("tenant__slug", "Tenant"),
                 Column("action", "Action"), Column("target", "Target"), Column("", "Detail")]


@require_GET
@operator_required
def audit_log(request):
    """Every staff and tenant-admin action, newest first: the API's audit list and filters."""
    f = _filter(request, AuditEventFilter, tenant_selectors.audit_events(request.principal))
    t = table(request, f.qs, AUDIT_COLUMNS, default_sort="-at")
    return _page(request, "audit.html", {
        "table": t, "f": f.values,
        "tenants": list(Tenant.objects.order_by("slug").values_list("slug", flat=True)),
        "actions": list(AuditEvent.objects.order_by("action").values_list("action", flat=True).distinct()),
    })
