"""Writes for tenancy: tenants, memberships, invitations, API keys. Each is one transaction."""

from __future__ import annotations

import logging
import re
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import IntegrityError, models, transaction
from django.db.models import Q
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from . import audit, keys
from .errors import Conflict, Forbidden, ServiceError
from .models import ApiKey, Invitation, Membership, Tenant, User
from .roles import OPERATOR_ONLY_SCOPES, Role, Scope
from .scoping import Principal

log = logging.getLogger("tessera.tenants")

TENANT_PROFILE_FIELDS = {"name", "billing_email", "billing_legal_name", "billing_address", "billing_tax_id"}
#: the billing details on the tenant's invoices and credit notes (owners/admins and operators edit them)
BILLING_DETAIL_FIELDS = ("billing_legal_name", "billing_address", "billing_tax_id")
# Operator-only: quotas, limits and the billing currency (which applies from the next period).
TENANT_QUOTA_FIELDS = {"currency",
    "max_slices", "max_slices_per_tier", "max_memory_gb",
    "monthly_spend_limit", "spend_warn_ratio", "spend_block_ratio",
    "max_concurrent_requests", "max_key_requests_per_minute", "max_key_tokens_per_minute",
    "sso_email_domain",
}
#: an API key's gateway limit -> (the tenant's ceiling for it, the installation's default when the key sets none)
KEY_LIMITS = {"requests_per_minute": ("max_key_requests_per_minute", "TESSERA_GATEWAY_RPM"),
              "tokens_per_minute": ("max_key_tokens_per_minute", "TESSERA_GATEWAY_TPM")}
#: limits that must be whole numbers of at least 1 when set (0 would refuse everything: suspend a tenant instead)
POSITIVE_LIMITS = ("max_concurrent_requests", "max_key_requests_per_minute", "max_key_tokens_per_minute")


