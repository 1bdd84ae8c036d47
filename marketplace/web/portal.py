"""The tenant portal: server-rendered pages over the services and selectors (views stay thin).

Every read goes through a selector or ``visible_to``; every object is looked up with
get_object_or_404 on such a queryset, so another tenant's id is a 404. The current tenant comes
from ?tenant=<slug>, then the session, then the user's first membership.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from functools import wraps

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from marketplace.models import Allocation, ModelDeployment, PricePlan, UploadState
from marketplace.models.orders import LIVE_STATES
from marketplace.selectors import billing as billing_sel
from marketplace.selectors import models as model_sel
from marketplace.selectors import orders as order_sel
from marketplace.selectors.catalog import AVAILABILITY_CAP, availability
from marketplace.selectors.exports import invoice_csv
from marketplace.services import billing, deployments, inference, orders
from marketplace.services import models as model_svc
from marketplace.services.billing import documents
from marketplace.services.billing.plans import in_force
from marketplace.web.documents import pdf_response
from marketplace.web.tables import Column, table
from telemetry import charts
from telemetry.selectors import deployment_latency, deployment_served, key_tokens, usage_summary
from tenants import services as tenant_services
from tenants.errors import Forbidden, ServiceError
from tenants.models import ApiKey, Invitation, Membership, Tenant
from tenants.roles import Role
from tenants.scoping import principal_for

from .portal_forms import (
    TENANT_SCOPES,
    AdapterForm,
    ApiKeyForm,
    BillingDetailsForm,
    DeploymentForm,
    InviteForm,
    KeyLimitsForm,
    OrderForm,
    RepositoryForm,
    RoleForm,
    TryForm,
    error_summary,
    service_errors,
)

SESSION_KEY = "portal_tenant"
FINAL_SLICE_STATES = {Allocation.State.ACTIVE, Allocation.State.FAILED, Allocation.State.RELEASED}
MOVING_DEPLOYMENT_STATES = {ModelDeployment.State.PENDING, ModelDeployment.State.LOADING,
                            ModelDeployment.State.UNLOADING}
STEPS = [Allocation.State.REQUESTED, Allocation.State.PLACED, Allocation.State.PROVISIONING, Allocation.State.READY,
         Allocation.State.ACTIVE]


# --- plumbing ---------------------------------------------------------------------------------

def current_tenant(request, principal) -> Tenant | None:
    tenants = list(Tenant.objects.visible_to(principal).order_by("name"))
    request.portal_tenants = tenants
    by_slug = {t.slug: t for t in tenants}
    tenant = (by_slug.get(request.GET.get("tenant", "")) or by_slug.get(request.session.get(SESSION_KEY, ""))
              or (tenants[0] if tenants else None))
    if tenant is not None and request.session.get(SESSION_KEY) != tenant.slug:
        request.session[SESSION_KEY] = tenant.slug
    return tenant


def use_tenant(request, tenant_id: int) -> Tenant:
    """An object of one of the user's tenants was opened: that tenant becomes the current one."""
    for t in request.portal_tenants:
        if t.pk == tenant_id:
            request.tenant = t
            request.session[SESSION_KEY] = t.slug
    return request.tenant


def portal_view(view):
    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        principal = principal_for(request)
        if principal.is_operator:
            return redirect("console:overview")
        request.principal = principal
        request.tenant = current_tenant(request, principal)
        if request.tenant is None:
            return render(request, "portal/no_tenant.html", status=403)
        try:
            return view(request, *args, **kwargs)
        except Forbidden as exc:
            raise PermissionDenied(exc.message) from None
    return wrapper


def require(request, capability: str, tenant_id: int | None = None) -> None:
    if not request.principal.can(capability, tenant_id or request.tenant.pk):
        raise PermissionDenied("Your role does not allow this.")


def ctx(request, **extra) -> dict:
    p, t = request.principal, request.tenant
    caps = {c: p.can(c, t.pk) for c in ("read", "deploy", "billing", "manage_keys", "manage_members", "infer")}
    # a suspended tenant may only read and see billing, whatever the role: pages say why, with the operator's reason
    return {"tenant": t, "tenants": request.portal_tenants, "can": caps, "role": p.role_in(t.pk),
            "suspended": t.status != Tenant.Status.ACTIVE, **extra}


