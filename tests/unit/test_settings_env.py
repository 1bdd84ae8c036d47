"""Documented environment variables are read and change behaviour (each in a fresh interpreter, since
settings are read once at start)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r"""
import json, django
django.setup()
from marketplace.models import GpuModel, MigProfile
from marketplace.selectors.catalog import modelled_tokens_per_s
from marketplace.services import netguard
from telemetry.services.energy import price_per_kwh
import ipaddress
gpu = GpuModel(key="x", name="x", bandwidth_tbps="3.35", compute_slices=7)
from django.conf import settings
from marketplace import tasks
print(json.dumps({
    "webhooks": [tasks.deliver_webhook.time_limit, settings.TESSERA_WEBHOOK_MAX_ATTEMPTS,
                 settings.TESSERA_WEBHOOK_BACKOFF_S, settings.TESSERA_WEBHOOK_MAX_ENDPOINTS,
                 settings.CELERY_BEAT_SCHEDULE["sweep-webhooks"]["schedule"]],
    "kwh": str(price_per_kwh()),
    "tps": modelled_tokens_per_s(gpu, MigProfile(compute_slices=7)),
    "loopback_refused": netguard.refusal(ipaddress.ip_address("127.0.0.1")) is not None,
}))
"""


def probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    base.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default():
    return probe()


def test_energy_price_per_kwh_is_read(default):
    assert default["kwh"] == "0.12"
    assert probe(TESSERA_ENERGY_PRICE_PER_KWH="0.50")["kwh"] == "0.50"


def test_tokens_per_s_per_tbps_is_read(default):
    assert default["tps"] == pytest.approx(3000 * 3.35)
    assert probe(TESSERA_TOKENS_PER_S_PER_TBPS="1000")["tps"] == pytest.approx(1000 * 3.35)


def test_webhook_allow_networks_is_read(default):
    assert default["loopback_refused"] is True
    assert probe(TESSERA_WEBHOOK_ALLOW_NETWORKS="127.0.0.0/8")["loopback_refused"] is False


def test_webhook_limits_are_read(default):
    assert default["webhooks"] == [40.0, 8, 5.0, 10, 60.0]
    assert probe(TESSERA_WEBHOOK_TIMEOUT_S="3", TESSERA_WEBHOOK_MAX_ATTEMPTS="2", TESSERA_WEBHOOK_BACKOFF_S="0.5",
                 TESSERA_WEBHOOK_MAX_ENDPOINTS="1", TESSERA_WEBHOOK_SWEEP_INTERVAL_S="7")["webhooks"] == [
        33.0, 2, 0.5, 1, 7.0]


# --------------------------------------------------------------------------------------------------
# Settings are read once, strictly, in one module (issue 16 point 3)
# --------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
BAD = "not-a-%value"

# Each variable in its own fresh run of the settings module, set to BAD: what it raised (None: accepted).
STRICT_PROBE = r"""
import json, os, runpy, sys
from django.core.exceptions import ImproperlyConfigured
out = {}
for name in json.loads(sys.argv[1]):
    os.environ[name] = sys.argv[2]
    try:
        runpy.run_module("marketplace.settings")
        out[name] = None
    except ImproperlyConfigured as exc:
        out[name] = str(exc)
    del os.environ[name]
