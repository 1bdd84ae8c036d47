"""The gateway's tables: keys, tenants and routes, loaded from the database by a background refresh.

The hot path never queries the database: it looks callers and models up in the ``Tables`` of this process,
which ``refresh()`` replaces every ``TESSERA_GATEWAY_REFRESH_S`` seconds (default 2) with a new snapshot
read in five queries whatever the size of the fleet. A revoked key, a suspended tenant, a spend block or a
model that became ready or was removed is therefore seen within that interval (the README promises 5 s). The
spend block is billing.spend's figure and rule (the month's invoice as last rated, the one orders, the API, the
console and the portal read), so the gateway's view of it lags the stored figure by at most the interval;
an expiry is checked against the clock on each request. Per-upstream counters (outstanding requests, health)
live on the ``Upstream`` objects and survive a refresh.

A LoRA adapter deployed with a vLLM library model (multi-LoRA) is a model name of its own: a route
``(tenant, adapter name)`` to the base deployment's upstreams, with ``Upstream.adapter`` set. Requests to it are
sent to the base model's Triton name with the adapter selected as Triton's vLLM backend reads it (``lora_name``
in the ``sampling_parameters`` JSON, else in the request's parameters) and metered with the adapter's name. A
deployment named like an adapter of the same tenant keeps the name (the adapter is then not routed).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings
from django.core import signing
from django.utils import timezone

from .protocol import GatewayError, ModelIO, insufficient_quota

log = logging.getLogger("tessera.gateway")

INFERENCE_SCOPE = "inference"
TRY_PREFIX = "tst_"
TRY_SALT = "tessera.gateway.try-it"


@dataclass(frozen=True)
class KeyInfo:
    prefix: str
    hashed: str
    tenant_id: int
    scopes: frozenset[str]
    expires_at: float | None
    revoked: bool
    requests_per_minute: int
    tokens_per_minute: int


@dataclass(frozen=True)
class TenantInfo:
    id: int
    slug: str
    active: bool
    suspended_reason: str
    spend_blocked: bool
    spend_message: str
    max_concurrent: int


@dataclass
class Upstream:
    """One ready deployment: where its model is served and how busy it is in this process."""

    deployment_id: int
    tenant_id: int
    name: str
    base_url: str
    headers: dict[str, str]
    io: ModelIO
    adapter: str | None = None  # a LoRA adapter of the deployment: the name requests select it by
    outstanding: int = 0
    failures: int = 0
    ejected_until: float = 0.0

    @property
    def key(self) -> tuple[int, str, str | None]:
        return self.deployment_id, self.base_url, self.adapter


@dataclass(frozen=True)
class Caller:
    tenant: TenantInfo
    key_prefix: str | None  # None: a portal "try it" token
    subject: str  # who, for logs: "key:<prefix>" or "user:<id>"
    requests_per_minute: int
    tokens_per_minute: int


@dataclass
class Snapshot:
    keys: dict[str, KeyInfo] = field(default_factory=dict)
    tenants: dict[int, TenantInfo] = field(default_factory=dict)
    routes: dict[tuple[int, str], list[Upstream]] = field(default_factory=dict)
    loaded_at: float = 0.0


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def _epoch(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


def load_snapshot() -> Snapshot:
    """Read keys, tenants, routes and LoRA adapters (five queries, independent of the fleet's size)."""
    from marketplace.hardware.runtime import SECRET_HEADER  # Django must be set up first
    from marketplace.models import Allocation, ModelDeployment, TritonServer
    from marketplace.services.billing import spend
    from marketplace.services.billing.units import month_of
    from marketplace.services.serving import secret_for
    from tenants.models import ApiKey, Tenant

    snap = Snapshot(loaded_at=time.monotonic())
    rpm_default, tpm_default = settings.TESSERA_GATEWAY_RPM, settings.TESSERA_GATEWAY_TPM
    for prefix, hashed, tenant_id, scopes, expires, revoked, rpm, tpm in ApiKey.objects.filter(
            tenant__isnull=False).values_list("prefix", "hashed_key", "tenant_id", "scopes", "expires_at",
                                              "revoked_at", "requests_per_minute", "tokens_per_minute"):
        snap.keys[prefix] = KeyInfo(prefix, hashed, tenant_id, frozenset(scopes or ()), _epoch(expires),
                                    revoked is not None, rpm if rpm is not None else rpm_default,
                                    tpm if tpm is not None else tpm_default)
    # the spend figure and rule every reader uses (billing.spend): the month's invoice as last rated
    month = month_of(timezone.now())
    for t in spend.figures(Tenant.objects.all(), month).values(
            *spend.ROW, "pk", "status", "suspended_reason", "max_concurrent_requests"):
        s = spend.Spend.from_row(t, month)
        snap.tenants[t["pk"]] = TenantInfo(t["pk"], t["slug"], t["status"] == Tenant.Status.ACTIVE,
                                           t["suspended_reason"], s.blocked, s.message if s.blocked else "",
                                           t["max_concurrent_requests"])
    rows = ModelDeployment.objects.filter(
        state=ModelDeployment.State.READY, allocation__state=Allocation.State.ACTIVE,
        allocation__triton_server__state=TritonServer.State.RUNNING,
    ).order_by("pk").values("pk", "tenant_id", "name", "spec__inputs", "spec__outputs", "spec__decoupled",
                            "allocation__triton_server__pk", "allocation__triton_server__nonce",
                            "allocation__triton_server__address", "allocation__triton_server__http_port")
    for r in rows:
        server = TritonServer(pk=r["allocation__triton_server__pk"], nonce=r["allocation__triton_server__nonce"])
        io = ModelIO.from_spec({"inputs": r["spec__inputs"], "outputs": r["spec__outputs"],
                                "decoupled": r["spec__decoupled"]})
        url = f"http://{r['allocation__triton_server__address']}:{r['allocation__triton_server__http_port']}"
        snap.routes.setdefault((r["tenant_id"], r["name"]), []).append(Upstream(
            r["pk"], r["tenant_id"], r["name"], url, {SECRET_HEADER: secret_for(server)}, io))
    by_deployment = {u.deployment_id: u for ups in snap.routes.values() for u in ups}
    served = ModelDeployment.adapters.through.objects.filter(
        modeldeployment__in=rows.values("pk")).order_by("modeldeployment_id", "loraadapter__name")
    for dep_id, adapter in served.values_list("modeldeployment_id", "loraadapter__name"):
        base = by_deployment.get(dep_id)
        if base is None or (base.tenant_id, adapter) in snap.routes and not any(
                u.adapter for u in snap.routes[(base.tenant_id, adapter)]):
            continue  # a deployment of that name wins
        snap.routes.setdefault((base.tenant_id, adapter), []).append(Upstream(
            dep_id, base.tenant_id, base.name, base.base_url, base.headers, base.io, adapter=adapter))
    return snap


class Tables:
    """This process's current snapshot; ``replace`` keeps each surviving upstream's counters."""

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        self.snap = snapshot or Snapshot()
        self.used_keys: set[str] = set()
        self.ready = snapshot is not None

    def replace(self, new: Snapshot) -> None:
        old = {u.key: u for ups in self.snap.routes.values() for u in ups}
        for route, ups in new.routes.items():
            new.routes[route] = [_carry(old.get(u.key), u) for u in ups]
        self.snap = new
        self.ready = True

    # --- authentication (no database) --------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Caller:
        if not authorization:
            raise GatewayError(401, "missing_api_key", "Send your API key as 'Authorization: Bearer <key>'.",
                               kind="authentication_error", headers={"WWW-Authenticate": 'Bearer realm="inference"'})
        scheme, _, raw = authorization.partition(" ")
        raw = raw.strip()
        if scheme.lower() != "bearer" or not raw:
            raise GatewayError(401, "invalid_api_key", "The Authorization header must be 'Bearer <key>'.",
                               kind="authentication_error", headers={"WWW-Authenticate": 'Bearer realm="inference"'})
        if raw.startswith(TRY_PREFIX):
            return self._try_token(raw)
        parts = raw.split("_", 2)
        info = self.snap.keys.get(parts[1]) if len(parts) == 3 and parts[0] == "tsk" else None
        if info is None or not hmac.compare_digest(_hash(raw), info.hashed):
            raise _unauthorized("invalid_api_key", "Invalid API key.")
        if info.revoked:
            raise _unauthorized("api_key_revoked", "This API key was revoked.")
        if info.expires_at is not None and info.expires_at <= time.time():
            raise _unauthorized("api_key_expired", "This API key has expired.")
        if INFERENCE_SCOPE not in info.scopes:
            raise GatewayError(403, "insufficient_scope", "This API key lacks the 'inference' scope; create a key "
                               "with it to call models.", kind="permission_error")
        tenant = self._tenant(info.tenant_id)
        self.used_keys.add(info.prefix)
        return Caller(tenant, info.prefix, f"key:{info.prefix}", info.requests_per_minute, info.tokens_per_minute)

    def _try_token(self, raw: str) -> Caller:
        try:
            data = signing.loads(raw[len(TRY_PREFIX):], salt=TRY_SALT, max_age=settings.TESSERA_GATEWAY_TRY_TTL_S)
        except signing.SignatureExpired:
            raise _unauthorized("token_expired", "This try-it token has expired; reload the page.") from None
        except signing.BadSignature:
            raise _unauthorized("invalid_api_key", "Invalid API key.") from None
        tenant = self._tenant(int(data["t"]))
        return Caller(tenant, None, f"user:{data['u']}@{tenant.id}", settings.TESSERA_GATEWAY_RPM,
                      settings.TESSERA_GATEWAY_TPM)

    def _tenant(self, tenant_id: int) -> TenantInfo:
        tenant = self.snap.tenants.get(tenant_id)
        if tenant is None:
            raise _unauthorized("invalid_api_key", "Invalid API key.")
        if not tenant.active:
            reason = f": {tenant.suspended_reason}" if tenant.suspended_reason else ""
            raise GatewayError(403, "tenant_suspended", f"This tenant is suspended{reason}. Contact your provider.",
                               kind="permission_error")
        if tenant.spend_blocked:
            raise insufficient_quota(tenant.spend_message)
        return tenant

    def routes(self, tenant_id: int, model: str) -> list[Upstream]:
        return self.snap.routes.get((tenant_id, model), [])

    def models(self, tenant_id: int) -> list[str]:
        return sorted(name for (t, name) in self.snap.routes if t == tenant_id)


def _carry(old: Upstream | None, new: Upstream) -> Upstream:
    if old is None:
        return new
    new.outstanding, new.failures, new.ejected_until = old.outstanding, old.failures, old.ejected_until
    return new


def _unauthorized(code: str, message: str) -> GatewayError:
    return GatewayError(401, code, message, kind="authentication_error",
                        headers={"WWW-Authenticate": 'Bearer realm="inference"'})


def mint_try_token(tenant_id: int, user_id: int) -> str:
    """A short-lived token for the portal's "Try it" box (signed with SECRET_KEY; nothing stored)."""
    return TRY_PREFIX + signing.dumps({"t": tenant_id, "u": user_id}, salt=TRY_SALT, compress=False)


def mark_used(prefixes: set[str]) -> int:
    """Write ``last_used_at`` for keys the gateway saw (once per refresh, not per request)."""
    if not prefixes:
        return 0
    from tenants.models import ApiKey

    now = datetime.now(UTC)
    cutoff = now.timestamp() - settings.TESSERA_API_KEY_LAST_USED_RESOLUTION_S
    stale = ApiKey.objects.filter(prefix__in=prefixes).filter(
        last_used_at__isnull=True) | ApiKey.objects.filter(prefix__in=prefixes,
                                                           last_used_at__lt=datetime.fromtimestamp(cutoff, UTC))
    return stale.update(last_used_at=now)