def act(request, call, success: str) -> bool:
    """A POST action's service call: a success or an error message (Forbidden stays a 403)."""
    with service_errors() as failed:
        call()
    if failed:
        messages.error(request, failed.text)
        return False
    messages.success(request, success)
    return True


# --- home ---------------------------------------------------------------------------------------

@portal_view
def home(request):
    p, t = request.principal, request.tenant
    spend = billing.spend.of(t) if p.can("billing", t.pk) else None  # the figure orders and the gateway judge
    slices = order_sel.allocations(p).filter(tenant=t)
    live = slices.filter(state__in=LIVE_STATES)
    models = order_sel.deployments(p).filter(tenant=t).exclude(state=ModelDeployment.State.REMOVED)
    models = models.select_related("allocation__tier")
    return render(request, "portal/home.html", ctx(
        request, spend=spend, active_count=live.filter(state=Allocation.State.ACTIVE).count(), live=list(live[:10]),
        models=list(models[:10]), model_count=models.count()))


# --- catalog and orders -------------------------------------------------------------------------

def price_of(tier, currency: str, kind: str = PricePlan.Kind.ON_DEMAND):
    return in_force(tier.plans.all(), timezone.now()).get((kind, currency))  # (prefetched)


@portal_view
def catalog(request):
    return _catalog(request)


def _catalog(request, errors=None, status=200):
    t = request.tenant
    tiers = list(order_sel.tiers().filter(active=True).order_by("gpu_model__key", "name"))
    free = availability(tiers, t.pk)
    from marketplace.selectors.catalog import platforms_by_gpu_model

    plats = platforms_by_gpu_model(in_fleet_only=True)
    rows = []
    for tr in tiers:
        reserved = price_of(tr, t.currency, PricePlan.Kind.RESERVED)
        rows.append({"tier": tr, "plan": price_of(tr, t.currency), "free": free.get(tr.pk, 0),
                     "reserved": reserved, "estimate": billing_sel.plan_month_estimate(reserved) if reserved else None,
                     "platforms": plats.get(tr.gpu_model_id, []), "error": (errors or {}).get(tr.pk)})
    return render(request, "portal/catalog.html", ctx(request, rows=rows, availability_cap=AVAILABILITY_CAP),
                  status=status)


@require_POST
@portal_view
def order(request, tier_id):
    t = request.tenant
    require(request, "deploy")
    tier = get_object_or_404(order_sel.tiers().filter(active=True), pk=tier_id)
    form = OrderForm(request.POST)
    if form.is_valid():
        d = form.cleaned_data
        with service_errors(form, "quantity"):
            if d["library_model"] is not None:  # ordered from "find a tier": the model must fit the tier
                model_svc.check_tier_fits(tier, d["library_model"], context=d["context"] or 0,
                                          concurrency=d["concurrency"] or 1)
            o = orders.create_order(request.principal, tenant=t, tier=tier, quantity=d["quantity"],
                                    plan_kind=d["plan_kind"])
    if not form.is_valid():
        text = error_summary(form)
        messages.error(request, f"Not ordered — {text}")
        return _catalog(request, errors={tier.pk: text}, status=400)
    allocs = list(o.allocations.order_by("pk"))
    messages.success(request, f"Ordered {o.quantity} × {tier.name}.")
    if len(allocs) == 1:
        return redirect("portal:slice", pk=allocs[0].pk)
    return redirect("portal:slices")


# --- slices -------------------------------------------------------------------------------------

SLICE_COLUMNS = [Column("id", "#"), Column("tier__name", "Tier"), Column("state", "State"),
                 Column("created_at", "Ordered"), Column("activated_at", "Active since"), Column("", "Models")]