print(json.dumps(out))
"""

READ_PROBE = r"""
import json, marketplace.settings as s
print(json.dumps({"read": s.ENVIRONMENT_VARIABLES, "secret_key": s.SECRET_KEY}))
"""

# Free text, URLs, paths and lists: any value is taken as it is (the rest must refuse a value that does not parse).
FREE_TEXT = {
    "PGOPTIONS", "REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "SECRET_KEY", "ALLOWED_HOSTS",
    "CSRF_TRUSTED_ORIGINS",
    "TESSERA_VAR_DIR", "EMAIL_BACKEND", "DEFAULT_FROM_EMAIL", "TESSERA_NODE_HOSTNAME", "TESSERA_SIM_DIR",
    "TESSERA_NVML_SIM_FLEET", "TESSERA_NVML_SIM_STATE", "TESSERA_NVML_SIM_NODE", "TESSERA_TRITONSERVER",
    "TESSERA_TRITON_PYTHON", "TESSERA_TRITON_REPO_ROOT", "TESSERA_SERVING_RUNTIME_DIR", "TESSERA_TRITON_IMAGE",
    "TESSERA_GATEWAY_URL", "TESSERA_GATEWAY_INTERNAL_URL", "TESSERA_USAGE_STREAM", "TESSERA_USAGE_SPOOL_DIR",
    "TESSERA_UPLOAD_ROOT", "TESSERA_MODEL_STORE_ROOT", "TESSERA_MODEL_STORE_S3_ENDPOINT",
    "TESSERA_MODEL_STORE_S3_BUCKET", "TESSERA_MODEL_STORE_S3_PREFIX", "TESSERA_MODEL_STORE_S3_REGION",
    "TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID", "TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY", "TESSERA_API_RATE",
    "TESSERA_USAGE_INGEST_RATE", "TESSERA_ANON_RATE", "TESSERA_WEBHOOK_ALLOW_NETWORKS", "TESSERA_METRICS_TOKEN",
    "TESSERA_OIDC_CLIENT_ID", "TESSERA_OIDC_CLIENT_SECRET", "TESSERA_OIDC_AUTHORIZATION_ENDPOINT",
    "TESSERA_OIDC_TOKEN_ENDPOINT", "TESSERA_OIDC_USERINFO_ENDPOINT", "TESSERA_OIDC_JWKS_ENDPOINT",
    "TESSERA_OIDC_END_SESSION_ENDPOINT", "TESSERA_OIDC_GROUPS_CLAIM", "TESSERA_OIDC_OPERATOR_GROUP",
    "TESSERA_OIDC_PROVIDER_NAME", "TESSERA_OIDC_SCOPES", "TESSERA_MSP_NAME", "TESSERA_MSP_ADDRESS",
    "TESSERA_MSP_TAX_IDS",
}


# Refused when too short, with an error that names the variable and the length but not the value.
SECRETS = {"TESSERA_USAGE_SIGNING_KEY", "TESSERA_USAGE_SIGNING_KEY_PREVIOUS"}


def readme_variables() -> list[str]:
    """The first column of the README's "Configuration (environment)" table (several names may share a row)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration (environment)", 1)[1].split("\n## ", 1)[0]
    names: list[str] = []
    for line in section.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2 and "`" in cells[1]:
            names += re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[1])
    return names


