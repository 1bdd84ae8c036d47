"""Fixtures for the inference gateway: the ASGI app in uvicorn on a free port, in a thread of the test process
(``gateway``), or as real ``manage.py gateway`` processes (``GatewayProcess``, for kills and two processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import uvicorn

from marketplace.gateway.app import Gateway
from marketplace.hardware import sim_http
from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning, serving
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, make_key

ROOT = Path(__file__).resolve().parent.parent


def run_async(make_coro):
    """Run ``make_coro()`` to completion on a fresh event loop in its own thread: the test's thread may already
    have a running loop (Playwright's sync API keeps one in the main thread once a browser test ran)."""
    out: dict = {}

    def target():
        try:
            out["value"] = asyncio.run(make_coro())
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadGateway:
    """uvicorn serving a Gateway in a background thread (its own event loop)."""

    def __init__(self, app: Gateway) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, loop="asyncio",
                                                    lifespan="on", log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadGateway:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def refresh(self) -> None:
        """Reload keys, tenants and routes now (what the background refresh does every few seconds)."""
        asyncio.run_coroutine_threadsafe(self.app.refresh(), self.app.loop).result(timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
def gateway_factory(settings, tmp_path):
    """Start gateways in this process: ``gateway_factory(refresh_s=0.2, **gateway_kwargs)``."""
    settings.TESSERA_USAGE_SPOOL_DIR = tmp_path / "spool"
    settings.TESSERA_USAGE_STREAM = f"tessera:test-usage:{uuid.uuid4().hex[:8]}"
    started: list[ThreadGateway] = []

    def start(refresh_s: float = 0.2, **kwargs) -> ThreadGateway:
        gw = ThreadGateway(Gateway(refresh_s=refresh_s, **kwargs)).start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()
    if settings.REDIS_URL:
        import redis

        redis.Redis.from_url(settings.REDIS_URL).delete(settings.TESSERA_USAGE_STREAM)


class GatewayProcess:
    """``manage.py gateway`` as a real process on the test database (for SIGKILL and multi-process tests)."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.log = log_dir / f"gateway-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> GatewayProcess:
        import urllib.request

        self.proc = subprocess.Popen([sys.executable, "manage.py", "gateway", "--port", str(self.port)], cwd=ROOT,
                                     env=self.env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"gateway did not answer: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def sim_http_on(settings, sim_dir):
    settings.TESSERA_SIM_TRITON_HTTP = True
    serving.reset_runtimes()
    yield
    sim_http.stop_all()


def gateway_tenant(slug):
    tenant = TenantFactory(slug=slug, max_slices=8, max_slices_per_tier=8, max_memory_gb=1000)
    return tenant, principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)


def gateway_slice(owner, tier):
    tenant, principal = owner
    a = orders.create_order(principal, tenant=tenant, tier=tier).allocations.get()
    assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
    return Allocation.objects.get(pk=a.pk)


def gateway_deploy(owner, a, name, template):
    dep = deployments.deploy(owner[1], a, name, template=template)
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    return dep


@pytest.fixture
def gateway_fleet(sim_http_on, h100_node, tiers):
    """Two tenants on simulated slices with HTTP fronts: alpha has tiny-gen and tiny-chat, bravo secret-model;
    one inference key each."""
    a_owner, b_owner = gateway_tenant("alpha"), gateway_tenant("bravo")
    a1 = gateway_slice(a_owner, tiers["1g"])
    gen = gateway_deploy(a_owner, a1, "tiny-gen", "tiny-gen")
    chat = gateway_deploy(a_owner, a1, "tiny-chat", "tiny-chat")
    b1 = gateway_slice(b_owner, tiers["1g"])
    b_gen = gateway_deploy(b_owner, b1, "secret-model", "tiny-gen")
    _, key_a = make_key(a_owner[0], ["inference"])
    _, key_b = make_key(b_owner[0], ["inference"])
    return {"a": a_owner[0], "b": b_owner[0], "a_owner": a_owner, "gen": gen, "chat": chat, "b_gen": b_gen,
            "key_a": key_a, "key_b": key_b, "tiers": tiers}
