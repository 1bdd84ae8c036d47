"""The gateway's tables: keys, tenants and routes, loaded from the database by a background refresh.

The hot path never queries the database: it looks callers and models up in the ``Tables`` of this process,
which ``refresh()`` replaces every ``TESSERA_GATEWAY_REFRESH_S`` seconds (default 2) with a new snapshot. The
``Loader`` keeps what it read: each refresh asks the database for per-bucket fingerprints of the four queries
(keys, tenants with their spend figure, ready deployments with their servers, their LoRA adapters) and re-reads
only the buckets that changed (see ``_Rows``), so an unchanged world builds nothing and a revoked key re-reads a
handful of rows. A revoked key, a suspended tenant, a spend block or a model that became ready or was removed is
therefore seen within that interval (plus the refresh's own time), whoever wrote it and however. The
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.core import signing
from django.db.models import F, Func, QuerySet, TextField, Value
from django.db.models.functions import MD5, Cast, Coalesce
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
    allowance: int | None = None  # tokens per calendar month (UTC); None: none


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
    spent_keys: frozenset[str] = frozenset()  # keys whose monthly token allowance is used up (`allowances_used`)
    loaded_at: float = 0.0


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def _epoch(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


#: rows per fingerprint bucket, about: a change re-reads its bucket (pk % buckets), so ~this many rows
BUCKET_ROWS = 8
MAX_BUCKETS = 4096


class _Join(Func):
    """Text arguments joined, flat (Django's Concat nests a pair per argument: too deep for SQLite's parser)."""

    function = "CONCAT"
    output_field = TextField()

    def as_sqlite(self, compiler, connection, **extra_context):
        return self.as_sql(compiler, connection, template="(%(expressions)s)", arg_joiner=" || ", **extra_context)


def _fingerprint(fields: tuple[str, ...]) -> MD5:
    """SQL: the MD5 of a row's ``fields`` as text (NULL distinct from any value): what the gateway compares."""
    parts: list[Any] = []
    for f in fields:
        parts += [Coalesce(Cast(F(f), TextField()), Value("\x01"), output_field=TextField()),
                  Value("\x02", output_field=TextField())]
    return MD5(_Join(*parts))


