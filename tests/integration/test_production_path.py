"""README's "Running in production" block, run as written: migrate, collect static files, create the first operator,
start the web app (gunicorn), the control and webhooks workers, the gateway, the usage consumer, register a node and
start its worker; then sign in as that operator and see the console and the node working. Only what cannot be the
same here is changed: a database and a Redis index of its own, free loopback ports, the simulated NVML backend,
this test run's virtual environment, the operator's password on standard input."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from tests.gateway_fixtures import free_port

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```sh production-path\n(.*?)```", re.S)


def _script(web: int, gw: int, db_url: str, redis_url: str) -> str:
    block = BLOCK.search((ROOT / "README.md").read_text()).group(1)
    bindir = str(Path(sys.executable).parent) + "/"
    out = []
    for line in block.splitlines():
        if line.startswith("python3 -m venv"):
            continue  # this run's environment has the project installed already
        line = line.replace(".venv/bin/", bindir)
        line = re.sub(r"DATABASE_URL=\S+", f"DATABASE_URL={db_url}", line)
        line = re.sub(r"REDIS_URL=\S+", f"REDIS_URL={redis_url}", line)
        line = line.replace("127.0.0.1:8000", f"127.0.0.1:{web}").replace("--port 8001", f"--port {gw}")
        if "create_operator" in line:
            line += ' --password-stdin <<< "$OPERATOR_PASSWORD"'
        out.append(line)
    return "\n".join(["set -e", *out, "echo PRODUCTION-PATH-STARTED", "wait"])


@pytest.fixture
def fresh_database():
    from django.conf import settings

    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("the production path runs on PostgreSQL (DATABASE_URL)")
    if not os.environ.get("REDIS_URL"):
        pytest.skip("the production path needs Redis (REDIS_URL)")
    import psycopg

    db = settings.DATABASES["default"]
    name = f"tessera_prod_{uuid.uuid4().hex[:8]}"
    admin = dict(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432, user=db["USER"], dbname="postgres",
                 autocommit=True)
    if db.get("PASSWORD"):
        admin["password"] = db["PASSWORD"]
    with psycopg.connect(**admin) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    auth = f"{db['USER']}:{db['PASSWORD']}@" if db.get("PASSWORD") else f"{db['USER']}@"
    yield f"postgres://{auth}{admin['host']}:{admin['port']}/{name}"
    with psycopg.connect(**admin) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_readme_production_path_runs_and_its_operator_runs_the_msp(fresh_database, tmp_path):
    import redis

    base = os.environ["REDIS_URL"].rsplit("/", 1)[0]
    redis_url = f"{base}/14"  # an index of its own: its queues are nobody else's
    redis.Redis.from_url(redis_url).flushdb()
    web, gw = free_port(), free_port()
    password = secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "TESSERA_"))}
    env.update({"TESSERA_VAR_DIR": str(tmp_path / "var"), "TESSERA_NVML_BACKEND": "sim",
                "TESSERA_SIM_DIR": str(tmp_path / "sim"), "OPERATOR_PASSWORD": password,
                "LOG_LEVEL": "WARNING", "LOG_FORMAT": "text"})
    proc = subprocess.Popen(["bash", "-c", _script(web, gw, fresh_database, redis_url)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "PRODUCTION-PATH-STARTED" in line:
                break
        out = "".join(lines)
        assert "PRODUCTION-PATH-STARTED" in out, out[-3000:]
        assert "operator ops@your-msp.example created" in out and "registered gpu-h100-01" in out, out[-3000:]
        s = requests.Session()
        deadline = time.monotonic() + 90
        while True:
            try:
                page = s.get(f"http://127.0.0.1:{web}/login/", timeout=5)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "gunicorn did not answer"
                time.sleep(0.5)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        s.post(f"http://127.0.0.1:{web}/login/", data={"username": "ops@your-msp.example", "password": password,
                                                       "csrfmiddlewaretoken": token}, timeout=10)
        console = s.get(f"http://127.0.0.1:{web}/console/nodes/", timeout=10)
        assert console.status_code == 200 and "/login/" not in console.url
        row = re.search(r"gpu-h100-01.*?</tr>", console.text, re.S).group(0)
        assert ">Ready<" in row  # registered by itself on the node: working (its heartbeat)
        assert "/static/" in console.text and s.get(
            f"http://127.0.0.1:{web}" + re.search(r'src="(/static/[^"]+\.js)"', console.text).group(1),
            timeout=10).status_code == 200  # the collected static files are served
        models = requests.get(f"http://127.0.0.1:{gw}/v1/models", timeout=10)
        assert models.status_code == 401 and models.json()["error"]["code"] == "missing_api_key"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        redis.Redis.from_url(redis_url).flushdb()
