"""`manage.py demo` as a person (or a service manager) runs it: in its own SQLite and var folder, as a process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gateway_fixtures import free_port

ROOT = Path(__file__).resolve().parents[2]


def _env(var: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL",
                                                           "CELERY_RESULT_BACKEND")}
    env.update({"TESSERA_VAR_DIR": str(var), "LOG_FORMAT": "text", "LOG_LEVEL": "WARNING"})
    return env


def _logins(out: str) -> tuple[str, str]:
    op = re.search(r"operator login \S+ / (\S+)", out).group(1)
    users = re.search(r"tenant users .* / (\S+)", out).group(1)
    return op, users


def test_a_restart_keeps_the_passwords_and_shows_the_keys_again(tmp_path):
    env = _env(tmp_path / "var")
    runs = [subprocess.run([sys.executable, "manage.py", "demo", "--no-run"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300, check=True).stdout for _ in range(2)]
    assert _logins(runs[0]) == _logins(runs[1])
    keys = [sorted(re.findall(r"API key (\S+) +(tsk_\S+)", out)) for out in runs]
    assert len(keys[0]) == 4 and keys[0] == keys[1]
    assert (tmp_path / "var" / "demo-logins.json").stat().st_mode & 0o077 == 0  # readable by its owner only


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and ps --ppid")
def test_sigterm_stops_the_demo_with_its_workers_and_gateway(tmp_path):
    web, gw = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "manage.py", "demo", "--addr", f"127.0.0.1:{web}", "--gateway-addr",
                             f"127.0.0.1:{gw}"], cwd=ROOT, env=_env(tmp_path / "var"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        children: set[int] = set()
        while time.monotonic() < deadline and len(children) < 3:
            children = _children(proc.pid)
            time.sleep(0.5)
        assert len(children) >= 3, "the demo did not start its workers (embedded, webhooks) and gateway"
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert "demo stopped" in out
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)], "the demo's workers or gateway outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in _children(proc.pid):
            os.kill(c, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and ps --ppid")
def test_in_the_background_on_other_ports_its_pages_name_its_gateway_and_exit_after_stops_it(tmp_path):
    """As a script starts it: in the background, where the shell has SIGINT ignored, on ports of its own. Its pages
    name the gateway it started (not the default port), and --exit-after stops it with its workers and gateway."""
    import requests

    web, gw = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "manage.py", "demo", "--addr", f"127.0.0.1:{web}", "--gateway-addr",
                             f"127.0.0.1:{gw}", "--exit-after", "150"], cwd=ROOT, env=_env(tmp_path / "var"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        lines: list[str] = []
        for line in proc.stdout:  # until the web app is up (the logins are printed before it starts)
            lines.append(line)
            if "embedded worker:" in line:
                break
        _, password = _logins("".join(lines))
        s = requests.Session()
        deadline = time.monotonic() + 60
        while True:
            try:
                page = s.get(f"http://127.0.0.1:{web}/login/", timeout=5)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, "the demo's web app did not answer"
                time.sleep(0.5)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        s.post(f"http://127.0.0.1:{web}/login/", data={"username": "owner@acme.example", "password": password,
                                                       "csrfmiddlewaretoken": token}, timeout=10)
        deadline = time.monotonic() + 120  # the demo deploys a model on each slice once the worker made them active
        link = None
        while link is None and time.monotonic() < deadline:
            models = s.get(f"http://127.0.0.1:{web}/portal/models/", timeout=10)
            assert models.status_code == 200 and "/login/" not in models.url
            link = re.search(r'href="(/portal/models/\d+/)"', models.text)
            time.sleep(1)
        assert link, "no model deployed in the demo"
        page = s.get(f"http://127.0.0.1:{web}{link.group(1)}", timeout=10).text
        assert f"http://127.0.0.1:{gw}/v1" in page and "127.0.0.1:8001" not in page
        children = _children(proc.pid)
        rest, _ = proc.communicate(timeout=240)  # --exit-after stops it, though SIGINT is ignored
        assert "demo stopped" in rest
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)], "the demo's workers or gateway outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in _children(proc.pid):
            os.kill(c, signal.SIGKILL)