@portal_view
def slices(request):
    qs = order_sel.allocations(request.principal).filter(tenant=request.tenant).prefetch_related("deployments")
    state = request.GET.get("state", "")
    if state in Allocation.State.values:
        qs = qs.filter(state=state)
    tbl = table(request, qs, SLICE_COLUMNS, default_sort="-created_at")
    return render(request, "portal/slices.html", ctx(request, table=tbl, state=state,
                                                     states=Allocation.State.choices))


def _slice(request, pk):
    a = get_object_or_404(order_sel.allocations(request.principal), pk=pk)
    use_tenant(request, a.tenant_id)
    return a


def _progress(a):
    events = list(a.events.all())
    reached = {e.to_state for e in events}
    steps = [{"state": s, "done": s in reached, "current": a.state == s} for s in STEPS]
    return {"slice": a, "events": events, "steps": steps, "moving": a.state not in FINAL_SLICE_STATES}


@portal_view
def slice_detail(request, pk):
    a = _slice(request, pk)
    deps = order_sel.deployments(request.principal).filter(allocation=a).exclude(state=ModelDeployment.State.REMOVED)
    return render(request, "portal/slice.html", ctx(request, deployments=list(deps),
                                                    templates=list(deployments.TEMPLATES), **_progress(a)))


@portal_view
def slice_status(request, pk):
    a = _slice(request, pk)
    response = render(request, "portal/_slice_status.html", _progress(a))
    if a.state in FINAL_SLICE_STATES and request.headers.get("HX-Request"):
        response["HX-Refresh"] = "true"  # the page shows what the final state allows (deploy, release)
    return response


@require_POST
@portal_view
def slice_release(request, pk):
    a = _slice(request, pk)
    require(request, "deploy", a.tenant_id)
    act(request, lambda: orders.request_release(request.principal, a), f"Slice #{a.pk} is being released.")
    return redirect("portal:slice", pk=a.pk)


# --- deployments ("Models") -----------------------------------------------------------------------

DEPLOYMENT_COLUMNS = [Column("name", "Model"), Column("allocation_id", "Slice"), Column("state", "State"),
                      Column("memory_mb", "Memory (MiB)"), Column("", "Requests 24 h"),
                      Column("", "Tokens 24 h (in / out)"),
                      Column("", "Errors 24 h"), Column("", "Latency 24 h (avg)"), Column("created_at", "Deployed"),
                      Column("", "")]


@portal_view
def deployment_list(request):
    return _deployment_list(request)


def _with_served_names(repositories) -> list:
    """Each repository with ``served_as``: the name its model is served (and called) by, which a deployment of it
    keeps (Triton serves a repository's model under its own name); empty when the repository holds several
    models and one must be named."""
    from marketplace.services import models as model_svc

    out = list(repositories)
    for r in out:
        try:
            r.served_as = model_svc.pick_model(r, None)[0]["name"]
        except ServiceError:
            r.served_as = ""
    return out


def _deployment_list(request, form=None, status=200):
    p, t = request.principal, request.tenant
    qs = order_sel.deployments(p).filter(tenant=t).exclude(state=ModelDeployment.State.REMOVED)
    qs = qs.select_related("allocation__tier")  # the selector prefetches the adapters
    tbl = table(request, qs, DEPLOYMENT_COLUMNS, default_sort="-created_at")
    from marketplace.selectors.model_traffic import traffic_by_deployment

    page_deps = list(tbl.page)
    traffic = traffic_by_deployment([d.pk for d in page_deps], timezone.now() - timedelta(hours=24))
    for d in page_deps:
        d.traffic = traffic[d.pk]
    active = order_sel.allocations(p).filter(tenant=t, state=Allocation.State.ACTIVE).order_by("pk")
    return render(request, "portal/deployments.html", ctx(
        request, table=tbl, active_slices=list(active), templates=list(deployments.TEMPLATES),
        repositories=_with_served_names(
            model_sel.repositories(p).filter(tenant=t, state=UploadState.READY).order_by("name")),
        library=list(model_sel.library()),
        adapters=list(model_sel.adapters(p).filter(tenant=t, state=UploadState.READY).order_by("name")),
        form=form or DeploymentForm(principal=p, tenant=t, initial={
            "allocation": request.GET.get("slice", ""), "template": "tiny-gen",
            "library_model": request.GET.get("library_model", ""), "concurrency": 1})),
        status=status)


