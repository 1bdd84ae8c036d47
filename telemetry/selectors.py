"""Metering reads. Everything here reads the hourly rollups (UsageHourly, TritonServedHourly), never
the raw usage events: a tenant-month is at most (deployments x 744) rows on the (tenant, hour) index."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from django.db.models import Q, QuerySet, Sum
from django.db.models.functions import TruncDay

from marketplace.models import ModelDeployment
from telemetry.models import TritonServedHourly, UsageEvent, UsageHourly
from tenants.models import Tenant
from tenants.scoping import Principal

GROUPS = ("tenant", "deployment", "tier", "hour", "day", "key")
SUMS = ("input_tokens", "output_tokens", "requests", "events", "billed_input_tokens", "billed_output_tokens",
        "billed_requests")


def _visible(qs: QuerySet, principal: Principal, capabilities: tuple[str, ...]) -> QuerySet:
    """Rows of the tenants on which the principal has any of `capabilities` (tenant_ids decides)."""
    union: set[int] = set()
    for cap in capabilities:
        ids = principal.tenant_ids(cap)
        if ids is None:
            return qs
        union |= ids
    return qs.filter(tenant_id__in=union) if union else qs.none()


def key_tokens(prefixes, start: datetime, end: datetime) -> dict[str, int]:
    """Tokens (input + output) served for each of the API keys `prefixes` in [start, end) — for a calendar month,
    what a key's monthly token allowance is held against (the gateway's refusal, the keys pages) — summed by the
    database in one query on the (api_key, hour) index; a key without usage is absent. Not scoped: callers pass
    the keys they may see."""
    from django.db.models import F

    prefixes = [p for p in prefixes if p]
    if not prefixes:
        return {}
    return dict(UsageHourly.objects.filter(api_key__in=prefixes, hour__gte=start, hour__lt=end).values(
        "api_key").annotate(tokens=Sum(F("input_tokens") + F("output_tokens"))).values_list("api_key", "tokens"))


def usage_hours(principal: Principal) -> QuerySet:
    """UsageHourly rows the principal may see (scope/role read or billing)."""
    return _visible(UsageHourly.objects.all(), principal, ("read", "billing")).select_related(
        "tenant", "deployment")


def _tenant_q(value: Any, path: str = "tenant") -> Q:
    if isinstance(value, Tenant):
        return Q(**{f"{path}_id": value.pk})
    if isinstance(value, int):
        return Q(**{f"{path}_id": value})
    return Q(**{f"{path}__slug": value})


def _apply_filters(qs: QuerySet, filters: dict | None) -> QuerySet:
    f = filters or {}
    if f.get("tenant") is not None:
        qs = qs.filter(_tenant_q(f["tenant"]))
    if f.get("deployment") is not None:
        dep = f["deployment"]
        qs = qs.filter(deployment_id=getattr(dep, "pk", dep))
    if f.get("model") is not None:
        qs = qs.filter(deployment__name=f["model"])
    if f.get("tier") is not None:
        tier = f["tier"]
        qs = qs.filter(**({"deployment__allocation__tier__key": tier} if isinstance(tier, str)
                          else {"deployment__allocation__tier_id": getattr(tier, "pk", tier)}))
    return qs


def usage_summary(principal: Principal, start: datetime, end: datetime, group_by: str = "deployment",
                  filters: dict | None = None, *, capabilities: tuple[str, ...] = ("billing",)) -> list[dict]:
    """Usage totals (and what was billed) over hours in [start, end), grouped by tenant, deployment,
    tier, hour, day (UTC) or API key (the key the gateway served the usage for). `filters`: tenant (Tenant, id or
    slug), deployment (id), model (name), tier (id or key). Reads UsageHourly only."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}")
    qs = _visible(UsageHourly.objects.all(), principal, capabilities).filter(hour__gte=start, hour__lt=end)
    qs = _apply_filters(qs, filters)
    keys = {
        "tenant": ["tenant_id"],
        "deployment": ["tenant_id", "deployment_id"],
        "tier": ["tenant_id", "deployment__allocation__tier_id"],
        "hour": ["tenant_id", "hour"],
        "day": ["tenant_id", "day"],
        "key": ["tenant_id", "api_key"],
    }[group_by]
    if group_by == "day":
        qs = qs.annotate(day=TruncDay("hour", tzinfo=UTC))
    rows = list(qs.values(*keys).annotate(**{s: Sum(s) for s in SUMS}).order_by(*keys))
    # Names in one query each, after the aggregate (joins inside it would widen the GROUP BY).
    tenants = dict(Tenant.objects.filter(pk__in={r["tenant_id"] for r in rows}).values_list("pk", "slug"))
    deps: dict[int, Mapping[str, object]] = {}
    if group_by == "deployment":
        # Up to 100 deployments by id; beyond, the deployments of the rows' tenants (all of them when the principal
        # sees every tenant and no tenant was asked for): on the scale bench 3-5 ms where 924 deployment ids took
        # 9-14 ms (building and planning the long IN list). A row's deployment is its tenant's; one that is not is
        # read by id.
        fields = ("pk", "name", "allocation_id", "allocation__tier__key")
        ids = {r["deployment_id"] for r in rows}
        if len(ids) > 100:
            everyone = (any(principal.tenant_ids(c) is None for c in capabilities)
                        and (filters or {}).get("tenant") is None)
            dq = ModelDeployment.objects.all() if everyone else ModelDeployment.objects.filter(
                tenant_id__in={r["tenant_id"] for r in rows})
            deps = {d["pk"]: d for d in dq.values(*fields)}
        if ids - deps.keys():
            deps.update((d["pk"], d) for d in ModelDeployment.objects.filter(pk__in=ids - deps.keys()).values(*fields))
    tiers: dict[int, str] = {}
    if group_by == "tier":
        from marketplace.models import Tier

        tiers = dict(Tier.objects.filter(pk__in={r["deployment__allocation__tier_id"] for r in rows})
                     .values_list("pk", "key"))
    key_names: dict[tuple[int, str], str] = {}
    if group_by == "key":  # a key's name only where the key is the row's tenant's own
        from tenants.models import ApiKey

        key_names = {(t, prefix): name for t, prefix, name in ApiKey.objects.filter(
            prefix__in={r["api_key"] for r in rows if r["api_key"]}, tenant_id__in=tenants)
            .values_list("tenant_id", "prefix", "name")}
    out = []
    for r in rows:
        tenant_id = r.pop("tenant_id")
        row: dict[str, object] = {"tenant": tenants.get(tenant_id)}
        if group_by == "deployment":
            d = deps.get(r["deployment_id"], {})
            row.update(deployment=r.pop("deployment_id"), model=d.get("name"), allocation=d.get("allocation_id"),
                       tier=d.get("allocation__tier__key"))
        elif group_by == "tier":
            row["tier"] = tiers.get(r.pop("deployment__allocation__tier_id"))
        elif group_by == "hour":
            row["hour"] = r.pop("hour")
        elif group_by == "day":
            row["day"] = r.pop("day")
        elif group_by == "key":  # the key's prefix and name; none: usage served for no key (a portal session,
            prefix = r.pop("api_key")  # usage reported through the API)
            row.update(key=prefix or None, key_name=key_names.get((tenant_id, prefix)))
        sums = {s: int(r[s] or 0) for s in SUMS}
        row.update(sums)
        row["unbilled_input_tokens"] = sums["input_tokens"] - sums["billed_input_tokens"]
        row["unbilled_output_tokens"] = sums["output_tokens"] - sums["billed_output_tokens"]
        row["unbilled_requests"] = sums["requests"] - sums["billed_requests"]
        out.append(row)
    return out