class _Rows:
    """One query's rows as the gateway last read them, kept between refreshes and re-read only where they changed.

    Rows are bucketed by ``pk % buckets``; each refresh asks the database for one fingerprint per bucket (the MD5 of
    its rows' fingerprints in pk order: a few hundred short rows whatever the table's size) and re-reads only the
    buckets whose fingerprint differs from that of the rows held. The held fingerprint is computed here from the
    rows actually read, so what is held always matches it: an insert, an update by any writer (``.update()``,
    raw SQL, another process), a delete or a row leaving the query's filter (a revoked key is still a row; a
    deployment no longer ready is not) changes its bucket's fingerprint and is seen at the next refresh. Nothing
    depends on clocks, triggers or transaction order: the database compares content."""

    def __init__(self, fields: tuple[str, ...], build: Callable[[dict[str, Any]], Any]) -> None:
        self.fields, self.build = fields, build
        self.buckets = 0  # chosen at the first read, from the row count
        self.rows: dict[int, dict[int, tuple[str, Any]]] = {}  # bucket -> {pk: (row fingerprint, built value)}
        self.fps: dict[int, str] = {}  # bucket -> fingerprint of the rows held
        self.reread = 0  # rows read by the last sync (a full read: all of them)
        self._sql: tuple[int, str, Any] | None = None  # (buckets, the fingerprint query, its parameters)

    def values(self) -> list[Any]:
        return [v for pk, v in sorted((pk, v) for bucket in self.rows.values() for pk, (_fp, v) in bucket.items())]

    def sync(self, qs: QuerySet) -> bool:
        """Bring the held rows up to date with ``qs`` (the same query at every call: its SQL is kept); True when
        anything changed."""
        from django.db import connection

        held = sum(len(b) for b in self.rows.values())
        if not self.buckets or held > 4 * BUCKET_ROWS * self.buckets and self.buckets < MAX_BUCKETS:
            # first read, or the table outgrew its buckets: choose them for its size (this sync reads everything)
            self.buckets = max(1, min(MAX_BUCKETS, max(held, qs.count()) // BUCKET_ROWS))
            self.rows, self.fps = {}, {}
        qs = qs.annotate(gw_pk=F("pk"), gw_b=F("pk") % self.buckets, gw_fp=_fingerprint(self.fields))
        if self._sql is None or self._sql[0] != self.buckets:  # compiled once: the ORM's compiling cost most
            inner, params = qs.values("gw_b", "gw_pk", "gw_fp").order_by("pk").query.sql_with_params()
            agg = ("md5(string_agg(s.gw_fp, '' ORDER BY s.gw_pk))" if connection.vendor == "postgresql"
                   else "MD5(group_concat(s.gw_fp, ''))")  # SQLite: in the subquery's order (else only re-read more)
            self._sql = (self.buckets, f"SELECT s.gw_b, {agg} FROM ({inner}) s GROUP BY s.gw_b", params)
        with connection.cursor() as cur:
            cur.execute(self._sql[1], self._sql[2])
            now = dict(cur.fetchall())
        changed = [b for b in now.keys() | self.fps.keys() if now.get(b) != self.fps.get(b)]
        self.reread = 0
        if not changed:
            return False
        for b in changed:
            self.rows.pop(b, None)
            self.fps.pop(b, None)
        for row in qs.filter(gw_b__in=changed).values(*self.fields, "gw_pk", "gw_b", "gw_fp").order_by("pk"):
            self.rows.setdefault(row["gw_b"], {})[row["gw_pk"]] = (row["gw_fp"], self.build(row))
            self.reread += 1
        for b in changed:
            if b in self.rows:
                kept = self.rows[b]
                self.fps[b] = hashlib.md5("".join(kept[pk][0] for pk in sorted(kept)).encode()).hexdigest()
        return True


KEY_FIELDS = ("prefix", "hashed_key", "tenant_id", "scopes", "expires_at", "revoked_at", "requests_per_minute",
              "tokens_per_minute", "monthly_token_allowance")
ROUTE_FIELDS = ("tenant_id", "name", "spec__inputs", "spec__outputs", "spec__decoupled",
                "allocation__triton_server__pk", "allocation__triton_server__nonce",
                "allocation__triton_server__address", "allocation__triton_server__http_port")


class Loader:
    """Builds this process's snapshots, re-reading only what changed since the last one (see ``_Rows``).

    An unchanged world costs four small fingerprint queries (keys, tenants with their spend figure, ready
    deployments with their servers, their LoRA adapters) and no Python objects; a change re-reads its bucket's rows
    and rebuilds only the dictionary it belongs to. The first ``load`` reads everything."""

    def __init__(self) -> None:
        from marketplace.services.billing import spend

        self.keys = _Rows(KEY_FIELDS, self._key)
        self.tenants = _Rows((*spend.ROW, "pk", "status", "suspended_reason", "max_concurrent_requests"), self._tenant)
        self.deployments = _Rows(ROUTE_FIELDS, self._upstream)
        self.adapters = _Rows(("modeldeployment_id", "loraadapter__name"),
                              lambda r: (r["modeldeployment_id"], r["loraadapter__name"]))
        self.month: Any = None
        self.last: Snapshot | None = None
        self._lock = threading.Lock()

    def _key(self, r: dict[str, Any]) -> KeyInfo:
        rpm, tpm = r["requests_per_minute"], r["tokens_per_minute"]
        return KeyInfo(r["prefix"], r["hashed_key"], r["tenant_id"], frozenset(r["scopes"] or ()),
                       _epoch(r["expires_at"]), r["revoked_at"] is not None,
                       rpm if rpm is not None else settings.TESSERA_GATEWAY_RPM,
                       tpm if tpm is not None else settings.TESSERA_GATEWAY_TPM, r["monthly_token_allowance"])

    def _tenant(self, t: dict[str, Any]) -> TenantInfo:
        from marketplace.services.billing import spend
        from tenants.models import Tenant

        s = spend.Spend.from_row(t, self.month)
        return TenantInfo(t["pk"], t["slug"], t["status"] == Tenant.Status.ACTIVE, t["suspended_reason"], s.blocked,
                          s.message if s.blocked else "", t["max_concurrent_requests"])

    @staticmethod
    def _upstream(r: dict[str, Any]) -> Upstream:
        from marketplace.hardware.runtime import SECRET_HEADER
        from marketplace.models import TritonServer
        from marketplace.services.serving import secret_for

        server = TritonServer(pk=r["allocation__triton_server__pk"], nonce=r["allocation__triton_server__nonce"])
        io = ModelIO.from_spec({"inputs": r["spec__inputs"], "outputs": r["spec__outputs"],
                                "decoupled": r["spec__decoupled"]})
        url = f"http://{r['allocation__triton_server__address']}:{r['allocation__triton_server__http_port']}"
        return Upstream(r["gw_pk"], r["tenant_id"], r["name"], url, {SECRET_HEADER: secret_for(server)}, io)

    def load(self) -> Snapshot:
        """The current snapshot; one load at a time (refreshes run in worker threads). A load that fails part-way
        (the database away) leaves the next one to rebuild every dictionary from what is held: a group brought up
        to date before the failure is not then taken for unchanged."""
        with self._lock:
            try:
                return self._load()
            except BaseException:
                self.last = None
                raise

    def _load(self) -> Snapshot:
        from marketplace.models import Allocation, ModelDeployment, TritonServer
        from marketplace.services.billing import spend
        from marketplace.services.billing.units import month_of
        from tenants.models import ApiKey, Tenant

        month = month_of(timezone.now())
        if month != self.month:  # a new month: every tenant's figure is another invoice's
            self.month, self.tenants = month, _Rows(self.tenants.fields, self._tenant)
        keys_changed = self.keys.sync(ApiKey.objects.filter(tenant__isnull=False))
        # the spend figure and rule every reader uses (billing.spend): the month's invoice as last rated
        tenants_changed = self.tenants.sync(spend.figures(Tenant.objects.all(), month))
        ready = ModelDeployment.objects.filter(
            state=ModelDeployment.State.READY, allocation__state=Allocation.State.ACTIVE,
            allocation__triton_server__state=TritonServer.State.RUNNING)
        routes_changed = self.deployments.sync(ready)
        routes_changed |= self.adapters.sync(ModelDeployment.adapters.through.objects.filter(
            modeldeployment__in=ready.values("pk")))
        last = self.last
        snap = Snapshot(loaded_at=time.monotonic())
        snap.keys = ({k.prefix: k for k in self.keys.values()} if keys_changed or last is None else last.keys)
        snap.tenants = ({t.id: t for t in self.tenants.values()} if tenants_changed or last is None
                        else last.tenants)
        snap.routes = self._routes() if routes_changed or last is None else last.routes
        snap.spent_keys = spent_keys(snap.keys, month)
        self.last = snap
        return snap

    def _routes(self) -> dict[tuple[int, str], list[Upstream]]:
        routes: dict[tuple[int, str], list[Upstream]] = {}
        for up in self.deployments.values():  # pk order
            routes.setdefault((up.tenant_id, up.name), []).append(up)
        by_deployment = {u.deployment_id: u for ups in routes.values() for u in ups}
        for dep_id, adapter in sorted(self.adapters.values()):  # (deployment, adapter name) order
            base = by_deployment.get(dep_id)
            if base is None or (base.tenant_id, adapter) in routes and not any(
                    u.adapter for u in routes[(base.tenant_id, adapter)]):
                continue  # a deployment of that name wins
            routes.setdefault((base.tenant_id, adapter), []).append(Upstream(
                dep_id, base.tenant_id, base.name, base.base_url, base.headers, base.io, adapter=adapter))
        return routes


def spent_keys(keys: dict[str, KeyInfo], month) -> frozenset[str]:
    """The keys that have used their monthly token allowance: this month's tokens (input + output) served for each
    key with one, as the hourly rollups hold them (the usage consumer writes them as events arrive), summed by the
    database in one query over those keys only (none without an allowance). Like the spend limit, it is read at
    each refresh: requests admitted before the rollups and the next refresh see the last tokens may go past it
    (README: "Per-key token allowance")."""
    allowed = {k.prefix: k.allowance for k in keys.values() if k.allowance is not None and not k.revoked}
    if not allowed:
        return frozenset()
    from marketplace.services.billing.units import bounds
    from telemetry.selectors import key_tokens

    used = key_tokens(allowed, *bounds(month))
    return frozenset(k for k, tokens in used.items() if tokens >= allowed[k])


class Tables:
    """This process's current snapshot; ``replace`` keeps each surviving upstream's counters."""

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        self.snap = snapshot or Snapshot()
        self.used_keys: set[str] = set()
        self.ready = snapshot is not None

    def replace(self, new: Snapshot) -> None:
        if new.routes is self.snap.routes:  # unchanged routes: the same upstreams, counters and all
            self.snap, self.ready = new, True
            return
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
        if info.prefix in self.snap.spent_keys:
            raise insufficient_quota(f"This API key has used its allowance of {info.allowance:,} tokens this month "
                                     "(UTC); its tenant's admins can raise it.", "key_allowance_reached")
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