@require_POST
@portal_view
def deployment_create(request):
    p, t = request.principal, request.tenant
    require(request, "deploy")
    form = DeploymentForm(request.POST, principal=p, tenant=t)
    if form.is_valid():
        d = form.cleaned_data
        alloc = d["allocation"]
        with service_errors(form, "spec"):
            if d["repository"] is not None:
                dep = deployments.deploy(p, alloc, d["name"], repository=d["repository"])
            elif d["library_model"] is not None:
                dep = deployments.deploy(p, alloc, d["name"], library_model=d["library_model"],
                                         adapters=list(d["adapters"]), context=d["context"] or 0,
                                         concurrency=d["concurrency"] or 1)
            else:
                dep = deployments.deploy(p, alloc, d["name"], template=d["template"] or "tiny-gen")
    if not form.is_valid():
        messages.error(request, "The model was not deployed: " + error_summary(form))
        return _deployment_list(request, form=form, status=400)
    messages.success(request, f"Deploying {dep.name} on slice #{alloc.pk}.")
    return redirect("portal:deployment", pk=dep.pk)


def _deployment(request, pk):
    dep = get_object_or_404(order_sel.deployments(request.principal).select_related("allocation__tier"), pk=pk)
    use_tenant(request, dep.tenant_id)
    return dep


@portal_view
def deployment_detail(request, pk, tried=None, try_form=None, status=200):
    dep = _deployment(request, pk)
    moving = dep.state in MOVING_DEPLOYMENT_STATES
    since = timezone.now() - timedelta(hours=24)
    served = deployment_served(dep, since)
    latency = deployment_latency(dep, since)
    from marketplace.selectors.model_traffic import deployment_windows

    adapters = [{"adapter": a, "examples": inference.examples(dep, a.name)} for a in dep.adapters.select_related(
        "base").order_by("name")]
    return render(request, "portal/deployment.html", ctx(
        request, dep=dep, moving=moving, gateway_url=settings.TESSERA_GATEWAY_URL, examples=inference.examples(dep),
        adapters=adapters,
        served=served, latency=latency, traffic=deployment_windows(dep, timezone.now()),
        tried=tried, try_form=try_form or TryForm(initial={"max_tokens": 32})),
        status=status)


@require_POST
@portal_view
def deployment_try(request, pk):
    """The "Try it" box: one prompt through the gateway, for the signed-in user (a minted short-lived token)."""
    dep = _deployment(request, pk)
    require(request, "infer", dep.tenant_id)
    form = TryForm(request.POST)
    if form.is_valid():
        with service_errors(form, "prompt"):
            tried = inference.try_prompt(request.principal, dep, form.cleaned_data["prompt"],
                                         form.cleaned_data["max_tokens"] or 32)
    if not form.is_valid():
        messages.error(request, error_summary(form))
        return deployment_detail(request, pk, try_form=form, status=400)
    return deployment_detail(request, pk, tried=tried, try_form=form)


@portal_view
def deployment_status(request, pk):
    dep = _deployment(request, pk)
    moving = dep.state in MOVING_DEPLOYMENT_STATES
    return render(request, "portal/_deployment_state.html", {"dep": dep, "moving": moving})


@require_POST
@portal_view
def deployment_remove(request, pk):
    dep = _deployment(request, pk)
    require(request, "deploy", dep.tenant_id)
    act(request, lambda: deployments.remove(request.principal, dep), f"Removing {dep.name}.")
    return redirect("portal:deployments")


@require_POST
@portal_view
def deployment_retry(request, pk):
    dep = _deployment(request, pk)
    require(request, "deploy", dep.tenant_id)
    act(request, lambda: deployments.retry(request.principal, dep), f"Loading {dep.name} again.")
    return redirect("portal:deployment", pk=dep.pk)


# --- usage --------------------------------------------------------------------------------------

