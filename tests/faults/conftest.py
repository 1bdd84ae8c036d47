"""Fault tests: real PostgreSQL, real Redis (a private redis-server per test where the test restarts it),
real Celery worker processes. They skip, saying why, where those services are not configured."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from django.conf import settings

REDIS_SERVER = shutil.which("redis-server")


def real_services_reason() -> str | None:
    if not os.environ.get("REDIS_URL"):
        return "fault tests need the real services: REDIS_URL is not set"
    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        return "fault tests need the real services: DATABASE_URL is not PostgreSQL"
    return None


needs_real_services = pytest.mark.skipif(real_services_reason() is not None,
                                         reason=real_services_reason() or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server of the test's own (never the machine's 6379) with an fsync-always AOF in its own
    directory, so a kill -9 and a restart on the same directory keeps every acknowledged write."""

    def __init__(self, data_dir: Path, log_path: Path):
        self.port = free_port()
        self.dir, self.log_path = data_dir, log_path
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        log = open(self.log_path, "ab")  # the process owns it
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.dir), "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:  # still starting (or loading the AOF)
                time.sleep(0.05)
        raise AssertionError(f"private redis did not start on {self.port}: {self.log_path.read_text()[-2000:]}")

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)

    def queued(self, queue: str) -> int:
        """Messages waiting in a kombu queue (its list and the priority-step lists next to it)."""
        c = self.client()
        return sum(c.llen(k) for k in c.scan_iter(match=f"{queue}*") if c.type(k) == b"list")

    def unacked(self) -> int:
        return self.client().hlen("unacked")


@pytest.fixture
def private_redis(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    r = PrivateRedis(tmp_path / "redis-data", tmp_path / "redis.log").start()
    yield r
    r.kill9()
