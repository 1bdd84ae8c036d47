"""Issue 35: the operators' alarm set (selectors.alarms), its series in /metrics, the Prometheus rules shipped in
docker/prometheus/ (promtool, when installed), and services.alerting's two paths: Alertmanager's API (firing
re-sent each cycle, a cleared alarm resolved at once) and the mail/webhook fallback (once per firing/resolution)."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from django.utils import timezone

from marketplace.models import AlarmState, BillingAlert, DriftEvent, Node, WebhookDelivery, WebhookEndpoint
from marketplace.selectors import alarms
from marketplace.services import alerting
from telemetry import metrics
from tests.alert_receiver import Receiver
from tests.factories import AllocationFactory, TenantFactory
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docker" / "prometheus" / "tessera-alerts.yml"


@pytest.fixture
def fleet(h100_node, tiers):
    """node-a: unrepaired drift, a metering mismatch and a sandbox limit; node-b: heartbeat stopped an hour ago;
    tenant acme: a failed slice, unpriced usage, limit 0 (blocked), failing webhooks; tenant calm: nothing."""
    now = timezone.now()
    b = make_node("node-b")
    Node.objects.filter(pk=b.pk).update(last_heartbeat=now - timedelta(hours=1))
    make_node("node-c")  # fresh heartbeat
    Node.objects.create(hostname="node-off", platform=b.platform, queue="node.node-off", state=Node.State.OFFLINE,
                        last_heartbeat=now - timedelta(days=3))
    for kind in (DriftEvent.Kind.ERROR, DriftEvent.Kind.UNREACHABLE, DriftEvent.Kind.METERING_MISMATCH,
                 DriftEvent.Kind.SANDBOX_LIMIT):
        DriftEvent.objects.create(node=h100_node, kind=kind, detail="x", resolved=False)
    DriftEvent.objects.create(node=h100_node, kind=DriftEvent.Kind.ADOPTED, detail="repaired", resolved=True)
    acme = TenantFactory(slug="acme", monthly_spend_limit=Decimal("0"))
    TenantFactory(slug="calm")
    AllocationFactory(order__tenant=acme, order__tier=tiers["1g"], state="failed")
    AllocationFactory(order__tenant=acme, order__tier=tiers["1g"])
    BillingAlert.objects.create(tenant=acme, kind=BillingAlert.Kind.UNPRICED, message="no USD price")
    ep = WebhookEndpoint.objects.create(tenant=acme, url="https://hooks.example/a", secret="s", events=[])
    WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="invoice:1", payload={},
                                   status=WebhookDelivery.Status.FAILED, attempts=8, next_attempt_at=None)
    WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="invoice:2", payload={},
                                   status=WebhookDelivery.Status.PENDING, attempts=1)
    return {"node": h100_node, "acme": acme}


EXPECTED = {
    ("TesseraDriftUnrepaired", "node-a", "", 2), ("TesseraMeteringMismatch", "node-a", "", 1),
    ("TesseraSandboxLimit", "node-a", "", 1), ("TesseraNodeHeartbeatStale", "node-b", "", 1),
    ("TesseraSliceFailed", "", "acme", 1), ("TesseraUnpricedUsage", "", "acme", 1),
    ("TesseraSpendLimitReached", "", "acme", 1), ("TesseraWebhookFailing", "", "acme", 1),
}


def test_the_alarm_set_is_what_the_console_shows_plus_heartbeats_and_webhooks(fleet, django_assert_max_num_queries):
    with django_assert_max_num_queries(6):
        got = alarms.current(timezone.now())
    assert {(a.alertname, a.node, a.tenant, a.count) for a in got} == EXPECTED
    assert {a.alertname: a.labels for a in got}["TesseraSliceFailed"] == {
        "alertname": "TesseraSliceFailed", "severity": "warning", "tenant": "acme"}


def test_metrics_export_the_alarms_and_heartbeat_ages(fleet):
    text = metrics.render()
    assert 'tessera_alarm{alertname="TesseraDriftUnrepaired",severity="critical",node="node-a"} 2' in text
    assert 'tessera_alarm{alertname="TesseraSpendLimitReached",severity="warning",tenant="acme"} 1' in text
    ages = dict(re.findall(r'tessera_node_heartbeat_age_seconds\{node="([^"]+)"\} (\S+)', text))
    assert set(ages) == {"node-a", "node-b", "node-c"}  # the offline node is not expected to answer
    assert float(ages["node-b"]) >= 3600 > float(ages["node-c"])


def test_alertmanager_gets_every_firing_alarm_each_cycle_and_a_cleared_one_resolved(fleet, settings):
    settings.TESSERA_ALERT_INTERVAL_S = 60
    t0 = timezone.now()
    with Receiver() as am:
        settings.TESSERA_ALERTMANAGER_URL = am.url
        sent = alerting.send(t0)
        assert (sent.firing, sent.new, sent.resolved, sent.target) == (8, 8, 0, "alertmanager")
        path, body = am.posts[0]
        assert path == "/api/v2/alerts" and len(body) == 8
        hb = next(a for a in body if a["labels"]["alertname"] == "TesseraNodeHeartbeatStale")
        assert hb["labels"] == {"alertname": "TesseraNodeHeartbeatStale", "severity": "critical", "node": "node-b"}
        assert hb["endsAt"] == alerting._iso(t0 + timedelta(seconds=180))

        DriftEvent.objects.filter(kind=DriftEvent.Kind.METERING_MISMATCH).update(resolved=True)
        t1 = t0 + timedelta(minutes=1)
        assert alerting.send(t1).resolved == 1
        body = am.posts[1][1]
        mm = [a for a in body if a["labels"]["alertname"] == "TesseraMeteringMismatch"]
        assert len(body) == 8 and mm[0]["endsAt"] == alerting._iso(t1) and mm[0]["startsAt"] == alerting._iso(t0)
        alerting.send(t1 + timedelta(minutes=1))
        assert len(am.posts[2][1]) == 7  # resolved once, then no longer sent
    assert AlarmState.objects.count() == 7


def test_fallback_mails_and_posts_once_per_firing_and_once_per_resolution(fleet, settings, mailoutbox):
    settings.TESSERA_ALERTMANAGER_URL = ""
    settings.TESSERA_ALERT_EMAILS = ["noc@msp.example"]
    t0 = timezone.now()
    with Receiver() as hook:
        settings.TESSERA_ALERT_WEBHOOK_URL = hook.url + "/alerts"
        alerting.send(t0)
        alerting.send(t0 + timedelta(minutes=1))  # nothing changed: nothing sent
        assert len(hook.posts) == 1 and len(mailoutbox) == 1
        payload = hook.posts[0][1]
        assert payload["version"] == "4" and {a["status"] for a in payload["alerts"]} == {"firing"}
        assert len(payload["alerts"]) == 8
        assert "node node-b: the node's heartbeat stopped" in mailoutbox[0].body

        Node.objects.filter(hostname="node-b").update(last_heartbeat=t0)
        alerting.send(t0 + timedelta(minutes=2))
        assert len(hook.posts) == 2 and len(mailoutbox) == 2
        (resolved,) = hook.posts[1][1]["alerts"]
        assert resolved["status"] == "resolved" and resolved["labels"]["node"] == "node-b"
        assert mailoutbox[1].subject == "[Tessera] 0 alarm(s) firing, 1 resolved"


def test_a_failed_send_remembers_nothing_so_the_next_cycle_sends_again(fleet, settings):
    with Receiver() as gone:
        url = gone.url
    settings.TESSERA_ALERTMANAGER_URL = url  # nothing listens there now
    with pytest.raises(OSError):
        alerting.send(timezone.now())
    assert AlarmState.objects.count() == 0


def test_nowhere_configured_sends_nothing_and_keeps_no_state(fleet, settings, mailoutbox):
    settings.TESSERA_ALERTMANAGER_URL = settings.TESSERA_ALERT_WEBHOOK_URL = ""
    settings.TESSERA_ALERT_EMAILS = []
    assert alerting.send(timezone.now()).target == ""
    assert AlarmState.objects.count() == 0 and mailoutbox == []


def _rules() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def test_every_alarm_has_a_rule_with_its_severity_and_every_rule_a_runbook():
    rules = _rules()
    assert {n: r["labels"]["severity"] for n, r in rules.items() if n in alarms.ALERTS} == {
        n: sev for n, (sev, _) in alarms.ALERTS.items()}
    readme = (ROOT / "README.md").read_text()
    assert [n for n in rules if f"#### `{n}`" not in readme] == []
    for name, rule in rules.items():  # bounded labels: only the alarm's node or tenant survive the aggregation
        if "tessera_alarm" in rule["expr"]:
            assert re.fullmatch(rf'max by \((node|tenant)\) \(tessera_alarm\{{alertname="{name}"\}}\) > 0',
                                rule["expr"])


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian's prometheus package; CI installs it)")
def test_promtool_checks_and_unit_tests_the_rules():
    for args in (["check", "rules", RULES.name], ["test", "rules", "tessera-alerts.test.yml"]):
        r = subprocess.run([PROMTOOL, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