@portal_view
def usage(request):
    p, t = request.principal, request.tenant
    try:
        days = max(1, min(90, int(request.GET.get("days", "7"))))
    except ValueError:
        days = 7
    end = timezone.now()
    start = (end - timedelta(days=days)).replace(minute=0, second=0, microsecond=0)  # usage is kept per hour
    bucket = "hour" if days == 1 else "day"  # a day's range reads by hour
    chart = None
    if p.can("billing", t.pk):
        chart = charts.figure_json("tenant-usage", p, {"tenant": t.slug, "start": start.isoformat(),
                                                       "end": end.isoformat(), "bucket": bucket,
                                                       "currency": t.currency})
    caps = ("read", "billing")
    rows = usage_summary(p, start, end, bucket, {"tenant": t.pk}, capabilities=caps)
    mark_partial(rows, bucket, start, end)
    rows.sort(key=lambda r: r[bucket], reverse=True)
    per_model = usage_summary(p, start, end, "deployment", {"tenant": t.pk}, capabilities=caps)
    per_model.sort(key=lambda r: (-(r["input_tokens"] + r["output_tokens"]), r["model"] or "", r["deployment"]))
    return render(request, "portal/usage.html", ctx(request, chart=chart, rows=rows, days=days, bucket=bucket,
                                                    per_model=per_model, start=start, end=end,
                                                    day_choices=[1, 7, 30, 90]))


def mark_partial(rows: list[dict], bucket: str, start, end) -> None:
    """Rows whose hour or day the range [start, end) covers only in part get `partial`, saying which part: the
    first day from the range's first hour, the current day or hour so far."""
    step = timedelta(hours=1) if bucket == "hour" else timedelta(days=1)
    for r in rows:
        at = r[bucket]
        if at < start:
            r["partial"] = f"from {start:%H:%M}"
        elif at + step > end:
            r["partial"] = f"to {end:%H:%M}, so far"


# --- invoices -----------------------------------------------------------------------------------

INVOICE_COLUMNS = [Column("period_start", "Period"), Column("number", "Number"), Column("status", "Status"),
                   Column("total", "Total"), Column("", "")]


@portal_view
def invoice_list(request):
    qs = billing_sel.invoices(request.principal).filter(tenant=request.tenant)
    tbl = table(request, qs, INVOICE_COLUMNS, default_sort="-period_start")
    return render(request, "portal/invoices.html", ctx(request, table=tbl))


def _invoice(request, pk):
    inv = get_object_or_404(billing_sel.invoices(request.principal), pk=pk)
    use_tenant(request, inv.tenant_id)
    return inv


@portal_view
def invoice_detail(request, pk):
    inv = _invoice(request, pk)
    notes = list(inv.credit_notes.all())
    return render(request, "portal/invoice.html", ctx(request, invoice=inv, lines=list(inv.lines.all()),
                                                      credit_notes=notes, by_key=billing_sel.key_breakdown(inv),
                                                      credited=sum((cn.total for cn in notes), Decimal(0)),
                                                      net=billing.net_balance(inv.total, [cn.total for cn in notes]),
                                                      pdf_unavailable=documents.unavailable()))


@portal_view
def invoice_pdf(request, pk):
    inv = _invoice(request, pk)
    return pdf_response(request, documents.invoice_pdf, inv, reverse("portal:invoice", args=[inv.pk]))


@portal_view
def credit_note_pdf(request, pk):
    """A credit note of one of the tenant's invoices (another tenant's: 404)."""
    cn = get_object_or_404(billing_sel.credit_notes(request.principal), pk=pk)
    use_tenant(request, cn.tenant_id)
    return pdf_response(request, documents.credit_note_pdf, cn, reverse("portal:invoice", args=[cn.invoice_id]))


