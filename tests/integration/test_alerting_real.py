"""Issue 35, with the real parts: Debian's `prometheus` and `prometheus-alertmanager` started on free loopback ports
in temporary folders; Prometheus scrapes a running Tessera (pytest-django's live server) with the shipped rules
(docker/prometheus/tessera-alerts.yml), and provoked conditions (a node's heartbeat stops, a metering mismatch, a
failed slice) reach Alertmanager and, through it, a local webhook receiver; Tessera's own `send-alerts` path
reaches the same Alertmanager, merged with the rules' alerts, and a cleared condition is resolved there.
Skipped, saying why, without the binaries (CI installs them: .ci/run)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.utils import timezone

from marketplace.models import DriftEvent, Node
from marketplace.services import alerting
from tests.alert_receiver import Receiver
from tests.factories import AllocationFactory, TenantFactory
from tests.fleet_fixtures import make_node
from tests.triton_server import free_ports

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
RULES = Path(__file__).resolve().parents[2] / "docker" / "prometheus" / "tessera-alerts.yml"
PROVOKED = {"TesseraNodeHeartbeatStale", "TesseraMeteringMismatch", "TesseraSliceFailed"}
TOKEN = "prometheus-scrape-token"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(PROMETHEUS is None or ALERTMANAGER is None,
                       reason="Debian's prometheus and prometheus-alertmanager are not installed (CI installs them)"),
]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:  # the loopback daemons this test started
        return json.loads(r.read())


def _wait(what: str, probe, timeout: float = 120.0):
    """probe()'s first true answer; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.5)


def _start(args: list[str], log: Path, ready_url: str) -> subprocess.Popen:
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"{args[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    _wait(f"{args[0]} ready", ready, timeout=60)
    return proc


@pytest.fixture
def stack(live_server, settings, tmp_path):
    """Webhook receiver <- Alertmanager <- Prometheus -> live Tessera's /metrics (1 s scrapes and evaluations)."""
    settings.TESSERA_METRICS_TOKEN = TOKEN
    am_port, prom_port = free_ports(2)
    procs: list[subprocess.Popen] = []
    with Receiver() as hook:
        (tmp_path / "am").mkdir()
        (tmp_path / "am.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "hook", "group_by": ["alertname", "node", "tenant"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": f"{hook.url}/am", "send_resolved": True}]}],
        }))
        (tmp_path / "token").write_text(TOKEN)
        (tmp_path / "prom.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "tessera", "metrics_path": "/metrics",
                                "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "token")},
                                "static_configs": [{"targets": [live_server.url.split("://", 1)[1]]}]}],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        }))
        am_url = f"http://127.0.0.1:{am_port}"
        try:
            procs.append(_start([ALERTMANAGER, f"--config.file={tmp_path / 'am.yml'}",
                                 f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
                                 "--cluster.listen-address="], tmp_path / "am.log", f"{am_url}/-/ready"))
            procs.append(_start([PROMETHEUS, f"--config.file={tmp_path / 'prom.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'prom'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                tmp_path / "prom.log", f"http://127.0.0.1:{prom_port}/-/ready"))
            yield {"hook": hook, "am": am_url, "prom": f"http://127.0.0.1:{prom_port}", "log": tmp_path}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _notified(hook: Receiver, status: str) -> set[str]:
    return {a["labels"]["alertname"] for path, body in hook.posts if path == "/am" and isinstance(body, dict)
            for a in body["alerts"] if a["status"] == status}


def test_provoked_conditions_reach_alertmanager_and_the_webhook_and_resolve(stack, h100_node, tiers, settings):
    prom, am, hook = stack["prom"], stack["am"], stack["hook"]
    _wait("Prometheus scrapes Tessera", lambda: [
        t for t in _get_json(f"{prom}/api/v1/targets")["data"]["activeTargets"] if t["health"] == "up"])

    stale = make_node("node-b")
    Node.objects.filter(pk=stale.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))  # heartbeat stopped
    DriftEvent.objects.create(node=h100_node, kind=DriftEvent.Kind.METERING_MISMATCH, resolved=False,
                              detail="metered 10 requests, Triton served 14")
    acme = TenantFactory(slug="acme")
    AllocationFactory(order__tenant=acme, order__tier=tiers["1g"], state="failed")

    # Prometheus's rules -> Alertmanager -> the webhook receiver
    hook.wait_for(lambda _: PROVOKED <= _notified(hook, "firing"), timeout=120)
    firing = {a["labels"]["alertname"]: a["labels"] for _, body in hook.posts if isinstance(body, dict)
              for a in body["alerts"]}
    assert firing["TesseraNodeHeartbeatStale"] == {"alertname": "TesseraNodeHeartbeatStale",
                                                   "severity": "critical", "node": "node-b"}
    assert firing["TesseraSliceFailed"] == {"alertname": "TesseraSliceFailed", "severity": "warning",
                                            "tenant": "acme"}

    # Tessera's own path to the same Alertmanager: the same labels, so one alert each, not two
    settings.TESSERA_ALERTMANAGER_URL = am
    assert alerting.send(timezone.now()).firing == 3
    alerts = _get_json(f"{am}/api/v2/alerts?active=true")
    names = sorted(a["labels"]["alertname"] for a in alerts)
    assert names == sorted(PROVOKED)
    assert all(a["annotations"]["runbook"] == f"README: Alerts, {a['labels']['alertname']}" for a in alerts)

    # the heartbeat resumes: Tessera resolves its alert at once, the rule's resolves at its next evaluation
    Node.objects.filter(pk=stale.pk).update(last_heartbeat=timezone.now())
    assert alerting.send(timezone.now()).resolved == 1
    hook.wait_for(lambda _: "TesseraNodeHeartbeatStale" in _notified(hook, "resolved"), timeout=120)
    _wait("Alertmanager drops the resolved alert", lambda: sorted(
        a["labels"]["alertname"] for a in _get_json(f"{am}/api/v2/alerts?active=true")) == [
        "TesseraMeteringMismatch", "TesseraSliceFailed"])
