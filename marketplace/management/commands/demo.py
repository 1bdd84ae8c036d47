"""`manage.py demo`: migrate, seed a realistic MSP, run the web app with an embedded worker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.utils import timezone

from marketplace.demo.seed import seed_fleet
from marketplace.demo.tenants import seed_demo
from marketplace.staticfiles import collected_is_current


class Command(BaseCommand):
    help = "Set up and run the Tessera demo: SQLite, embedded broker, simulated fleet, web app on localhost."

    def add_arguments(self, parser):
        parser.add_argument("--addr", default="127.0.0.1:8000", help="address:port for the web app")
        parser.add_argument("--gateway-addr", default="127.0.0.1:8001",
                            help="address:port for the inference gateway (where tenants call their models)")
        parser.add_argument("--no-run", action="store_true", help="migrate and seed only")
        parser.add_argument("--no-worker", action="store_true", help="do not start the embedded workers")
        parser.add_argument("--exit-after", type=float, default=0,
                            help="stop after this many seconds (smoke tests)")

    def handle(self, *args, **opts):
        # The gateway's public URL: TESSERA_GATEWAY_URL when set, else the gateway this demo starts (its child
        # processes read it from their environment).
        self.gateway_url = gateway_url(opts["gateway_addr"])
        os.environ["TESSERA_GATEWAY_URL"] = self.gateway_url
        settings.TESSERA_GATEWAY_URL = self.gateway_url  # the web app runs in this process: its pages and "Try it"
        steps = _Steps(self.stdout.write)
        with steps("database migrated"):
            call_command("migrate", interactive=False, verbosity=0)
        with steps("tenants, logins and keys seeded"):
            result = self._seed_logins()
        with steps("simulated fleet seeded"):
            counts = seed_fleet()
        self.stdout.write(f"simulated fleet: {counts['nodes']} nodes, {counts['allocations']} allocations ordered")
        if not opts["no_run"] and not collected_is_current():
            # hashed names, gzip + brotli copies (plotly.js: 4.8 MB -> 1.1 MB), once
            self.stdout.write("collecting and compressing static files (once)...")
            with steps("static files collected and compressed"):
                call_command("collectstatic", interactive=False, verbosity=0)
        steps.report()
        self._print_logins(result, opts["addr"])
        if opts["no_run"]:
            return
        os.environ["TESSERA_DEMO_TRAFFIC"] = "1"
        # The simulated slices answer Triton's HTTP protocol, so the gateway reaches them as it reaches real ones.
        os.environ["TESSERA_SIM_TRITON_HTTP"] = "1"
        gateway = self._start_gateway(opts["gateway_addr"])
        worker = None if opts["no_worker"] else self._start_worker()
        webhooks = None if opts["no_worker"] else self._start_webhooks_worker()
        if worker is not None:
            threading.Thread(target=self._deploy_and_backfill, args=(result, opts["addr"]), daemon=True).start()
        # A service manager stops the demo with SIGTERM: leave through the same path as Ctrl-C, so the
        # embedded worker and the gateway are stopped with it (not left running).
        signal.signal(signal.SIGTERM, _interrupt)
        if opts["exit_after"]:
            def stop():  # SIGTERM, not SIGINT: a shell starts background jobs with SIGINT ignored
                time.sleep(opts["exit_after"])
                os.kill(os.getpid(), signal.SIGTERM)
            threading.Thread(target=stop, daemon=True).start()
        try:
            call_command("runserver", opts["addr"], use_reloader=False)
        except KeyboardInterrupt:
            pass
        finally:
            for proc in (worker, webhooks, gateway):
                if proc is None:
                    continue
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self.stdout.write("demo stopped")

    def _seed_logins(self):
        """Seed the demo; the logins of the first run are kept in var/demo-logins.json (mode 0600), so a restart
        keeps the passwords and can show the API keys again."""
        path = settings.VAR_DIR / "demo-logins.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        result = seed_demo(saved.get("operator_password"), saved.get("user_password"))
        result.keys = {**saved.get("keys", {}), **result.keys}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"operator_password": result.operator_password, "user_password": result.user_password,
                       "keys": result.keys}, f, indent=2)
        return result

    def _deploy_and_backfill(self, result=None, addr="127.0.0.1:8000"):
        """Once the worker has made the demo slices active: a model on each, and three days of the
        usage their gateway reported, so invoices and charts have something to show."""
        from django.db import close_old_connections

        from marketplace.demo import traffic as demo_traffic
        from marketplace.models import Allocation, ModelDeployment, Order
        from marketplace.services import billing, deployments
        from tenants.models import Tenant

        close_old_connections()
        deadline = time.monotonic() + 90
        live = Allocation.objects.exclude(state__in=[Allocation.State.RELEASED, Allocation.State.FAILED])
        while time.monotonic() < deadline and live.exclude(state=Allocation.State.ACTIVE).exists():
            time.sleep(1)
        new = 0
        idle = Allocation.objects.filter(state=Allocation.State.ACTIVE, deployments__isnull=True)
        for a in idle.select_related("tenant"):
            deployments.deploy(demo_traffic.SYSTEM, a, "tiny-gen", template="tiny-gen")
            new += 1
        if new:
            # A past month to invoice: the demo's slices were "ordered" before it began and its models served
            # all along, so the monthly rating run finalizes that month (an operator can then credit it).
            since = _previous_month_start(timezone.now())
            held = Allocation.objects.filter(state=Allocation.State.ACTIVE, activated_at__gt=since)
            Order.objects.filter(allocations__in=held, created_at__gt=since).update(created_at=since)
            held.update(activated_at=since, created_at=since)
            n = demo_traffic.backfill(days=3, since=since)
            for t in Tenant.objects.all():
                billing.current_invoice(t)
            self.stdout.write(f"demo: {new} models deployed, {n} usage events since {since:%Y-%m-%d} reported")
        loading = ModelDeployment.objects.exclude(state=ModelDeployment.State.READY)
        while time.monotonic() < deadline and loading.exists():
            time.sleep(1)
        if result is not None:  # again, now that it is ready: the worker's log lines have scrolled the first away
            self._print_logins(result, addr, title="Tessera demo is ready")

    def _start_gateway(self, addr: str):
        host, _, port = addr.rpartition(":")
        cmd = [sys.executable, "manage.py", "gateway", "--host", host or "127.0.0.1", "--port", port]
        self.stdout.write(f"inference gateway: http://{addr}/v1 (OpenAI-compatible), http://{addr}/v2 (KServe)")
        return subprocess.Popen(cmd)  # inherits the environment set above

    def _start_worker(self):
        from marketplace.models import Node

        # One embedded worker plays the control worker and every simulated node's worker.
        queues = ",".join(["control", *Node.objects.values_list("queue", flat=True)])
        cmd = [sys.executable, "-m", "celery", "-A", "marketplace", "worker", "-B", "-P", "solo",
               "-Q", queues, "--loglevel", "WARNING", "-n", "demo@%h"]
        self.stdout.write(f"embedded worker: {' '.join(cmd[2:])}")
        return subprocess.Popen(cmd)  # inherits the environment set above

    def _start_webhooks_worker(self):
        """Tenants' webhook endpoints are slow at will: their deliveries get a worker of their own (threads: each
        attempt mostly waits), so a slow endpoint never holds the embedded worker that consumes usage and runs
        beat's jobs and the nodes' tasks."""
        from marketplace.services import webhooks

        cmd = [sys.executable, "-m", "celery", "-A", "marketplace", "worker", "-P", "threads", "-c", "4",
               "-Q", webhooks.QUEUE, "--loglevel", "WARNING", "-n", "demo-webhooks@%h"]
        self.stdout.write(f"webhooks worker: {' '.join(cmd[2:])}")
        return subprocess.Popen(cmd)

    def _print_logins(self, result, addr, title="Tessera demo"):
        w = self.stdout.write
        w("")
        w(self.style.SUCCESS(title))
        w(f"  web app        http://{addr}/  (operators land in the console, tenant users in the portal)")
        w(f"  Django admin   http://{addr}/admin/")
        w(f"  API docs       http://{addr}/api/docs/")
        w(f"  gateway        {getattr(self, 'gateway_url', settings.TESSERA_GATEWAY_URL)}/v1  "
          f"(keys with the inference scope; each model's portal page has examples)")
        w(f"  operator login {result.operator_email} / {result.operator_password}")
        w(f"  tenant users   owner@acme.example, ml@acme.example, ops@borealis.example ... / {result.user_password}")
        for slug, secret in result.keys.items():
            w(f"  API key {slug:14s} {secret}")
        if not result.keys:
            w("  API keys: create them in the portal (API keys) or the API.")
        w("")


class _Steps:
    """The demo's setup steps, each timed as it ends; `report()` names the slowest (what a cold start waits on)."""

    def __init__(self, write) -> None:
        self.write = write
        self.took: list[tuple[float, str]] = []

    @contextlib.contextmanager
    def __call__(self, what: str):
        started = time.monotonic()
        yield
        self.took.append((time.monotonic() - started, what))
        self.write(f"{what} ({self.took[-1][0]:.1f} s)")

    def report(self) -> None:
        seconds, what = max(self.took)
        self.write(f"set up in {sum(t for t, _ in self.took):.1f} s; slowest step: {what} ({seconds:.1f} s)")


def _previous_month_start(now: datetime) -> datetime:
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (first - timedelta(days=1)).replace(day=1)


def gateway_url(gateway_addr: str) -> str:
    """TESSERA_GATEWAY_URL if it was set (not the default), else the address the demo's gateway listens on."""
    if settings.TESSERA_GATEWAY_URL != settings.DEFAULT_GATEWAY_URL:
        return settings.TESSERA_GATEWAY_URL
    return f"http://{gateway_addr}"


def _interrupt(signum, frame):
    raise KeyboardInterrupt