@portal_view
def billing_details(request):
    """The tenant's billing details, as its invoices and credit notes print them: owners and admins edit them
    (manage_tenant), the billing role reads them. A finalized invoice keeps the details it was issued with."""
    t = request.tenant
    can_edit = request.principal.can("manage_tenant", t.pk)
    require(request, "billing" if not can_edit else "manage_tenant")
    form = BillingDetailsForm(instance=t)
    status = 200
    if request.method == "POST":
        require(request, "manage_tenant")
        form = BillingDetailsForm(request.POST, instance=Tenant.objects.get(pk=t.pk))
        if form.is_valid():
            changed = {name: form.cleaned_data[name] for name in form.changed_data}
            with service_errors(form) as failed:
                tenant_services.update_tenant(request.principal, Tenant.objects.get(pk=t.pk), **changed)
            if not failed:
                messages.success(request, "Billing details saved: your next invoices and credit notes carry them."
                                 if changed else "Nothing changed.")
                return redirect("portal:billing_details")
        status = 400
    elif request.method != "GET":
        return HttpResponse(status=405)
    return render(request, "portal/billing_details.html", ctx(request, form=form, can_edit=can_edit), status=status)


@portal_view
def invoice_download(request, pk):
    inv = _invoice(request, pk)
    response = HttpResponse(invoice_csv(inv), content_type="text/csv; charset=utf-8")
    name = inv.number or f"draft-{inv.tenant.slug}-{inv.period_start:%Y-%m}"
    response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
    return response


# --- API keys -----------------------------------------------------------------------------------

KEY_COLUMNS = [Column("name", "Name"), Column("prefix", "Prefix"), Column("", "Scopes"), Column("", "Status"),
               Column("", "Limits (per minute; tokens per month)"), Column("", "Tokens this month"),
               Column("created_at", "Created"), Column("last_used_at", "Last used"),
               Column("", "")]


@portal_view
def keys(request):
    return _keys(request)


def _keys(request, form=None, status=200):
    qs = ApiKey.objects.visible_to(request.principal, "manage_keys").filter(tenant=request.tenant) \
        .select_related("created_by")
    tbl = table(request, qs, KEY_COLUMNS, default_sort="-created_at")
    tenant = request.tenant
    used = key_tokens([k.prefix for k in tbl.page], *billing.bounds(billing.month_of(timezone.now())))
    for k in tbl.page:
        k.month_tokens = used.get(k.prefix, 0)
    return render(request, "portal/keys.html", ctx(
        request, table=tbl, scopes=TENANT_SCOPES, form=form or ApiKeyForm(),
        tomorrow=timezone.now().date() + timedelta(days=1),
        ceilings=_ceilings(tenant)), status=status)


def _ceilings(tenant) -> dict:
    """The most a tenant admin may give a key, for the keys page (raw for the inputs' max, grouped for the text)."""
    rpm = tenant_services.key_limit_ceiling(tenant, "requests_per_minute")
    tpm = tenant_services.key_limit_ceiling(tenant, "tokens_per_minute")
    return {"rpm": rpm, "tpm": tpm, "rpm_text": f"{rpm:,}", "tpm_text": f"{tpm:,}"}


@require_POST
@portal_view
def key_create(request):
    require(request, "manage_keys")
    form = ApiKeyForm(request.POST)
    if form.is_valid():
        d = form.cleaned_data
        with service_errors(form, "name", aliases={"expires_at": "expires_on"}):
            key, secret = tenant_services.create_api_key(request.principal, tenant=request.tenant, name=d["name"],
                                                         scopes=d["scopes"], expires_at=form.expires_at,
                                                         requests_per_minute=d["requests_per_minute"],
                                                         tokens_per_minute=d["tokens_per_minute"],
                                                         monthly_token_allowance=d["monthly_token_allowance"])
    if not form.is_valid():
        messages.error(request, f"The key was not created — {error_summary(form)}")
        return _keys(request, form=form, status=400)
    response = render(request, "portal/key_created.html", ctx(request, key=key, secret=secret))
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@portal_view
def key_limits(request, pk):
    key = get_object_or_404(ApiKey.objects.visible_to(request.principal, "manage_keys"), pk=pk)
    use_tenant(request, key.tenant_id)
    form = KeyLimitsForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"The limits of {key.name} were not changed — {error_summary(form)}")
        return redirect("portal:keys")
    with service_errors() as failed:
        tenant_services.update_api_key_limits(request.principal, key, **form.cleaned_data)
    if failed:
        messages.error(request, f"The limits of {key.name} were not changed — {failed.text}")
    else:
        messages.success(request, f"Limits of {key.name} ({key.prefix}…) saved; the gateway applies them within "
                                  f"seconds.")
    return redirect("portal:keys")


