"""The operators' alarm set, read in one place: what the console's overview shows (unresolved drift, failed
slices, billing alerts, tenants at their spend warning), plus nodes whose heartbeat stopped and webhooks that
are failing. `/metrics` exports it (`tessera_alarm`), the Prometheus rules in docker/prometheus/ alert on it,
and services.alerting sends it to Alertmanager (or mails it). A fixed number of queries, whatever the fleet.

Labels are bounded: alertname and severity (from the table below), and node (hostname) or tenant (slug) where
the alarm is about one; never an allocation, a message or a time."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q

from marketplace.models import Allocation, BillingAlert, DriftEvent, Node, WebhookDelivery
from marketplace.services.billing import spend as spend_rule
from marketplace.services.billing.units import month_of
from tenants.models import Tenant

#: alertname -> (severity, what it means): the README's runbook has a section per name.
ALERTS: dict[str, tuple[str, str]] = {
    "TesseraDriftUnrepaired": ("critical", "reconcile found drift on the node it could not repair"),
    "TesseraMeteringMismatch": ("warning", "metered requests differ from what Triton served on the node"),
    "TesseraSandboxLimit": ("warning", "a model was stopped at its sandbox's limit on the node"),
    "TesseraSliceFailed": ("warning", "the tenant has slices (allocations) that failed to provision"),
    "TesseraUnpricedUsage": ("warning", "the tenant has usage with no price in its invoice's currency"),
    "TesseraBillingFailed": ("critical", "rating or finalizing the tenant's invoice failed"),
    "TesseraUsageRefused": ("warning", "usage events claiming the tenant were refused (unsigned or forged)"),
    "TesseraSpendWarning": ("info", "the tenant is at its spend warning ratio"),
    "TesseraSpendLimitReached": ("warning", "the tenant reached its spend limit: new orders and inference blocked"),
    "TesseraNodeHeartbeatStale": ("critical", "the node's heartbeat stopped (reconcile cannot reach it)"),
    "TesseraWebhookFailing": ("warning", "webhook deliveries to the tenant's endpoints are failing"),
}

#: drift kinds with an alert of their own; every other unresolved kind is TesseraDriftUnrepaired
DRIFT_ALERTS: dict[str, str] = {DriftEvent.Kind.METERING_MISMATCH: "TesseraMeteringMismatch",
                DriftEvent.Kind.SANDBOX_LIMIT: "TesseraSandboxLimit"}
BILLING_ALERTS: dict[str, str] = {BillingAlert.Kind.UNPRICED: "TesseraUnpricedUsage",
                  BillingAlert.Kind.RATING_FAILED: "TesseraBillingFailed",
                  BillingAlert.Kind.FINALIZE_FAILED: "TesseraBillingFailed",
                  BillingAlert.Kind.REFUSED_USAGE: "TesseraUsageRefused"}
#: what a spend alarm reads of billing.spend.figures' row
SPEND_ROW = ("slug", "is_blocked")
#: nodes expected to answer reconcile (offline and maintenance nodes are not)
LIVE_NODE_STATES = (Node.State.READY, Node.State.DRAINING)
#: a pending delivery retried this many times counts as failing (it ends `failed` after TESSERA_WEBHOOK_MAX_ATTEMPTS)
WEBHOOK_FAILING_ATTEMPTS = 3
#: a delivery that gave up keeps its endpoint's alarm this long after it was created
WEBHOOK_FAILED_WITHIN = timedelta(hours=24)
#: the tenant label of the MSP's own webhook endpoints (no tenant)
MSP = "_msp"


@dataclass(frozen=True)
class Alarm:
    alertname: str
    node: str = ""
    tenant: str = ""
    count: int = 1
    detail: str = field(default="", compare=False)

    @property
    def severity(self) -> str:
        return ALERTS[self.alertname][0]

    @property
    def labels(self) -> dict[str, str]:
        """Alertmanager's identity of the alarm (a Prometheus rule over `tessera_alarm` gives the same)."""
        out = {"alertname": self.alertname, "severity": self.severity}
        if self.node:
            out["node"] = self.node
        if self.tenant:
            out["tenant"] = self.tenant
        return out

    @property
    def key(self) -> str:
        return f"{self.alertname}|{self.node}|{self.tenant}"

    @property
    def summary(self) -> str:
        about = f"node {self.node}" if self.node else f"tenant {self.tenant}" if self.tenant else "Tessera"
        return f"{about}: {ALERTS[self.alertname][1]} ({self.count})"


