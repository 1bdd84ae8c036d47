"""The tenant portal's forms (one per POST that takes input) and `service_errors`, the one way a portal view
turns a service's refusal into what the person sees.

A form only parses and checks the input's shape (numbers, choices among the tenant's own objects); the rules
stay in the services, whose `ServiceError`s land on the field they name. A form that does not validate stores
nothing: the view calls the service only with `cleaned_data`.
"""

from __future__ import annotations

from datetime import UTC, datetime, time
from typing import cast

from django import forms
from django.utils import timezone

from marketplace.models import Allocation, LoraAdapter, ModelRepository, PricePlan, UploadState
from marketplace.selectors import models as model_sel
from marketplace.selectors import orders as order_sel
from tenants.errors import Forbidden, ServiceError
from tenants.models import Tenant
from tenants.roles import OPERATOR_ONLY_SCOPES, Role, Scope

TENANT_SCOPES = [c for c in Scope.choices if c[0] not in OPERATOR_ONLY_SCOPES]


class service_errors:  # a context manager, named like contextlib's
    """Run a service call; a `ServiceError` it raises is kept (and put on `form`, on the field it names when
    the form has that field, else on `default_field`, else on the whole form). `Forbidden` is never caught:
    it stays a 403. The manager is falsy when the call went through::

        with service_errors(form) as failed:
            key = tenant_services.create_api_key(...)
        if failed:
            return render_again(form, status=400)
    """

    def __init__(self, form: forms.Form | None = None, default_field: str | None = None,
                 aliases: dict[str, str] | None = None):
        self.form = form
        self.default_field = default_field
        self.aliases = aliases or {}  # a service's field name -> the form's
        self.error: ServiceError | None = None

    def __enter__(self) -> service_errors:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, ServiceError) or isinstance(exc, Forbidden):
            return False
        self.error = exc
        if self.form is not None:
            field = self.aliases.get(exc.field or "", exc.field)
            field = field if field in self.form.fields else self.default_field
            self.form.add_error(field, exc.message)
        return True

    def __bool__(self) -> bool:
        return self.error is not None

    @property
    def text(self) -> str:
        """The error for a flash message: the field it names, then the message."""
        exc = self.error
        if exc is None:
            return ""
        if not exc.field or exc.field in ("non_field_errors", "tenant"):
            return exc.message
        return f"{exc.field}: {exc.message}"


def error_summary(form: forms.BaseForm) -> str:
    """Every error of a form on one line (for the flash message above the page)."""
    return "; ".join(str(m) for errors in form.errors.values() for m in errors)


def _whole(label: str, *, required: bool = False, min_value: int | None = None, **kw) -> forms.IntegerField:
    kw.setdefault("error_messages", {"invalid": "a whole number"})
    return forms.IntegerField(label=label, required=required, min_value=min_value, **kw)


class OrderForm(forms.Form):
    """Order slices of one tier (from the catalog, or from "find a tier" with the model it must fit)."""

    quantity = _whole("Quantity", required=True, min_value=1, max_value=64, initial=1,
                      error_messages={"invalid": "a whole number", "min_value": "must be between 1 and 64",
                                      "max_value": "must be between 1 and 64"})
    plan_kind = forms.ChoiceField(choices=PricePlan.Kind.choices, required=False, initial=PricePlan.Kind.ON_DEMAND)
    library_model = forms.ModelChoiceField(queryset=model_sel.library(), to_field_name="key", required=False,
                                           error_messages={"invalid_choice": "choose a model of the library"})
    context = _whole("Context", min_value=0)
    concurrency = _whole("Sequences", min_value=1)

    def clean_plan_kind(self) -> str:
        return self.cleaned_data.get("plan_kind") or PricePlan.Kind.ON_DEMAND