@require_POST
@portal_view
def key_revoke(request, pk):
    key = get_object_or_404(ApiKey.objects.visible_to(request.principal, "manage_keys"), pk=pk)
    use_tenant(request, key.tenant_id)
    act(request, lambda: tenant_services.revoke_api_key(request.principal, key),
        f"Key {key.name} ({key.prefix}…) revoked.")
    return redirect("portal:keys")


# --- members ------------------------------------------------------------------------------------

MEMBER_COLUMNS = [Column("user__email", "E-mail"), Column("user__full_name", "Name"), Column("role", "Role"),
                  Column("created_at", "Member since"), Column("", "")]


@portal_view
def members(request):
    return _members(request)


def _members(request, form=None, status=200):
    p, t = request.principal, request.tenant
    qs = Membership.objects.visible_to(p).filter(tenant=t).select_related("user")
    tbl = table(request, qs, MEMBER_COLUMNS, default_sort="user__email")
    pending = (Invitation.objects.visible_to(p, "manage_members").filter(tenant=t)
               .filter(accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now())
               .select_related("invited_by"))
    roles = [(v, label) for v, label in Role.choices if v != Role.OWNER or p.role_in(t.pk) == Role.OWNER]
    return render(request, "portal/members.html", ctx(
        request, table=tbl, invitations=list(pending), roles=roles, is_owner=p.role_in(t.pk) == Role.OWNER,
        form=form or InviteForm()), status=status)


@require_POST
@portal_view
def member_invite(request):
    require(request, "manage_members")
    form = InviteForm(request.POST)
    if form.is_valid():
        with service_errors(form, "email"):
            inv, _token = tenant_services.invite(request.principal, tenant=request.tenant,
                                                 email=form.cleaned_data["email"], role=form.cleaned_data["role"])
    if not form.is_valid():
        messages.error(request, "Not invited — " + error_summary(form))
        return _members(request, form=form, status=400)
    messages.success(request, f"Invitation sent to {inv.email} ({inv.role}).")
    return redirect("portal:members")


@require_POST
@portal_view
def member_role(request, pk):
    """Owners/admins change a member's role (owner only by owners; the last owner stays)."""
    m = get_object_or_404(Membership.objects.visible_to(request.principal).select_related("user"), pk=pk)
    use_tenant(request, m.tenant_id)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"The role was not changed — {error_summary(form)}")
        return redirect(reverse("portal:members"))
    role = form.cleaned_data["role"]
    act(request, lambda: tenant_services.change_role(request.principal, m, role), f"{m.user.email} is now {role}.")
    return redirect(reverse("portal:members"))


@require_POST
@portal_view
def member_remove(request, pk):
    """Owners/admins remove a member; anyone may leave (the last owner stays)."""
    m = get_object_or_404(Membership.objects.visible_to(request.principal).select_related("user"), pk=pk)
    use_tenant(request, m.tenant_id)
    act(request, lambda: tenant_services.remove_member(request.principal, m), f"{m.user.email} removed.")
    return redirect(reverse("portal:members"))


@require_POST
@portal_view
def invitation_revoke(request, pk):
    inv = get_object_or_404(Invitation.objects.visible_to(request.principal, "manage_members"), pk=pk)
    use_tenant(request, inv.tenant_id)
    act(request, lambda: tenant_services.revoke_invitation(request.principal, inv),
        f"Invitation for {inv.email} revoked.")
    return redirect(reverse("portal:members"))



# --- a tenant's own model repositories, and "find a tier" ------------------------------------------

def _uploads(request) -> dict:
    """The tenant's repositories and adapters, and whether any is still validating (the tables refresh then)."""
    repos = list(model_sel.repositories(request.principal).filter(tenant=request.tenant).order_by("-created_at"))
    adapters = list(model_sel.adapters(request.principal).filter(tenant=request.tenant).order_by("-created_at"))
    moving = UploadState.VALIDATING
    return {"repositories": repos, "adapters": adapters,
            "repositories_validating": any(r.state == moving for r in repos),
            "adapters_validating": any(a.state == moving for a in adapters)}