def _require(principal: Principal, capability: str, tenant_id: int | None) -> None:
    if not principal.can(capability, tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow this.")


def _billing_details(fields: dict, tenant: Tenant) -> None:
    """The billing details, normalized (surrounding spaces and blank lines dropped) and checked by the model
    fields' own validators (tenants.models: lengths, the address's lines, the tax id's characters)."""
    for name in BILLING_DETAIL_FIELDS:
        if name not in fields:
            continue
        value = str(fields[name] or "")
        if name == "billing_address":
            value = "\n".join(ln.strip() for ln in value.splitlines() if ln.strip())
        fields[name] = value = value.strip()
        field = Tenant._meta.get_field(name)
        assert isinstance(field, models.Field)
        try:
            field.clean(value, tenant)
        except ValidationError as exc:
            raise ServiceError("; ".join(exc.messages), field=name) from None


_DOMAIN = re.compile(r"^(?=.{1,253}$)([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")


def _sso_domain(fields: dict, tenant_id: int | None) -> None:
    """sso_email_domain (single sign-on: its people join the tenant): a lower-case DNS name, one tenant's only."""
    if "sso_email_domain" not in fields:
        return
    domain = str(fields["sso_email_domain"] or "").strip().lower().removeprefix("@")
    if domain and not _DOMAIN.match(domain):
        raise ServiceError("must be an e-mail domain like example.com (empty: by invitation only)",
                           field="sso_email_domain")
    others = Tenant.objects.filter(sso_email_domain=domain)
    if tenant_id is not None:
        others = others.exclude(pk=tenant_id)
    if domain and others.exists():
        raise Conflict("another tenant signs in people of this domain", field="sso_email_domain")
    fields["sso_email_domain"] = domain


def _check_quota_values(values: dict) -> None:
    for name in POSITIVE_LIMITS:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ServiceError("must be a whole number of at least 1", field=name)
    if values.get("max_concurrent_requests", 1) is None:
        raise ServiceError("may not be empty", field="max_concurrent_requests")
    total = values.get("max_slices")
    per_tier = values.get("max_slices_per_tier")
    if total is not None and per_tier is not None and per_tier > total:
        raise ServiceError("cannot exceed max_slices", field="max_slices_per_tier")
    warn, block = values.get("spend_warn_ratio"), values.get("spend_block_ratio")
    if warn is not None and block is not None and warn > block:
        raise ServiceError("cannot exceed spend_block_ratio", field="spend_warn_ratio")


# --- tenants ----------------------------------------------------------------------------------

@transaction.atomic
def create_tenant(principal: Principal, *, owner_email: str | None = None, **fields) -> Tenant:
    """Operators create tenants. With owner_email, the first owner is invited (or added if known)."""
    _require(principal, "operate", None)
    if Tenant.objects.filter(slug=fields["slug"]).exists():
        raise Conflict("a tenant with this slug exists", field="slug")
    defaults = {f.name: f.get_default() for f in Tenant._meta.fields if f.name in TENANT_QUOTA_FIELDS}
    _sso_domain(fields, None)
    _check_quota_values({**defaults, **fields})
    tenant = Tenant.objects.create(**fields)
    if owner_email:
        invite(principal, tenant=tenant, email=owner_email, role=Role.OWNER)
    audit.record(principal, "tenant.create", f"tenant:{tenant.slug}", tenant, owner_email=owner_email)
    log.info("tenant created", extra={"tenant": tenant.slug})
    return tenant


@transaction.atomic
def update_tenant(principal: Principal, tenant: Tenant, **fields) -> Tenant:
    """Tenant owners/admins edit the profile; only operators change quotas and limits."""
    if not fields:
        return tenant
    quota = set(fields) & TENANT_QUOTA_FIELDS
    _require(principal, "operate" if quota else "manage_tenant", tenant.pk)
    unknown = set(fields) - TENANT_PROFILE_FIELDS - TENANT_QUOTA_FIELDS
    if unknown:
        raise ServiceError(f"cannot be changed here: {', '.join(sorted(unknown))}")
    _sso_domain(fields, tenant.pk)
    _billing_details(fields, tenant)
    merged = {name: getattr(tenant, name) for name in TENANT_QUOTA_FIELDS} | fields
    _check_quota_values(merged)
    if "currency" in fields and fields["currency"] != tenant.currency:
        from marketplace.services import billing

        # The open period (and any period used but not yet invoiced) keeps the old currency.
        billing.ensure_invoices(tenant=tenant)
        billing.draft_for(tenant, billing.month_of(timezone.now()))
    for name, value in fields.items():
        setattr(tenant, name, value)
    tenant.save(update_fields=list(fields))
    clamped = _clamp_keys(tenant, fields)
    audit.record(principal, "tenant.update", f"tenant:{tenant.slug}", tenant, fields=fields,
                 **({"keys_clamped": clamped} if clamped else {}))
    return tenant


@transaction.atomic
def suspend_tenant(principal: Principal, tenant: Tenant, reason: str = "") -> Tenant:
    _require(principal, "operate", tenant.pk)
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    if tenant.status == Tenant.Status.SUSPENDED:
        raise Conflict("tenant is already suspended", field="status")
    tenant.status = Tenant.Status.SUSPENDED
    tenant.suspended_at = timezone.now()
    tenant.suspended_reason = reason
    tenant.save(update_fields=["status", "suspended_at", "suspended_reason"])
    audit.record(principal, "tenant.suspend", f"tenant:{tenant.slug}", tenant, reason=reason)
    log.info("tenant suspended", extra={"tenant": tenant.slug, "reason": reason})
    return tenant


@transaction.atomic
def activate_tenant(principal: Principal, tenant: Tenant) -> Tenant:
    _require(principal, "operate", tenant.pk)
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    if tenant.status == Tenant.Status.ACTIVE:
        raise Conflict("tenant is already active", field="status")
    tenant.status = Tenant.Status.ACTIVE
    tenant.suspended_at = None
    tenant.suspended_reason = ""
    tenant.save(update_fields=["status", "suspended_at", "suspended_reason"])
    audit.record(principal, "tenant.activate", f"tenant:{tenant.slug}", tenant)
    return tenant


# --- memberships ------------------------------------------------------------------------------

def _owners(tenant_id: int):
    return Membership.objects.select_for_update().filter(tenant_id=tenant_id, role=Role.OWNER)


def _check_role_grant(principal: Principal, tenant_id: int, role: str) -> None:
    if role not in Role.values:
        raise ServiceError(f"'{role}' is not a role", field="role")
    if role == Role.OWNER and not principal.is_operator and principal.role_in(tenant_id) != Role.OWNER:
        raise Forbidden("only an owner can grant the owner role", field="role")


@transaction.atomic
def change_role(principal: Principal, membership: Membership, role: str) -> Membership:
    _require(principal, "manage_members", membership.tenant_id)
    _check_role_grant(principal, membership.tenant_id, role)
    membership = Membership.objects.select_for_update().get(pk=membership.pk)
    if membership.role == Role.OWNER and role != Role.OWNER:
        if not principal.is_operator and principal.role_in(membership.tenant_id) != Role.OWNER:
            raise Forbidden("only an owner can change an owner's role", field="role")
        if _owners(membership.tenant_id).count() <= 1:
            raise ServiceError("a tenant must keep at least one owner", field="role")
    old_role = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    audit.record(principal, "member.role_change", f"user:{membership.user.email}", membership.tenant_id,
                 old_role=old_role, role=role)
    return membership


@transaction.atomic
def remove_member(principal: Principal, membership: Membership) -> None:
    self_removal = principal.user is not None and membership.user_id == principal.user.pk
    if not self_removal:
        _require(principal, "manage_members", membership.tenant_id)
    membership = Membership.objects.select_for_update().get(pk=membership.pk)
    if membership.role == Role.OWNER:
        if not self_removal and not principal.is_operator and principal.role_in(membership.tenant_id) != Role.OWNER:
            raise Forbidden("only an owner can remove an owner")
        if _owners(membership.tenant_id).count() <= 1:
            raise ServiceError("a tenant must keep at least one owner")
    audit.record(principal, "member.remove", f"user:{membership.user.email}", membership.tenant_id,
                 role=membership.role, self_removal=self_removal)
    membership.delete()


# --- invitations ------------------------------------------------------------------------------

def invite(principal: Principal, *, tenant: Tenant, email: str, role: str = Role.MEMBER,
           send: bool = True) -> tuple[Invitation, str]:
    """Invite someone by e-mail. Returns the invitation and the one-time token (also e-mailed)."""
    _require(principal, "manage_members", tenant.pk)
    _check_role_grant(principal, tenant.pk, role)
    email = email.strip().lower()
    if Membership.objects.filter(tenant=tenant, user__email__iexact=email).exists():
        raise Conflict("this person is already a member", field="email")
    token, token_hash = keys.new_token()
    now = timezone.now()
    try:
        with transaction.atomic():
            invitation = Invitation.objects.create(
                tenant=tenant, email=email, role=role, token_hash=token_hash,
                invited_by=principal.user, created_at=now,
                expires_at=now + timedelta(days=settings.TESSERA_INVITATION_TTL_DAYS),
            )
    except IntegrityError:
        raise Conflict("an invitation for this e-mail is already pending", field="email") from None
    audit.record(principal, "invitation.create", f"invitation:{invitation.pk}", tenant, email=email, role=role)
    if send:
        site_url = principal.site_url
        transaction.on_commit(lambda: _send_invitation(invitation, token, site_url))
    return invitation, token


DEFAULT_SITE_URL = "http://localhost:8000"


def invitation_url(token: str, site_url: str = "") -> str:
    """The absolute link in the e-mail: TESSERA_SITE_URL, else the inviting request's own address."""
    base = (settings.TESSERA_SITE_URL or site_url or DEFAULT_SITE_URL).rstrip("/")
    return base + reverse("invitation", args=[token])


def _send_invitation(invitation: Invitation, token: str, site_url: str = "") -> None:
    inviter = invitation.invited_by
    context = {
        "invitation": invitation, "tenant": invitation.tenant, "url": invitation_url(token, site_url),
        "inviter": (inviter.full_name or inviter.email) if inviter is not None else "",
        "role": invitation.get_role_display(),
    }
    send_mail(
        subject=render_to_string("invitations/email_subject.txt", context).strip(),
        message=render_to_string("invitations/email.txt", context),
        from_email=settings.DEFAULT_FROM_EMAIL,
        recipient_list=[invitation.email],
    )


def _pending_invitation(token: str) -> Invitation:
    """The invitation of `token`, locked, if it can still be accepted; else a ServiceError."""
    invitation = (
        Invitation.objects.select_for_update(of=("self",)).select_related("tenant")
        .filter(token_hash=keys.hash_key(token)).first()
    )
    if invitation is None:
        raise ServiceError("unknown invitation token", field="token")
    if invitation.status != "pending":
        raise ServiceError(f"this invitation is {invitation.status}", field="token")
    return invitation


@transaction.atomic
def accept_invitation(user: User, token: str) -> Membership:
    """The one rule for joining a tenant by invitation (the API, the web page and sign-up use it)."""
    invitation = _pending_invitation(token)
    if invitation.email.lower() != user.email.lower():
        raise ServiceError("this invitation was sent to another e-mail address", field="token")
    membership, created = join_by_invitation(invitation, user)
    if not created:
        raise Conflict("you are already a member of this tenant", field="token")
    return membership


def join_by_invitation(invitation: Invitation, user: User, **how) -> tuple[Membership, bool]:
    """`user` joins `invitation`'s tenant with its role and the invitation is spent, audited (the invitation
    locked and pending, and its address the user's: the callers' checks — a token, or single sign-on's verified
    e-mail). Returns the membership and whether it is new (an existing one keeps its role)."""
    membership, created = Membership.objects.get_or_create(
        user=user, tenant=invitation.tenant, defaults={"role": invitation.role})
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    audit.record(Principal(user=user), "invitation.accept", f"invitation:{invitation.pk}", invitation.tenant_id,
                 email=user.email, role=invitation.role, **how)
    return membership, created


@transaction.atomic
def sign_up_and_accept(token: str, *, full_name: str, password: str) -> Membership:
    """An invitee without an account: create it (for the invited e-mail, with a password that passes
    AUTH_PASSWORD_VALIDATORS) and accept the invitation, in one transaction."""
    email = _pending_invitation(token).email.lower()
    if User.objects.filter(email__iexact=email).exists():
        raise Conflict("an account with this e-mail exists: sign in to accept", field="email")
    full_name = full_name.strip()[:200]
    try:
        validate_password(password, user=User(email=email, full_name=full_name))
    except ValidationError as exc:
        raise ServiceError(" ".join(exc.messages), field="password") from None
    try:
        with transaction.atomic():  # a savepoint: the unique e-mail may be taken meanwhile
            user = User.objects.create_user(email=email, password=password, full_name=full_name)
    except IntegrityError:  # created meanwhile by a concurrent request
        raise Conflict("an account with this e-mail exists: sign in to accept", field="email") from None
    log.info("account created from an invitation", extra={"user": user.pk})
    membership = accept_invitation(user, token)
    audit.record(Principal(user=user), "user.sign_up", f"user:{email}", membership.tenant_id)
    return membership


@transaction.atomic
def revoke_invitation(principal: Principal, invitation: Invitation) -> Invitation:
    _require(principal, "manage_members", invitation.tenant_id)
    invitation = Invitation.objects.select_for_update().get(pk=invitation.pk)
    if invitation.status != "pending":
        raise Conflict(f"this invitation is {invitation.status}")
    invitation.revoked_at = timezone.now()
    invitation.save(update_fields=["revoked_at"])
    audit.record(principal, "invitation.revoke", f"invitation:{invitation.pk}", invitation.tenant_id,
                 email=invitation.email)
    return invitation


# --- API keys ---------------------------------------------------------------------------------

def key_limit_ceiling(tenant: Tenant, limit: str) -> int:
    """The most `limit` (requests_per_minute or tokens_per_minute) a tenant's admins may give one of its keys: the
    tenant's ceiling, else the installation's default (what a key without its own value gets)."""
    ceiling, default = KEY_LIMITS[limit]
    value = getattr(tenant, ceiling)
    return int(value if value is not None else getattr(settings, default))


def _key_limits(principal: Principal, tenant: Tenant | None, limits: dict) -> dict:
    """The gateway limits to store on a key of `tenant` (the rule, in one place): whole numbers of at least 1, or
    None for the installation's default. An operator may give any value; a tenant's admin at most the tenant's
    ceiling, and a key it leaves empty gets the ceiling itself when that is below the default (so no key of the
    tenant exceeds its ceiling, whoever made it)."""
    out = {}
    for attr, value in limits.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ServiceError("must be a whole number of at least 1 (empty: the gateway's default)", field=attr)
        if tenant is not None and not principal.is_operator:
            ceiling, default = key_limit_ceiling(tenant, attr), getattr(settings, KEY_LIMITS[attr][1])
            if value is not None and value > ceiling:
                raise ServiceError(f"at most {ceiling:,} (the ceiling your provider set for this tenant's keys)",
                                   field=attr)
            if value is None and ceiling < default:
                value = ceiling
        out[attr] = value
    return out


def _clamp_keys(tenant: Tenant, fields: dict) -> int:
    """After an operator sets a tenant's key ceilings: its live keys above a ceiling (or without a value while the
    ceiling is below the default) are lowered to it. Returns how many key limits changed."""
    changed = 0
    for attr, (ceiling, default) in KEY_LIMITS.items():
        if ceiling not in fields or fields[ceiling] is None:
            continue
        value = fields[ceiling]
        over = Q(**{f"{attr}__gt": value})
        if value < getattr(settings, default):
            over |= Q(**{f"{attr}__isnull": True})
        changed += ApiKey.objects.filter(over, tenant=tenant, revoked_at__isnull=True).update(**{attr: value})
    return changed


#: what a key's owner may change on it besides its rate limits: its own monthly token allowance (a budget the
#: tenant sets itself, so no ceiling of the MSP's: it only ever refuses more)
KEY_ALLOWANCE = "monthly_token_allowance"


def _allowance(value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ServiceError("must be a whole number of tokens, at least 1 (empty: no allowance)", field=KEY_ALLOWANCE)
    return value


@transaction.atomic
def update_api_key_limits(principal: Principal, key: ApiKey, **limits) -> ApiKey:
    """Set a key's gateway limits (requests_per_minute, tokens_per_minute; None: the installation's default) within
    the tenant's ceiling (`_key_limits`), and its monthly_token_allowance (None: none). The gateway applies them at
    its next snapshot refresh."""
    if principal.api_key is not None:
        raise Forbidden("API keys cannot change API keys; sign in as a user")
    _require(principal, "operate" if key.tenant_id is None else "manage_keys", key.tenant_id)
    unknown = set(limits) - set(KEY_LIMITS) - {KEY_ALLOWANCE}
    if unknown:
        raise ServiceError(f"cannot be changed here: {', '.join(sorted(unknown))}")
    allowance = {KEY_ALLOWANCE: _allowance(limits.pop(KEY_ALLOWANCE))} if KEY_ALLOWANCE in limits else {}
    key = ApiKey.objects.select_for_update(of=("self",)).select_related("tenant").get(pk=key.pk)
    if key.revoked_at is not None:
        raise Conflict("this key is revoked")
    values = {**_key_limits(principal, key.tenant, limits), **allowance}
    if not values:
        return key
    for attr, value in values.items():
        setattr(key, attr, value)
    key.save(update_fields=list(values))
    audit.record(principal, "api_key.limits", f"key:{key.prefix}", key.tenant_id, **values)
    return key


@transaction.atomic
def create_api_key(principal: Principal, *, tenant: Tenant | None, name: str, scopes: list[str],
                   expires_at=None, requests_per_minute: int | None = None,
                   tokens_per_minute: int | None = None,
                   monthly_token_allowance: int | None = None) -> tuple[ApiKey, str]:
    """Create a key; returns (key, secret). The secret is not stored and cannot be shown again.
    tenant=None makes an MSP operator key (operators only)."""
    if principal.api_key is not None:
        raise Forbidden("API keys cannot create API keys; sign in as a user")
    _require(principal, "operate" if tenant is None else "manage_keys", tenant.pk if tenant else None)
    scopes = sorted(set(scopes))
    bad = [s for s in scopes if s not in Scope.values]
    if not scopes:
        raise ServiceError("name at least one scope", field="scopes")
    if bad:
        raise ServiceError(f"unknown scopes: {', '.join(bad)}", field="scopes")
    operator_only = sorted(set(scopes) & OPERATOR_ONLY_SCOPES)
    if tenant is not None and operator_only:
        raise ServiceError(f"{', '.join(operator_only)} is for operator keys only: Tessera meters what its inference "
                           f"gateway serves, so tenants do not report usage", field="scopes")
    limits = _key_limits(principal, tenant, {"requests_per_minute": requests_per_minute,
                                             "tokens_per_minute": tokens_per_minute})
    limits[KEY_ALLOWANCE] = _allowance(monthly_token_allowance)
    if expires_at is not None and expires_at <= timezone.now():
        raise ServiceError("must be in the future", field="expires_at")
    if not name.strip():
        raise ServiceError("may not be blank", field="name")
    secret, prefix, hashed = keys.generate()
    key = ApiKey.objects.create(
        tenant=tenant, name=name.strip(), prefix=prefix, hashed_key=hashed, scopes=scopes,
        created_by=principal.user, expires_at=expires_at, **limits,
    )
    audit.record(principal, "api_key.create", f"key:{prefix}", tenant, name=key.name, scopes=scopes)
    log.info("api key created", extra={"prefix": prefix, "tenant": tenant.slug if tenant else None})
    return key, secret


@transaction.atomic
def revoke_api_key(principal: Principal, key: ApiKey) -> ApiKey:
    if principal.api_key is not None:
        raise Forbidden("API keys cannot revoke API keys; sign in as a user")
    _require(principal, "operate" if key.tenant_id is None else "manage_keys", key.tenant_id)
    key = ApiKey.objects.select_for_update().get(pk=key.pk)
    if key.revoked_at is not None:
        raise Conflict("this key is already revoked")
    key.revoked_at = timezone.now()
    key.revoked_by = principal.user
    key.save(update_fields=["revoked_at", "revoked_by"])
    audit.record(principal, "api_key.revoke", f"key:{key.prefix}", key.tenant_id, name=key.name)
    log.info("api key revoked", extra={"prefix": key.prefix})
    return key


def create_operator(email: str, password: str, *, full_name: str = "") -> User:
    """An MSP operator from the command line (`manage.py create_operator`): the first one of an installation, or
    another without the admin. Staff holding tenants.operate, not a superuser (the console and the API need nothing
    more). The password must pass the installation's validators; an existing user is refused (nothing changes)."""
    from django.contrib.auth.models import Permission

    email = User.objects.normalize_email(email.strip()).lower()
    if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", email):
        raise ServiceError("is not an e-mail address", field="email")
    try:
        validate_password(password, User(email=email, full_name=full_name))
    except ValidationError as exc:
        raise ServiceError(" ".join(exc.messages), field="password") from None
    with transaction.atomic():
        if User.objects.filter(email__iexact=email).exists():
            raise Conflict(f"a user {email} exists already", field="email")
        user = User.objects.create_user(email=email, password=password, full_name=full_name, is_staff=True)
        user.user_permissions.add(Permission.objects.get(content_type__app_label="tenants", codename="operate"))
        audit.record("system:create_operator", "operator.create", f"user:{email}")
    log.info("operator created", extra={"email": email})
    return user