class DeploymentForm(forms.Form):
    """Deploy a template, one of the tenant's repositories or a library model (with adapters) on a slice."""

    allocation = forms.ModelChoiceField(queryset=Allocation.objects.none(),
                                        error_messages={"required": "choose one of your active slices",
                                                        "invalid_choice": "choose one of your active slices"})
    name = forms.CharField(max_length=64, required=False)
    template = forms.CharField(max_length=64, required=False)
    repository = forms.ModelChoiceField(queryset=ModelRepository.objects.none(), required=False,
                                        error_messages={"invalid_choice": "choose one of your repositories"})
    library_model = forms.ModelChoiceField(queryset=model_sel.library(), to_field_name="key", required=False,
                                           error_messages={"invalid_choice": "choose a model of the library"})
    context = _whole("Context", min_value=0)
    concurrency = _whole("Sequences", min_value=1)
    adapters = forms.ModelMultipleChoiceField(queryset=LoraAdapter.objects.none(), required=False)
    #: where a service error about something the form has no field for is shown
    spec = forms.CharField(required=False, widget=forms.HiddenInput)

    def __init__(self, *args, principal, tenant, **kw):
        super().__init__(*args, **kw)
        choices = {name: cast(forms.ModelChoiceField, self.fields[name]) for name in ("allocation", "repository",
                                                                                     "adapters")}
        choices["allocation"].queryset = order_sel.allocations(principal).filter(tenant=tenant)
        # only ready ones are offered (the service refuses the others with a 409 anyway)
        choices["repository"].queryset = model_sel.repositories(principal).filter(tenant=tenant,
                                                                                  state=UploadState.READY)
        choices["adapters"].queryset = model_sel.adapters(principal).filter(tenant=tenant, state=UploadState.READY)

    def clean(self):
        data = super().clean()
        if not data.get("name") and data.get("repository") is None and "repository" not in self.errors:
            self.add_error("name", "give the model a name")
        return data


class TryForm(forms.Form):
    """One prompt through the gateway ("Try it")."""

    prompt = forms.CharField(strip=False, required=False)
    max_tokens = _whole("Max tokens", initial=32)


class ApiKeyForm(forms.Form):
    """A new API key of the current tenant: a name, its scopes and (optionally) when it expires."""

    name = forms.CharField(max_length=100, error_messages={"required": "may not be blank"})
    scopes = forms.MultipleChoiceField(choices=TENANT_SCOPES, initial=["read"],
                                       error_messages={"required": "name at least one scope"})
    expires_on = forms.DateField(required=False, label="Expires on",
                                 widget=forms.DateInput(attrs={"type": "date"}),
                                 help_text="optional; the key stops working at 00:00 UTC that day")

    def clean_expires_on(self):
        day = self.cleaned_data.get("expires_on")
        if day is not None and day <= timezone.now().date():
            raise forms.ValidationError("must be a day after today")
        return day

    requests_per_minute = _whole("Requests per minute", min_value=1)
    tokens_per_minute = _whole("Tokens per minute", min_value=1)
    monthly_token_allowance = _whole("Tokens per month", min_value=1)

    @property
    def expires_at(self) -> datetime | None:
        day = self.cleaned_data.get("expires_on")
        return datetime.combine(day, time(0), tzinfo=UTC) if day else None


class KeyLimitsForm(forms.Form):
    """A key's gateway limits (empty: the provider's default, or the tenant's ceiling when lower) and its monthly
    token allowance (empty: none)."""

    requests_per_minute = _whole("Requests per minute", min_value=1)
    tokens_per_minute = _whole("Tokens per minute", min_value=1)
    monthly_token_allowance = _whole("Tokens per month", min_value=1)


class BillingDetailsForm(forms.ModelForm):
    """A tenant's billing details, as its invoices and credit notes print them (the portal's owners and admins, the
    console's operators): the model fields' own checks; tenants.services.update_tenant normalizes and checks again."""

    class Meta:
        model = Tenant
        fields = ["billing_legal_name", "billing_address", "billing_tax_id", "billing_email"]
        labels = {"billing_legal_name": "Legal name", "billing_address": "Address", "billing_tax_id": "Tax id",
                  "billing_email": "Billing e-mail"}
        widgets = {"billing_address": forms.Textarea(attrs={"rows": 4, "cols": 40})}


class InviteForm(forms.Form):
    email = forms.EmailField(max_length=254, error_messages={"invalid": "enter an e-mail address",
                                                             "required": "enter an e-mail address"})
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices, error_messages={"invalid_choice": "choose one of the roles"})


class RepositoryForm(forms.Form):
    """A model repository: an uploaded archive or a folder of the MSP's model store (exactly one)."""

    name = forms.CharField(max_length=64, required=False)
    archive = forms.FileField(required=False)
    store_path = forms.CharField(max_length=500, required=False)

    def clean(self):
        data = super().clean()
        if bool(data.get("archive")) == bool(data.get("store_path")):
            self.add_error("archive", "choose an archive (.tar.gz or .zip) or give a model-store path")
        return data


class AdapterForm(forms.Form):
    """A LoRA adapter for a library model."""

    name = forms.CharField(max_length=64, required=False)
    base = forms.ModelChoiceField(queryset=model_sel.library(), to_field_name="key",
                                  error_messages={"required": "choose the library model it was trained on",
                                                  "invalid_choice": "choose the library model it was trained on"})
    archive = forms.FileField(error_messages={"required": "choose the adapter's archive (.tar.gz or .zip)"})