def _repositories(request, form=None, status=200, adapter_form=None):
    return render(request, "portal/repositories.html", ctx(
        request, form=form or RepositoryForm(), adapter_form=adapter_form or AdapterForm(),
        bases=list(model_sel.library().filter(backend="vllm")),
        max_mb=settings.TESSERA_UPLOAD_MAX_BYTES // (1024 * 1024), **_uploads(request)), status=status)


@portal_view
def repositories(request):
    return _repositories(request)


@portal_view
def uploads_status(request):
    """htmx: the repositories (or adapters) table again, while one of them is validating."""
    which = "adapters" if request.GET.get("which") == "adapters" else "repositories"
    return render(request, "portal/_uploads.html", {"which": which, **_uploads(request)})


@require_POST
@portal_view
def repository_upload(request):
    p, t = request.principal, request.tenant
    require(request, "deploy")
    form = RepositoryForm(request.POST, request.FILES)
    if form.is_valid():
        d = form.cleaned_data
        with service_errors(form, "archive"):
            if d["archive"]:
                repo = model_svc.upload_repository(p, t, d["name"], d["archive"])
            else:
                repo = model_svc.import_from_store(p, t, d["name"], d["store_path"])
    if not form.is_valid():
        messages.error(request, "The repository was not stored: " + error_summary(form))
        return _repositories(request, form=form, status=400)
    messages.success(request, f"Repository {repo.name} stored; it is being unpacked and checked (this page shows "
                              "when it is ready).")
    return redirect("portal:repositories")


@require_POST
@portal_view
def adapter_upload(request):
    p, t = request.principal, request.tenant
    require(request, "deploy")
    form = AdapterForm(request.POST, request.FILES)
    if form.is_valid():
        d = form.cleaned_data
        with service_errors(form, "archive"):
            ad = model_svc.upload_adapter(p, t, d["name"], d["base"], d["archive"])
    if not form.is_valid():
        messages.error(request, "The adapter was not stored: " + error_summary(form))
        return _repositories(request, adapter_form=form, status=400)
    messages.success(request, f"LoRA adapter {ad.name} stored for {ad.base.name}; it is being unpacked and checked "
                              "(this page shows when it is ready).")
    return redirect("portal:repositories")


@portal_view
def find_tier(request):
    """Given a library model (or one of the tenant's repositories, or a size), a context and a concurrency: every
    tier it fits, with price per hour, expected tokens/s and cost per 1M tokens; order from here."""
    from marketplace.api.models import FindTierSerializer, find

    p, t = request.principal, request.tenant
    q = request.GET
    form = {k: q.get(k, "") for k in ("library_model", "repository", "memory_mib", "backend", "context",
                                      "concurrency")}
    data = {k: v for k, v in form.items() if v}
    options, errors, shown = None, {}, None
    if data.get("library_model") or data.get("repository") or data.get("memory_mib"):
        s = FindTierSerializer(data={**data, "currency": t.currency,
                                     "all": q.get("all") == "1"})
        if s.is_valid():
            with service_errors() as failed:
                options = find(p, s.validated_data)
                shown = s.validated_data.get("library_model")
            if failed.error is not None:
                errors[failed.error.field or "library_model"] = failed.error.message
        else:
            errors = {k: "; ".join(str(m) for m in v) for k, v in s.errors.items()}
    tiers_by_key = {x.key: x for x in order_sel.tiers().filter(active=True)}
    if options:
        for o in options:
            o["tier_id"] = tiers_by_key[o["tier"]].pk
    return render(request, "portal/find_tier.html", ctx(
        request, form=form, options=options, errors=errors, shown=shown, library=list(model_sel.library()),
        repositories=_with_served_names(
            model_sel.repositories(p).filter(tenant=t, state=UploadState.READY).order_by("name")),
        backends=list(model_svc.model_repo.KNOWN_BACKENDS)), status=400 if errors else 200)
