"""docker/compose.yaml and docker/Dockerfile, checked without a Docker engine (this machine has the docker
CLI but no compose plugin and no daemon): the compose file against the Compose Specification JSON schema
(docker/compose-spec.schema.json, from the docker-compose 1.29.2 wheel), then its structure against the
code: services, one queue per node worker, commands as in the README, environment variables the code reads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
APP_DIRS = ("marketplace", "tenants", "telemetry")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def tessera_services(services) -> dict:
    return {k: s for k, s in services.items() if s.get("image") == "tessera:latest"}


def node_workers(services) -> dict:
    return {k: s for k, s in services.items() if k.startswith("node-")}


def env_names_read_by_the_code() -> set[str]:
    names: set[str] = set()
    pattern = re.compile(r"""(?:environ\.get|environ\[|getenv|env_[a-z_]+|setdefault)\(?\s*"""
                         r"""["']([A-Z][A-Z0-9_]+)""")
    for d in APP_DIRS:
        for path in (ROOT / d).rglob("*.py"):
            names.update(pattern.findall(path.read_text()))
    return names


def test_compose_file_is_valid_against_the_compose_spec_schema(compose):
    schema = json.loads((DOCKER / "compose-spec.schema.json").read_text())
    errors = sorted(jsonschema.Draft201909Validator(schema).iter_errors(compose), key=lambda e: e.json_path)
    assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors)


def test_the_schema_catches_mistakes(compose):
    """The schema is strict enough to matter: an unknown service key and a bad depends_on are refused."""
    schema = json.loads((DOCKER / "compose-spec.schema.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    bad = json.loads(json.dumps(compose))
    bad["services"]["web"]["comand"] = ["x"]
    assert not validator.is_valid(bad)
    bad = json.loads(json.dumps(compose))
    bad["services"]["web"]["depends_on"]["migrate"]["condition"] = "service_finished"
    assert not validator.is_valid(bad)


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI")
def test_docker_compose_config_where_the_plugin_exists():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the docker CLI has no compose plugin here: {(probe.stderr or probe.stdout).strip()[:200]}")
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin:/usr/local/bin", "SECRET_KEY": "x", "POSTGRES_PASSWORD": "x",
                            "REDIS_PASSWORD": "x"})
    assert r.returncode == 0, r.stderr


def test_the_services_are_there(services):
    for name in ("postgres", "redis", "migrate", "web", "control", "webhooks", "demo", "gateway", "usage-consumer"):
        assert name in services, name
    assert len(node_workers(services)) >= 2
    assert services["demo"]["profiles"] == ["demo"]
    assert all(s["profiles"] == ["gpu"] for s in node_workers(services).values())


def test_web_runs_gunicorn_after_migrations(services):
    web = services["web"]
    assert web["command"][:2] == ["gunicorn", "marketplace.wsgi:application"]
    assert (ROOT / "marketplace" / "wsgi.py").exists()
    assert web["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["command"] == ["python", "manage.py", "migrate", "--noinput"]


def test_the_gateway_listens_on_all_interfaces_and_its_usage_is_consumed(services):
    gw = services["gateway"]
    assert gw["command"][:3] == ["python", "manage.py", "gateway"] and "0.0.0.0" in gw["command"]
    assert "8001:8001" in gw["ports"] and (ROOT / "marketplace" / "management" / "commands" / "gateway.py").exists()
    assert services["usage-consumer"]["command"] == ["python", "manage.py", "usage_consumer"]


def test_exactly_one_beat_on_the_control_queue(services):
    beats = [k for k, s in services.items() if isinstance(s.get("command"), list) and "-B" in s["command"]]
    assert beats == ["control"]
    cmd = services["control"]["command"]
    readme = (ROOT / "README.md").read_text()
    assert "celery -A marketplace worker -Q control -B" in readme
    assert cmd[:7] == ["celery", "-A", "marketplace", "worker", "-Q", "control", "-B"]


def queues_of(service: dict) -> list[str]:
    cmd = service.get("command")
    return cmd[cmd.index("-Q") + 1].split(",") if isinstance(cmd, list) and "-Q" in cmd else []


def test_webhooks_have_workers_of_their_own_never_the_control_queue_s(services):
    """A tenant's endpoint is slow at will: the worker that consumes usage and runs beat must never deliver."""
    assert {name for name, s in services.items() if "webhooks" in queues_of(s)} == {"webhooks"}
    cmd = services["webhooks"]["command"]
    assert cmd[:6] == ["celery", "-A", "marketplace", "worker", "-Q", "webhooks"] and "-B" not in cmd
    assert queues_of(services["webhooks"]) == ["webhooks"]
    assert services["webhooks"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "celery -A marketplace worker -Q webhooks" in (DOCKER / "README.md").read_text()


def test_each_node_worker_consumes_its_own_queue(services):
    from marketplace.models import Node

    queues = []
    for name, s in node_workers(services).items():
        host = s["environment"]["TESSERA_NODE_HOSTNAME"]
        cmd = s["command"]
        assert cmd[:4] == ["celery", "-A", "marketplace", "worker"]
        queue = cmd[cmd.index("-Q") + 1]
        assert queue == Node.queue_for(host) == f"node.{host}", name
        assert "," not in queue, f"{name} must consume only its node's queue"
        assert cmd[cmd.index("-c") + 1] == "1"
        assert cmd[cmd.index("-n") + 1] == f"{host}@%h"
        assert name == f"node-{host}" and "hostname" not in s  # Docker refuses a hostname with the host network
        assert s["network_mode"] == "host" and {"SYS_ADMIN", "NET_ADMIN"} <= set(s["cap_add"])  # the slices' rules
        assert s["environment"]["TESSERA_NVML_BACKEND"] == "pynvml"
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices)
        assert any(v.endswith(":/data") and v.split(":")[0] == name for v in s["volumes"]), "its own volume"
        env = s["environment"]
        assert env["TESSERA_SERVING_RUNTIME"] == "docker"
        assert "/var/run/docker.sock:/var/run/docker.sock" in s["volumes"]
        root = env["TESSERA_TRITON_REPO_ROOT"]  # the engine mounts it by the host's path: the same in both
        assert any(v == f"{m}:{m}" and root.startswith(m + "/") for v in s["volumes"] for m in [v.split(":")[0]])
        queues.append(queue)
    assert len(set(queues)) == len(queues)


def test_triton_per_slice_is_started_by_the_node_worker_not_declared(services):
    assert not [k for k, s in services.items() if "tritonserver" in str(s.get("image", ""))]
    for s in node_workers(services).values():
        assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\$\{TRITON_TAG:-\d\d\.\d\d\}-py3",
                            s["environment"]["TESSERA_TRITON_IMAGE"])


def test_environment_variables_are_ones_the_code_reads(services):
    known = env_names_read_by_the_code()
    settings_src = (ROOT / "marketplace" / "settings.py").read_text()
    for name, s in tessera_services(services).items():
        for var in s.get("environment", {}):
            if var.startswith("NVIDIA_"):  # read by the NVIDIA Container Toolkit, not by Tessera
                continue
            assert var in known, f"{name}: {var} is not read anywhere in {', '.join(APP_DIRS)}"
    for var in ("DATABASE_URL", "REDIS_URL", "CELERY_VISIBILITY_TIMEOUT", "TESSERA_NVML_BACKEND",
                "TESSERA_NODE_HOSTNAME", "TESSERA_TRITON_BACKEND", "SECRET_KEY", "ALLOWED_HOSTS"):
        assert f'"{var}"' in settings_src, var


def test_dockerfile_builds_one_non_root_image_for_every_role():
    text = (DOCKER / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert "pip install" in text and "pip install --no-deps -e ." in text
    assert "collectstatic" in text
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0", "0:0")
    assert '"gunicorn", "marketplace.wsgi:application"' in text
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    for pkg in APP_DIRS:  # every package pyproject installs is copied
        assert f"COPY {pkg} " in text
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and "var" in ignore


def test_readme_commands_match_the_compose_file(services):
    readme = (DOCKER / "README.md").read_text()
    for needle in ("register_node", "TESSERA_NVML_BACKEND=pynvml", "--profile demo", "--scale", "-Q node.<hostname>"):
        assert needle in readme, needle
    example = next(iter(node_workers(services)))
    assert f"--profile gpu up -d {example}" in readme


# --- Redis needs a password; the usage signing key goes to the gateway and the consumer only (issue 28) -------

def test_redis_requires_a_password_and_does_not_start_without_one(services):
    redis = services["redis"]
    command = " ".join(redis["command"])
    assert redis["command"][:2] == ["sh", "-c"]
    assert 'test -n "$$REDIS_PASSWORD" ||' in command and "exit 1" in command  # unset: Redis refuses to start
    assert 'redis-server --requirepass "$$REDIS_PASSWORD"' in command
    assert "exec docker-entrypoint.sh redis-server" in command  # the image's entrypoint drops root as before
    for persistence in ("--appendonly yes", "--appendfsync everysec"):
        assert persistence in command
    assert redis["environment"]["REDIS_PASSWORD"] == "${REDIS_PASSWORD:-}"
    assert redis["environment"]["REDISCLI_AUTH"] == "${REDIS_PASSWORD:-}"  # the healthcheck authenticates ...
    assert redis["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -q PONG"]  # ... and says PONG


def test_every_service_reaches_redis_and_the_broker_with_the_password(services):
    for name, s in tessera_services(services).items():
        env = s.get("environment", {})
        if name == "demo":  # SQLite and the embedded broker: no Redis
            assert "REDIS_URL" not in env
            continue
        assert env["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD:-}@redis:"), name
        for var, value in env.items():
            if isinstance(value, str) and "://" in value and var.startswith(("CELERY_", "REDIS")):
                assert value.startswith("redis://:${REDIS_PASSWORD"), (name, var)
    text = COMPOSE.read_text() + (DOCKER / "env.example").read_text() + (ROOT / "README.md").read_text()
    assert "amqp://" not in text and "guest" not in text  # no RabbitMQ, let alone its guest user


def test_the_usage_signing_key_goes_to_the_gateway_and_the_consumers_only(services):
    holders = {name for name, s in tessera_services(services).items()
               if "TESSERA_USAGE_SIGNING_KEY" in s.get("environment", {})}
    assert holders == {"gateway", "usage-consumer", "control", "control-extra"}  # control: beat's consume-usage
    for name in holders:
        assert services[name]["environment"]["TESSERA_USAGE_SIGNING_KEY"] == "${TESSERA_USAGE_SIGNING_KEY:-}"
    assert not holders & set(node_workers(services)) and "web" not in holders


def test_env_example_names_every_secret_to_set():
    names = {line.split("=", 1)[0] for line in (DOCKER / "env.example").read_text().splitlines()
             if "=" in line and not line.startswith("#")}
    assert {"SECRET_KEY", "POSTGRES_PASSWORD", "REDIS_PASSWORD", "TESSERA_USAGE_SIGNING_KEY"} <= names