def stale_heartbeat_q(now: datetime) -> Q:
    """Live nodes whose last heartbeat (or, never seen, registration) is older than TESSERA_NODE_HEARTBEAT_STALE_S."""
    cutoff = now - timedelta(seconds=settings.TESSERA_NODE_HEARTBEAT_STALE_S)
    return Q(state__in=LIVE_NODE_STATES) & (Q(last_heartbeat__lt=cutoff)
                                            | Q(last_heartbeat__isnull=True, created_at__lt=cutoff))


def current(now: datetime) -> list[Alarm]:
    """Every alarm firing now, in a stable order (alertname, node, tenant). Six queries."""
    out: list[Alarm] = []
    drift: dict[tuple[str, str], int] = {}
    for r in (DriftEvent.objects.filter(resolved=False).values("node__hostname", "kind")
              .annotate(n=Count("id")).order_by()):
        name = DRIFT_ALERTS.get(r["kind"], "TesseraDriftUnrepaired")
        drift[name, r["node__hostname"]] = drift.get((name, r["node__hostname"]), 0) + r["n"]
    out += [Alarm(name, node=node, count=n) for (name, node), n in drift.items()]

    out += [Alarm("TesseraSliceFailed", tenant=r["tenant__slug"], count=r["n"])
            for r in (Allocation.objects.filter(state=Allocation.State.FAILED).values("tenant__slug")
                      .annotate(n=Count("id")).order_by())]

    billing: dict[tuple[str, str], int] = {}
    for b in (BillingAlert.objects.filter(resolved_at__isnull=True).values("tenant__slug", "kind")
              .annotate(n=Count("id")).order_by()):
        name = BILLING_ALERTS.get(b["kind"], "TesseraBillingFailed")
        billing[name, b["tenant__slug"]] = billing.get((name, b["tenant__slug"]), 0) + b["n"]
    out += [Alarm(name, tenant=t, count=n) for (name, t), n in billing.items()]

    for s in spend_rule.figures(Tenant.objects.all(), month_of(now), warn=True).values(*SPEND_ROW):
        out.append(Alarm("TesseraSpendLimitReached" if s["is_blocked"] else "TesseraSpendWarning", tenant=s["slug"]))

    out += [Alarm("TesseraNodeHeartbeatStale", node=h)
            for h in Node.objects.filter(stale_heartbeat_q(now)).values_list("hostname", flat=True)]

    failing = (Q(status=WebhookDelivery.Status.FAILED, created_at__gte=now - WEBHOOK_FAILED_WITHIN)
               | Q(status=WebhookDelivery.Status.PENDING, attempts__gte=WEBHOOK_FAILING_ATTEMPTS))
    out += [Alarm("TesseraWebhookFailing", tenant=r["endpoint__tenant__slug"] or MSP, count=r["n"])
            for r in (WebhookDelivery.objects.filter(failing).values("endpoint__tenant__slug")
                      .annotate(n=Count("id")).order_by())]
    return sorted(out, key=lambda a: (a.alertname, a.node, a.tenant))


def heartbeat_ages(now: datetime) -> list[tuple[str, float]]:
    """(hostname, seconds since its last heartbeat, or since registration when never seen) of the live nodes."""
    rows = Node.objects.filter(state__in=LIVE_NODE_STATES).values_list("hostname", "last_heartbeat", "created_at")
    return [(h, max(0.0, (now - (hb or created)).total_seconds())) for h, hb, created in rows.order_by("hostname")]
