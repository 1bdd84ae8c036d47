"""Issue 35, item 3: the Grafana dashboards shipped in docker/grafana (fleet, serving, billing), provisioned by the
compose file's monitoring profile: each against a JSON schema of what Grafana reads, every query naming only series
Tessera's /metrics exports (and Prometheus's own `up`), and, with promtool, every query valid PromQL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from telemetry import metrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
DATASOURCE_UID = "tessera-prometheus"
PROMETHEUS_OWN = {"up"}

TARGET = {"type": "object", "required": ["refId", "expr", "datasource"],
          "properties": {"refId": {"type": "string", "pattern": "^[A-Z]$"}, "expr": {"type": "string", "minLength": 1},
                         "legendFormat": {"type": "string"},
                         "datasource": {"const": {"type": "prometheus", "uid": DATASOURCE_UID}}}}
PANEL = {"type": "object", "required": ["id", "type", "title", "datasource", "gridPos", "targets"],
         "properties": {
             "id": {"type": "integer", "minimum": 1},
             "type": {"enum": ["timeseries", "stat", "gauge", "table", "bargauge"]},
             "title": {"type": "string", "minLength": 1},
             "datasource": {"const": {"type": "prometheus", "uid": DATASOURCE_UID}},
             "gridPos": {"type": "object", "required": ["x", "y", "w", "h"],
                         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 23},
                                        "y": {"type": "integer", "minimum": 0},
                                        "w": {"type": "integer", "minimum": 1, "maximum": 24},
                                        "h": {"type": "integer", "minimum": 1}}},
             "fieldConfig": {"type": "object", "required": ["defaults"]},
             "targets": {"type": "array", "minItems": 1, "items": TARGET}}}
DASHBOARD = {"type": "object", "required": ["uid", "title", "panels", "schemaVersion", "templating", "time"],
             "properties": {"uid": {"type": "string", "pattern": "^tessera-[a-z]+$"},
                            "title": {"type": "string"}, "schemaVersion": {"type": "integer", "minimum": 30},
                            "panels": {"type": "array", "minItems": 1, "items": PANEL},
                            "templating": {"type": "object", "required": ["list"]}}}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _queries(d: dict) -> list[str]:
    return ([t["expr"] for p in d["panels"] for t in p["targets"]]
            + [v["query"] for v in d["templating"]["list"] if v.get("type") == "query"])


def test_the_three_dashboards_are_shipped_and_valid():
    assert [p.name for p in DASHBOARDS] == ["tessera-billing.json", "tessera-fleet.json", "tessera-serving.json"]
    for path in DASHBOARDS:
        d = _load(path)
        jsonschema.validate(d, DASHBOARD)
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for p in d["panels"]:
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, (path.name, p["title"])
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), (path.name, p["title"])
    assert len({_load(p)["uid"] for p in DASHBOARDS}) == len(DASHBOARDS)


def test_the_schema_catches_a_broken_panel():
    d = _load(DASHBOARDS[0])
    del d["panels"][0]["targets"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, DASHBOARD)


@pytest.mark.django_db
def test_every_query_names_only_series_tessera_exports():
    exported = set(re.findall(r"^# TYPE (\S+) ", metrics.render(), re.M))
    for required in ("tessera_gpu_activity_ratio", "tessera_slice_activity_ratio", "tessera_gpu_power_watts",
                     "tessera_model_requests_total", "tessera_model_execution_seconds_total", "tessera_tenant_spend"):
        assert required in exported
    rules = yaml.safe_load((ROOT / "docker" / "prometheus" / "tessera-alerts.yml").read_text())
    sources = {p.name: _queries(_load(p)) for p in DASHBOARDS}
    sources["tessera-alerts.yml"] = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    for name, queries in sources.items():
        for q in queries:
            series = set(re.findall(r"\b(tessera_[a-z0-9_]+)", q))
            assert series or re.fullmatch(r'up\{job="tessera"\}( == 0)?', q), (name, q)
            assert series <= exported, (name, q, series - exported)
            bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^]]*\]|\$\w+', " ", q)  # outside strings, selectors, ranges
            words = set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*(?=\{|$|\)|\s*[-+*/<>=]|\s+(?:by|or|and))", bare))
            others = {w for w in words if not w.startswith("tessera_")} - PROMETHEUS_OWN - {
                "by", "sum", "max", "rate", "increase", "scalar", "label_values", "node", "model", "gpu", "tenant",
                "status", "state", "tier", "to_state", "kind", "reason", "direction", "alertname", "humanizeDuration"}
            assert others == set(), (name, q, others)


def test_provisioning_points_grafana_at_the_dashboards_and_the_datasource_they_name():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [d["uid"] for d in ds["datasources"]] == [DATASOURCE_UID]
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tessera.yml").read_text())["providers"][0]
    grafana = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert grafana["profiles"] == ["monitoring"]


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian's prometheus package; CI installs it)")
def test_every_dashboard_query_is_valid_promql(tmp_path):
    """promtool parses each query as a recording rule (Grafana's variables replaced by a match-all)."""
    rules = [{"record": f"check:q{i}", "expr": re.sub(r"\$\w+", ".*", q)}
             for i, q in enumerate(q for p in DASHBOARDS for q in _queries(_load(p)) if not q.startswith("label_"))]
    (tmp_path / "q.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", "q.yml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.django_db
def test_the_serving_and_billing_series_carry_their_values(h100_node, tiers, django_assert_max_num_queries):
    from datetime import timedelta
    from decimal import Decimal

    from django.utils import timezone

    from telemetry.models import TritonCounter
    from telemetry.services import collector
    from tests.factories import DeploymentFactory, TenantFactory, UsageHourlyFactory

    acme = TenantFactory(slug="acme", monthly_spend_limit=Decimal("500"))
    dep = DeploymentFactory(allocation__order__tenant=acme, allocation__order__tier=tiers["1g"], name="llama")
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    UsageHourlyFactory(deployment=dep, hour=hour, input_tokens=100, output_tokens=40, requests=3)
    UsageHourlyFactory(deployment=dep, hour=hour - timedelta(hours=1), input_tokens=1, output_tokens=2, requests=1)
    TritonCounter.objects.create(deployment=dep, inference_count=4, fail_count=1, execution_ns=2_500_000_000)
    collector.collect_node(h100_node.pk)
    with django_assert_max_num_queries(25):
        text = metrics.render()
    for line in ('tessera_model_requests_total{tenant="acme",model="llama"} 4',
                 'tessera_model_tokens_total{tenant="acme",model="llama",direction="input"} 101',
                 'tessera_model_tokens_total{tenant="acme",model="llama",direction="output"} 42',
                 'tessera_model_inferences_total{tenant="acme",model="llama"} 4',
                 'tessera_model_inference_failures_total{tenant="acme",model="llama"} 1',
                 'tessera_model_execution_seconds_total{tenant="acme",model="llama"} 2.5',
                 'tessera_tenant_spend{tenant="acme",currency="USD"} 0',
                 'tessera_tenant_spend_limit{tenant="acme",currency="USD"} 500',
                 "tessera_energy_price_per_kwh 0.12"):
        assert line in text, line
    assert re.search(r'tessera_gpu_activity_ratio\{node="node-a",gpu="0",', text)