def clean_env(**env: str) -> dict[str, str]:
    """This interpreter's environment without any variable the settings read (the test's own settings aside)."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
    return {**keep, "DJANGO_SETTINGS_MODULE": "marketplace.settings", **env}


def run(code: str, *args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180, check=check)


@pytest.fixture(scope="module")
def documented() -> list[str]:
    names = readme_variables()
    assert len(names) > 60 and "DATABASE_URL" in names and "TESSERA_METRICS_TOKEN" in names
    return names


def test_every_variable_in_the_readme_table_is_read_by_settings_and_every_one_read_is_there(documented, tmp_path):
    out = run(READ_PROBE, env=clean_env(TESSERA_VAR_DIR=str(tmp_path / "var")))
    read = json.loads(out.stdout.strip().splitlines()[-1])["read"]
    assert len(read) == len(set(read)), "a variable is read twice"
    assert set(documented) - set(read) == set(), "documented in the README but never read by marketplace.settings"
    assert set(read) - set(documented) == set(), "read by marketplace.settings but missing from the README's table"


def test_every_typed_variable_refuses_a_value_that_does_not_parse_naming_it(documented, tmp_path):
    out = run(STRICT_PROBE, json.dumps(documented), BAD, env=clean_env(TESSERA_VAR_DIR=str(tmp_path / "var")))
    raised = json.loads(out.stdout.strip().splitlines()[-1])
    accepted = {name for name, error in raised.items() if error is None}
    assert accepted == FREE_TEXT & set(documented)
    for name, error in raised.items():
        if error is not None:
            assert error.startswith(name), error
            assert (BAD not in error) if name in SECRETS else (BAD in error), error  # a secret is never echoed
    assert len(raised) - len(accepted) > 35  # numbers, booleans, choices and DATABASE_URL


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("TESSERA_GATEWAY_RPM", "12x", "TESSERA_GATEWAY_RPM='12x': expected an integer"),
    ("TESSERA_GATEWAY_RPM", "-5", "TESSERA_GATEWAY_RPM='-5': expected an integer >= 0"),
    ("TESSERA_METERING_TOLERANCE", "nan", "TESSERA_METERING_TOLERANCE='nan': expected a number"),
    ("TESSERA_SECURE", "maybe", "TESSERA_SECURE='maybe': expected one of 1/0, true/false, yes/no, on/off"),
    ("DEBUG", "2", "DEBUG='2': expected one of 1/0"),
    ("TESSERA_NVML_BACKEND", "cuda", "TESSERA_NVML_BACKEND='cuda': expected one of sim, pynvml"),
    ("TESSERA_PLANNER_GPU_HOUR_COST", "h100-sxm-80gb", "TESSERA_PLANNER_GPU_HOUR_COST='h100-sxm-80gb': expected"),
    ("TESSERA_PLANNER_GPU_HOUR_COST", "h100-sxm-80gb=cheap", "TESSERA_PLANNER_GPU_HOUR_COST='h100-sxm-80gb=cheap'"),
    ("TESSERA_ENERGY_PRICE_PER_KWH", "0,12", "TESSERA_ENERGY_PRICE_PER_KWH='0,12': expected a decimal number"),
    ("TESSERA_USAGE_SIGNING_KEY", "short-key", "TESSERA_USAGE_SIGNING_KEY: expected at least 32 characters, got 9"),
])
def test_a_bad_value_stops_the_start_with_improperly_configured_naming_the_variable(name, value, expected, tmp_path):
    out = run("import marketplace.settings", env=clean_env(TESSERA_VAR_DIR=str(tmp_path / "var"), **{name: value}),
              check=False)
    assert out.returncode != 0
    assert f"django.core.exceptions.ImproperlyConfigured: {expected}" in out.stderr


def test_booleans_accept_only_the_documented_words_in_any_case(monkeypatch):
    from django.core.exceptions import ImproperlyConfigured

    from marketplace import settings as module

    monkeypatch.setattr(module, "ENVIRONMENT_VARIABLES", [])
    for word, value in [("1", True), ("TRUE", True), ("Yes", True), ("on", True), (" 0 ", False), ("False", False),
                        ("NO", False), ("off", False)]:
        monkeypatch.setenv("TESSERA_X", word)
        assert module.env_bool("TESSERA_X", not value) is value, word
    for unset in ("", "  "):
        monkeypatch.setenv("TESSERA_X", unset)
        assert module.env_bool("TESSERA_X", True) is True
    for word in ("2", "y", "enabled", "tru"):
        monkeypatch.setenv("TESSERA_X", word)
        with pytest.raises(ImproperlyConfigured, match=f"^TESSERA_X='{word}'"):
            module.env_bool("TESSERA_X")
    assert module.ENVIRONMENT_VARIABLES == ["TESSERA_X"] * 14


def test_importing_settings_creates_no_folder_and_writes_no_file(tmp_path):
    var = tmp_path / "var-not-there"
    env = clean_env(TESSERA_VAR_DIR=str(var))
    keys = [json.loads(run(READ_PROBE, env=env).stdout.strip().splitlines()[-1])["secret_key"] for _ in range(2)]
    assert not var.exists() and list(tmp_path.iterdir()) == []
    # the development key: the same for every process of one installation (restarts keep sessions), flagged as
    # insecure (check --deploy warns), another for another var folder
    assert keys[0] == keys[1] and keys[0].startswith("django-insecure-")
    other = json.loads(run(READ_PROBE, env=clean_env(TESSERA_VAR_DIR=str(tmp_path / "other"))).stdout
                       .strip().splitlines()[-1])["secret_key"]
    assert other != keys[0] and list(tmp_path.iterdir()) == []


def test_secret_key_comes_from_the_environment_then_an_existing_key_file_and_is_required_in_production(tmp_path):
    def key(**env: str) -> str:
        out = run(READ_PROBE, env=clean_env(TESSERA_VAR_DIR=str(tmp_path), **env))
        return json.loads(out.stdout.strip().splitlines()[-1])["secret_key"]

    refused = run("import marketplace.settings", env=clean_env(TESSERA_VAR_DIR=str(tmp_path), TESSERA_SECURE="1"),
                  check=False)
    assert refused.returncode != 0 and "ImproperlyConfigured: SECRET_KEY is required" in refused.stderr
    assert key(SECRET_KEY="from-env", TESSERA_SECURE="1") == "from-env"
    (tmp_path / "secret_key").write_text("kept-by-an-earlier-version\n")  # read, never written
    assert key() == key(TESSERA_SECURE="1") == "kept-by-an-earlier-version"
    assert key(SECRET_KEY="from-env") == "from-env"


# os.environ / os.getenv outside the settings module: allowed only to name the settings module before Django
# starts, and in the demo command to set its child processes' environment.
ENV_ATTRS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
DEMO_COMMAND = "marketplace/management/commands/demo.py"


def environment_uses(source: str, name: str) -> list[str]:
    """Where the module (``name``: its path from the repository root) reads or changes the environment."""
    tree = ast.parse(source, name)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & ENV_ATTRS:
            found.append(f"{name}:{node.lineno}: from os import ...")
        if not (isinstance(node, ast.Attribute) and node.attr in ENV_ATTRS
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            continue
        parent, grand = parents.get(node), parents.get(parents.get(node))
        if (isinstance(parent, ast.Attribute) and parent.attr == "setdefault" and isinstance(grand, ast.Call)
                and grand.args and isinstance(grand.args[0], ast.Constant)
                and grand.args[0].value == "DJANGO_SETTINGS_MODULE"):
            continue
        if (name == DEMO_COMMAND and isinstance(parent, ast.Subscript)
                and isinstance(parent.ctx, ast.Store)):
            continue
        found.append(f"{name}:{node.lineno}: os.{node.attr}")
    return sorted(found, key=lambda use: int(use.split(":")[1]))


def test_no_module_but_settings_reads_the_environment():
    settings_py = ROOT / "marketplace" / "settings.py"
    modules = [p for d in ("marketplace", "telemetry", "tenants") for p in (ROOT / d).rglob("*.py") if p != settings_py]
    assert len(modules) > 100
    uses = [use for path in modules for use in environment_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert uses == []
    assert environment_uses(settings_py.read_text(), "marketplace/settings.py")  # where they are read


SAMPLE = """import os
from os import getenv
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
os.environ.setdefault("OTHER", "x")
os.environ["A"] = "1"
x = os.getenv("B")
y = os.environ.get("C")
"""


def test_the_scan_finds_reads_and_allows_only_the_two_kinds_of_write():
    assert [u.split(": ", 1)[1] for u in environment_uses(SAMPLE, "marketplace/x.py")] == [
        "from os import ...", "os.environ", "os.environ", "os.getenv", "os.environ"]
    assert [u.split(": ", 1)[1] for u in environment_uses(SAMPLE, DEMO_COMMAND)] == [
        "from os import ...", "os.environ", "os.getenv", "os.environ"]


JIT_PROBE = """
import json
from django.conf import settings
print(json.dumps(settings.DATABASES["default"].get("OPTIONS", {})))
"""


@pytest.mark.parametrize(("env", "options"), [
    ({}, "-c jit=off"),  # the default: PostgreSQL's JIT compiling took as long as the charts' aggregates
    ({"TESSERA_DB_JIT": "1"}, None),  # the server's setting (a pooler may refuse the startup option)
    # a connection's `options` replaces libpq's PGOPTIONS: the operator's are kept (the fault tests' workers
    # rely on client_connection_check_interval given that way)
    ({"PGOPTIONS": "-c client_connection_check_interval=200"}, "-c client_connection_check_interval=200 -c jit=off"),
])
def test_postgresql_connections_turn_jit_off_unless_told(env, options, tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_") and k != "PGOPTIONS"}
    base.update(DJANGO_SETTINGS_MODULE="marketplace.settings", TESSERA_VAR_DIR=str(tmp_path),
                DATABASE_URL="postgres://tessera@db.example:5432/tessera")  # parsed only, never connected
    out = run(JIT_PROBE, env={**base, **env})
    assert json.loads(out.stdout.strip().splitlines()[-1]).get("options") == options


@pytest.mark.django_db
def test_the_connection_runs_without_jit_on_postgresql():
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's JIT setting")
    with connection.cursor() as c:
        c.execute("SHOW jit")
        assert c.fetchone()[0] == "off"
