"""Webhooks that cannot hurt anyone else (issue 30, item 4), with REAL Celery worker processes: a webhooks worker (the
`webhooks` queue only, threads, as docker/compose.yaml runs it) and a control worker consuming usage, on the
configured broker (Redis in CI, the embedded filesystem broker otherwise).

Tenant endpoints on loopback (allowed by TESSERA_WEBHOOK_ALLOW_NETWORKS) misbehave: a slow-loris (headers, then one
byte a second) and one that never ends its headers. Each attempt ends at its 2 s deadline, is retried with backoff
and the delivery ends `failed` with a reason after 3 attempts, while usage events written the gateway's way keep being
consumed by `tessera.consume_usage` on the control queue, each within seconds. A webhooks worker SIGKILLed
mid-attempt leaves a delivery that the sweep (beat's tessera.sweep_webhooks) queues again: it ends failed too,
never pending for good."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.db import connection

from marketplace.celery import app, ping
from marketplace.gateway import metering
from marketplace.gateway.metering import RedisStreamSink, SpoolSink
from marketplace.models import WebhookDelivery, WebhookEndpoint
from marketplace.services import webhooks
from telemetry.models import UsageEvent
from tests.factories import DeploymentFactory
from tests.gateway_fixtures import run_async
from tests.webhook_servers import Endpoint
from tests.worker_process import Worker, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

DEADLINE_S, ATTEMPTS, BACKOFF_S = 2.0, 3, 0.5
KEY = "usage-signing-key-of-the-webhooks-worker-test-0123"
HOOKS_ENV = {"TESSERA_WEBHOOK_ALLOW_NETWORKS": "127.0.0.1/32", "TESSERA_WEBHOOK_TIMEOUT_S": str(DEADLINE_S),
             "TESSERA_WEBHOOK_MAX_ATTEMPTS": str(ATTEMPTS), "TESSERA_WEBHOOK_BACKOFF_S": str(BACKOFF_S),
             "TESSERA_WEBHOOK_SWEEP_INTERVAL_S": "1"}


class Usage:
    """Usage events written as the gateway writes them (its sink: the Redis stream, or the spool without Redis)."""

    def __init__(self, settings, spool: Path):
        self.stream = f"tessera:test-usage:{uuid.uuid4().hex[:8]}"
        settings.TESSERA_USAGE_STREAM, settings.TESSERA_USAGE_SPOOL_DIR = self.stream, spool
        settings.TESSERA_USAGE_SIGNING_KEY, settings.TESSERA_USAGE_SIGNING_KEY_PREVIOUS = KEY, ""
        spool.mkdir(parents=True, mode=0o700)
        self.env = {"TESSERA_USAGE_STREAM": self.stream, "TESSERA_USAGE_SPOOL_DIR": str(spool),
                    "TESSERA_USAGE_SIGNING_KEY": KEY}
        self.redis_url = django_settings.REDIS_URL

    def write(self, e: dict) -> None:
        async def run():
            if self.redis_url:
                import redis.asyncio as aioredis

                r = aioredis.Redis.from_url(self.redis_url)
                sink = RedisStreamSink(r, self.stream)
            else:
                sink = SpoolSink()
            await sink.start()
            await sink.append(e)
            await sink.close()
            if self.redis_url:
                await r.aclose()

        run_async(run)

    def cleanup(self) -> None:
        if self.redis_url:
            import redis

            r = redis.Redis.from_url(self.redis_url)
            r.delete(self.stream, metering.dead_letter_stream(self.stream))


@pytest.fixture
def usage(settings, tmp_path):
    u = Usage(settings, tmp_path / "spool")
    yield u
    u.cleanup()


@pytest.fixture
def endpoints():
    started: list[Endpoint] = []

    def serve(behave: str) -> Endpoint:
        started.append(Endpoint(behave, interval=1.0).start())
        return started[-1]

    yield serve
    for ep in started:
        ep.stop()


def fresh(model, **filters):
    connection.close()  # see the workers' commits
    return model.objects.filter(**filters)


def test_slow_endpoints_fail_within_their_deadlines_while_usage_keeps_flowing(tiers, sim_dir, tmp_path, usage,
                                                                              endpoints):
    dep = DeploymentFactory(allocation__order__tier=tiers["1g"])
    tenant = dep.tenant
    slow_body, endless = endpoints("slow_body"), endpoints("endless_headers")
    for ep in (slow_body, endless):
        WebhookEndpoint.objects.create(tenant=tenant, url=ep.url, secret="s", events=["invoice.finalized"])
    control = Worker("control", sim_dir / "sim", tmp_path / "control.log", **usage.env).start()
    hooks = Worker("webhooks", sim_dir / "sim", tmp_path / "webhooks.log", **HOOKS_ENV)
    hooks.start(pool="threads", concurrency=2)
    try:
        for queue in ("control", "webhooks"):  # both workers are up
            ping.apply_async(queue=queue).get(timeout=60)
        connection.close()
        started = time.monotonic()
        webhooks.emit(tenant, "invoice.finalized", "invoice:1", {"number": "TSR-1"})  # queued: no transaction
        lags, n = [], 0
        while time.monotonic() - started < 40:
            n += 1
            eid = f"during-webhooks-{n}"
            usage.write(metering.event(eid, tenant.pk, dep.pk, 10, 20))
            written = time.monotonic()
            app.send_task("tessera.consume_usage", queue="control")
            wait_for(lambda eid=eid: fresh(UsageEvent, event_id=eid).exists(), 15, f"usage event {eid} consumed",
                     control, interval=0.05)
            lags.append(time.monotonic() - written)
            if not fresh(WebhookDelivery, status="pending").exists():
                break
            time.sleep(0.3)
        took = time.monotonic() - started
    finally:
        hooks.stop()
        control.stop()

    deliveries = list(fresh(WebhookDelivery).select_related("endpoint"))
    assert len(deliveries) == 2
    for d in deliveries:
        assert d.status == "failed", (d.endpoint.url, d.status, d.attempts, d.last_error, hooks.log_tail())
        assert d.attempts == ATTEMPTS and d.last_status_code is None and d.delivered_at is None
        assert d.last_reason == webhooks.REASONS["timeout"]
        assert d.last_error.startswith(f"gave up after {ATTEMPTS} attempts; the last: no complete answer within 2 s")
    for ep in (slow_body, endless):
        conns = ep.connections
        assert len(conns) == ATTEMPTS, ep.behave
        for c in conns:  # every attempt was given up at its deadline, not kept while the endpoint dribbled
            assert c.closed is not None and c.closed - c.accepted <= DEADLINE_S + 1.0, (ep.behave, c)
        for i in range(1, ATTEMPTS):  # and retried after a backoff (half to all of 0.5 s, then of 1 s)
            gap = conns[i].accepted - conns[i - 1].closed
            assert BACKOFF_S * 2 ** (i - 1) / 2 - 0.3 <= gap <= 5, (ep.behave, i, gap)
    assert took < ATTEMPTS * DEADLINE_S + 10
    # usage kept flowing on the control queue the whole time
    assert n >= 5 and max(lags) < 3.0, lags
    print(f"usage consumed during the webhooks' {took:.1f} s: {n} events, lag p50 {sorted(lags)[len(lags) // 2]:.2f} s,"
          f" max {max(lags):.2f} s")


def test_a_delivery_whose_worker_is_killed_mid_attempt_is_swept_and_ends_failed(tiers, sim_dir, tmp_path,
                                                                                 endpoints, operator):
    silent = endpoints("silent")
    ep = WebhookEndpoint.objects.create(tenant=None, url=silent.url, secret="s", events=["invoice.finalized"])
    d = WebhookDelivery.objects.create(endpoint=ep, event="invoice.finalized", event_key="k", payload={})
    env = {**HOOKS_ENV, "TESSERA_WEBHOOK_MAX_ATTEMPTS": "2", "TESSERA_WEBHOOK_TIMEOUT_S": "30"}
    hooks = Worker("webhooks", sim_dir / "sim", tmp_path / "webhooks.log", **env).start()
    try:
        app.send_task("tessera.deliver_webhook", args=[d.pk], queue="webhooks")
        wait_for(lambda: len(silent.connections) == 1, 60, "the first attempt connected", hooks)
        hooks.kill()  # SIGKILL mid-attempt: no outcome recorded, the message may come back
        d = fresh(WebhookDelivery, pk=d.pk).get()
        assert (d.status, d.attempts) == ("pending", 1) and d.next_attempt_at is not None  # claimed: overdue later
        # what the sweep will do once that attempt is overdue (its 30 s deadline + backoff): make it so now
        WebhookDelivery.objects.filter(pk=d.pk).update(next_attempt_at=d.next_attempt_at.replace(year=2000))
        env["TESSERA_WEBHOOK_TIMEOUT_S"] = str(DEADLINE_S)
        hooks = Worker("webhooks", sim_dir / "sim", tmp_path / "webhooks-2.log", **env).start()
        app.send_task("tessera.sweep_webhooks", queue="webhooks")  # as beat sends it
        wait_for(lambda: fresh(WebhookDelivery, pk=d.pk, status="failed").exists(), 60, "failed after the sweep",
                 hooks)
    finally:
        hooks.stop()
    d = fresh(WebhookDelivery, pk=d.pk).get()
    assert d.attempts == 2 and d.last_reason == webhooks.REASONS["timeout"] and d.next_attempt_at is None
    assert len(silent.connections) == 2
