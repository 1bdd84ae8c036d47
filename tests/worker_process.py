"""Start and stop a real Celery worker process for a node queue, against the test database and
the configured broker (Redis in CI, the embedded filesystem broker otherwise)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def test_database_url() -> str:
    d = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{d['NAME']}"
    user = d.get("USER") or "postgres"
    password = f":{d['PASSWORD']}" if d.get("PASSWORD") else ""
    return f"postgres://{user}{password}@{d.get('HOST') or '127.0.0.1'}:{d.get('PORT') or 5432}/{d['NAME']}"


class Worker:
    def __init__(self, queue: str, sim_dir: Path, log_path: Path, **env: str):
        self.queue, self.sim_dir, self.log_path, self.env = queue, sim_dir, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self, pool: str = "solo", concurrency: int = 1, **extra_env: str) -> Worker:
        """``pool="solo"``: the task runs in the worker process itself; ``"prefork"``: in pool children
        (``-c concurrency``), which the main process replaces if one dies (see pool_pids); ``"threads"``: in
        ``concurrency`` threads of the worker process."""
        env = {**os.environ, "DATABASE_URL": test_database_url(), "TESSERA_SIM_DIR": str(self.sim_dir),
               "TESSERA_TRITON_REPO_ROOT": str(self.sim_dir.parent / "triton"),
               "TESSERA_UPLOAD_ROOT": str(self.sim_dir.parent / "uploads"),
               "TESSERA_MODEL_STORE_ROOT": str(self.sim_dir.parent / "model-store"),
               "CELERY_VISIBILITY_TIMEOUT": "5", "TESSERA_PROVISION_STUCK_AFTER_S": "1",
               "LOG_FORMAT": "text", "LOG_LEVEL": "INFO", **self.env, **extra_env}
        log = open(self.log_path, "ab")  # the process owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "marketplace", "worker", "-P", pool,
             *(["-c", str(concurrency)] if pool != "solo" else []), "-Q", self.queue,
             "-n", f"{self.queue.split(',')[0]}@test", "--without-mingle", "--without-gossip", "-l", "INFO"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no acks, as when a machine dies."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def pool_pids(self) -> list[int]:
        """The worker's child processes (the prefork pool's; none with the solo pool), from /proc."""
        if not self.proc or self.proc.poll() is not None:
            return []
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            if int(fields[1]) == self.proc.pid:  # fields: state, ppid, ...
                pids.append(int(stat.parent.name))
        return sorted(pids)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


def wait_for(predicate, timeout: float, what: str, worker: Worker | None = None, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    tail = worker.log_tail() if worker else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n--- worker log ---\n{tail}")


def broker_kind() -> str:
    return settings.CELERY_BROKER_URL.split(":", 1)[0]