def metered_vs_served(principal: Principal, since: datetime, until: datetime, tenant: Any = None,
                      node_id: int | None = None) -> list[dict]:
    """Per deployment over hours in [since, until): requests the tenant's gateway reported (metered,
    from UsageHourly) against requests its Triton server reported serving (from TritonServedHourly),
    and the difference (metered - served: negative = served but not metered). Operators see every
    tenant and the node each deployment runs on; a tenant principal its own, without the node."""
    metered_qs = _visible(UsageHourly.objects.all(), principal, ("read", "billing")).filter(
        hour__gte=since, hour__lt=until)
    served_qs = _visible(TritonServedHourly.objects.all(), principal, ("read", "billing")).filter(
        hour__gte=since, hour__lt=until)
    if tenant is not None:
        metered_qs = metered_qs.filter(_tenant_q(tenant))
        served_qs = served_qs.filter(_tenant_q(tenant))
    if node_id is not None:  # one node's deployments (the node's scrape compares only its own)
        metered_qs = metered_qs.filter(deployment__allocation__node_id=node_id)
        served_qs = served_qs.filter(deployment__allocation__node_id=node_id)
    metered = {r["deployment_id"]: r for r in metered_qs.values("deployment_id").annotate(
        requests=Sum("requests"), input_tokens=Sum("input_tokens"), output_tokens=Sum("output_tokens"))}
    served = {r["deployment_id"]: r for r in served_qs.values("deployment_id").annotate(
        requests=Sum("requests"), failures=Sum("failures"))}
    ids = set(metered) | set(served)
    operator = principal.is_operator  # a node's hostname is fleet-internal: tenants get None
    deps = {d["pk"]: d for d in ModelDeployment.objects.filter(pk__in=ids).values(
        "pk", "name", "state", "tenant__slug", "allocation_id", "allocation__node_id", "allocation__node__hostname")}
    rows = []
    for pk in sorted(ids):
        d: Mapping[str, object] = deps.get(pk, {})
        m = int((metered.get(pk) or {}).get("requests") or 0)
        s = int((served.get(pk) or {}).get("requests") or 0)
        rows.append({
            "deployment": pk, "model": d.get("name"), "state": d.get("state"), "tenant": d.get("tenant__slug"),
            "allocation": d.get("allocation_id"), "node": d.get("allocation__node__hostname") if operator else None,
            "node_id": d.get("allocation__node_id") if operator else None,
            "metered_requests": m, "served_requests": s, "difference": m - s,
            "served_failures": int((served.get(pk) or {}).get("failures") or 0),
            "metered_input_tokens": int((metered.get(pk) or {}).get("input_tokens") or 0),
            "metered_output_tokens": int((metered.get(pk) or {}).get("output_tokens") or 0),
        })
    return rows


def deployment_served(deployment, since) -> dict:
    """What the gateway metered for one deployment since ``since`` (one aggregate query)."""
    return UsageHourly.objects.filter(deployment=deployment, hour__gte=since).aggregate(
        requests=Sum("requests"), input_tokens=Sum("input_tokens"), output_tokens=Sum("output_tokens"))


def deployment_latency(deployment, since) -> dict | None:
    """p50 / p95 of the gateway's time per request for one deployment since ``since`` (three small queries on
    the partial index of served events), or None when nothing was served."""
    qs = UsageEvent.objects.filter(deployment=deployment, ts__gte=since, latency_ms__isnull=False)
    n = qs.count()
    if not n:
        return None
    ordered = qs.order_by("latency_ms").values_list("latency_ms", flat=True)
    return {"requests": n, "p50_ms": ordered[int(0.50 * (n - 1))], "p95_ms": ordered[int(0.95 * (n - 1))]}
