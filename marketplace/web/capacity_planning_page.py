"""Console: the capacity and cost-per-token planner (GET form: a plan is a shareable URL; nothing is stored)."""

from __future__ import annotations

import re
from typing import Any

from django import forms
from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from marketplace import planner
from marketplace.models import GpuModel
from marketplace.selectors import capacity_planning
from marketplace.web.console import operator_required
from telemetry.charts import capacity_plan
from telemetry.services.energy import price_per_kwh
from tenants.models import CURRENCIES


def _models() -> list[GpuModel]:
    return list(GpuModel.objects.order_by("memory_gb", "key"))


class WorkloadForm(forms.Form):
    name = forms.CharField(max_length=80, required=False)
    tokens_per_s = forms.FloatField(required=False, min_value=0.001, max_value=1e9, label="Tokens/s")
    min_memory_gib = forms.FloatField(required=False, min_value=0, max_value=10_000, label="Memory per replica (GiB)")
    gpu_model = forms.ChoiceField(required=False, label="GPU model")

    def __init__(self, *args, models=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["gpu_model"].choices = [("", "any")] + [(m.key, m.name) for m in models]

    def clean(self):
        data = super().clean()
        given = [data.get(k) not in (None, "") for k in ("name", "tokens_per_s", "min_memory_gib")]
        if any(given) and not all(given):
            raise forms.ValidationError("give the name, tokens/s and memory of the workload (or leave the row empty)")
        data["empty"] = not any(given)
        return data


def _blank(form) -> bool:
    """An untouched extra row (not validated: no cleaned data) or one left empty."""
    return not form.cleaned_data or form.cleaned_data.get("empty", False)


class BaseWorkloadFormSet(forms.BaseFormSet):
    def clean(self):
        if any(self.errors):
            return
        names = [f.cleaned_data["name"] for f in self.forms if not _blank(f)]
        if not names:
            raise forms.ValidationError("give at least one workload")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise forms.ValidationError(f"workload names must be unique: {', '.join(dup)}")


WorkloadFormSet = forms.formset_factory(WorkloadForm, formset=BaseWorkloadFormSet, extra=2,
                                        max_num=capacity_planning.MAX_WORKLOADS, validate_max=True,
                                        absolute_max=capacity_planning.MAX_WORKLOADS)


def _shape_field(key: str) -> str:
    return "tps_" + key.replace("/", "__")


class SettingsForm(forms.Form):
    target_utilization = forms.FloatField(min_value=1, max_value=100,
                                          initial=capacity_planning.DEFAULT_TARGET_UTILIZATION * 100,
                                          label="Target utilization (%)",
                                          help_text="replicas are added before a slice runs above this load")
    growth = forms.FloatField(min_value=0.01, max_value=10_000, initial=1, label="Demand growth (×)")
    window_days = forms.FloatField(min_value=0.05, max_value=366, initial=capacity_planning.DEFAULT_WINDOW_DAYS,
                                   label="Measurement window (days)")
    price_per_kwh = forms.DecimalField(min_value=0, max_digits=8, decimal_places=4, label="Energy price per kWh")
    currency = forms.ChoiceField(choices=CURRENCIES, initial="USD")
    gpu_models = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple,
                                           label="GPU models the fleet may use")

    def __init__(self, *args, models=(), shapes=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["price_per_kwh"].initial = price_per_kwh()
        self.fields["gpu_models"].choices = [(m.key, m.name) for m in models]
        self.fields["gpu_models"].initial = [m.key for m in models]
        self.cost_fields, self.tps_fields = [], []
        for m in models:
            name = f"cost_{m.key}"
            self.fields[name] = forms.DecimalField(min_value=0, max_digits=10, decimal_places=4,
                                                   initial=capacity_planning.default_gpu_hour_cost(m.key),
                                                   label=f"{m.name}: cost per GPU-hour",
                                                   help_text="hardware + hosting, power excluded")
            self.cost_fields.append(name)
        for f in shapes:
            name = _shape_field(f.key)
            hint = forms.NumberInput(attrs={"placeholder": f"{f.tokens_per_s:.0f}"})
            self.fields[name] = forms.FloatField(required=False, min_value=0.001, max_value=1e9, label=f.label,
                                                 widget=hint)
            self.tps_fields.append(name)

    def clean_gpu_models(self):
        chosen = self.cleaned_data.get("gpu_models") or []
        if self.is_bound and not chosen:
            raise forms.ValidationError("choose at least one GPU model")
        return chosen


ROW_KEY = re.compile(r"^w-(\d+)-")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def plan_query(get: QueryDict, settings_form: SettingsForm) -> tuple[QueryDict, list[str]]:
    """The plan's query string made whole, so that an edited or shortened URL never meets Django's
    management-form checks ("(Hidden field TOTAL_FORMS) ..."): the row count is the rows the link holds
    (at most MAX_WORKLOADS), and a setting the link lacks takes its default. Values that are there but
    wrong stay, and are said next to their field. Returns the data and what was changed, in words."""
    data = get.copy()
    notes = []
    rows = max((int(m[1]) + 1 for k in data if (m := ROW_KEY.match(k))), default=0)
    total = _int(data.get("w-TOTAL_FORMS"))
    if total is None or total < 0:
        if "w-TOTAL_FORMS" in data:
            notes.append("The link's workload count was not a number; its rows are read as they are.")
        total = rows
    most = capacity_planning.MAX_WORKLOADS
    if total > most:
        notes.append(f"The planner takes at most {most} workloads; the first {most} are planned.")
        total = most
    initial = _int(data.get("w-INITIAL_FORMS"))
    data["w-TOTAL_FORMS"] = str(total)
    data["w-INITIAL_FORMS"] = str(initial if initial is not None and 0 <= initial <= total else 0)
    for name in ("w-MIN_NUM_FORMS", "w-MAX_NUM_FORMS"):  # the formset's own limits apply, not the link's
        data.pop(name, None)
    defaulted = []
    for name, field in settings_form.fields.items():
        if field.required and name not in data and not isinstance(field, forms.MultipleChoiceField):
            value = settings_form.get_initial_for_field(field, name)
            if value is not None:
                data[name] = str(value)
                defaulted.append(str(field.label))
    if defaulted:
        notes.append(f"Not in the link, so at their defaults: {', '.join(defaulted)}.")
    return data, notes


def _request(workloads, settings_form, models, shapes, until=None) -> capacity_planning.PlanRequest:
    d = settings_form.cleaned_data
    by_model = {m.key for m in models}
    return capacity_planning.PlanRequest(
        workloads=workloads,
        target_utilization=d["target_utilization"] / 100,
        growth=d["growth"],
        window_days=d["window_days"],
        price_per_kwh=float(d["price_per_kwh"]),
        currency=d["currency"],
        gpu_models=tuple(k for k in d["gpu_models"] if k in by_model) or None,
        gpu_hour_cost={m.key: float(d[f"cost_{m.key}"]) for m in models},
        throughput={f.key: d[_shape_field(f.key)] for f in shapes if d.get(_shape_field(f.key))},
        until=until,
    )


def _workloads(formset) -> list[planner.Workload]:
    out = []
    for f in formset.forms:
        if _blank(f):
            continue
        d = f.cleaned_data
        out.append(planner.Workload(d["name"], d["tokens_per_s"], d["min_memory_gib"],
                                    (d["gpu_model"],) if d.get("gpu_model") else ()))
    return out


@require_GET
@operator_required
def planner_page(request: HttpRequest) -> HttpResponse:
    models = _models()
    # measured over whole hours: the inputs (and so the solved plan, kept in the cache) change once an hour
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    since, until = capacity_planning.window(until=hour)
    shapes = capacity_planning.shape_figures(since, until, measure=False)  # the form's fields; the plan measures
    bound = "plan" in request.GET
    report = error = None
    notes: list[str] = []
    if bound:
        data, notes = plan_query(request.GET, SettingsForm(models=models, shapes=shapes))
        formset = WorkloadFormSet(data, prefix="w", form_kwargs={"models": models})
        settings_form = SettingsForm(data, models=models, shapes=shapes)
        if formset.is_valid() and settings_form.is_valid():
            try:
                report = capacity_planning.build_plan(_request(_workloads(formset), settings_form, models, shapes,
                                                                       until=hour))
            except planner.PlanError as exc:
                error = exc.message
    else:
        demand = capacity_planning.measured_demand(since, until)
        initial = [{"name": d["name"], "tokens_per_s": d["tokens_per_s"], "min_memory_gib": d["min_memory_gib"]}
                   for d in demand]
        formset = WorkloadFormSet(prefix="w", initial=initial, form_kwargs={"models": models})
        settings_form = SettingsForm(models=models, shapes=shapes)
        if demand:
            try:
                report = capacity_planning.build_plan(capacity_planning.PlanRequest(workloads=[
                    planner.Workload(d["name"], d["tokens_per_s"], d["min_memory_gib"]) for d in demand], until=hour))
            except planner.PlanError as exc:
                error = exc.message
    ctx: dict[str, Any] = {
        "formset": formset, "settings_form": settings_form, "report": report, "error": error, "notes": notes,
        "base_fields": [settings_form[n] for n in ("target_utilization", "growth", "window_days", "price_per_kwh",
                                                   "currency", "gpu_models")],
        "cost_fields": [settings_form[n] for n in settings_form.cost_fields],
        "tps_fields": [settings_form[n] for n in settings_form.tps_fields],
        "measured_default": not bound}
    if report is not None:
        for f in report.shapes:  # hint the measured (or modelled) figure an override replaces
            hint = f.measured_tps if f.measured_tps is not None else f.modelled_tps
            settings_form.fields[_shape_field(f.key)].widget.attrs["placeholder"] = f"{hint:.0f}"
        ctx["figure"] = capacity_plan(report)
        ctx["plan"] = capacity_planning.report_dict(report)
        ctx["best"] = report.best
        ctx["shape_rows"] = ctx["plan"]["shapes"]
    return render(request, "console/planner.html", ctx)
