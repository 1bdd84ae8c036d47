"""The inference gateway's shared limits and exact metering under real processes and faults.

Real ``manage.py gateway`` processes (``GatewayProcess``) on the test database and a private redis-server
(AOF, fsync always; ``conftest.PrivateRedis``), in front of simulated slices whose HTTP fronts
(``TESSERA_SIM_TRITON_HTTP``) run in this test process: the gateways find them through the routes they read
from the database, as they find real ones. The consumer is ``metering.consume`` in this process or
``manage.py usage_consumer`` as a process of its own (killed with SIGKILL and started again).

What must hold: a per-key requests/minute limit is one limit across gateway processes; every answer a client
got with 200 has exactly one usage event (its ``x-request-id``), whatever is killed (a gateway during load, the
consumer mid-batch, Redis between appends and consumption); nothing is counted twice, in the events or in
their hourly totals.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Sum

from marketplace.gateway import limits, metering
from marketplace.gateway.metering import GROUP, RedisStreamSink
from marketplace.hardware import sim_http
from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments, orders, provisioning, serving
from telemetry.models import UsageEvent, UsageHourly
from tenants.models import ApiKey
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests.factories import MembershipFactory, TenantFactory, make_key
from tests.faults.conftest import needs_real_services
from tests.gateway_fixtures import GatewayProcess, run_async
from tests.worker_process import test_database_url as database_url
from tests.worker_process import wait_for

pytestmark = [needs_real_services, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "tiny-gen", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2}


# --- the fleet: simulated slices with HTTP fronts, in this process -------------------------------------------

def _tenant(slug):
    tenant = TenantFactory(slug=slug, max_slices=8, max_slices_per_tier=8, max_memory_gb=1000)
    return tenant, principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)


def _slice(owner, tier):
    tenant, principal = owner
    a = orders.create_order(principal, tenant=tenant, tier=tier).allocations.get()
    assert provisioning.provision(a.pk) == "activated", Allocation.objects.get(pk=a.pk).failure_reason
    return Allocation.objects.get(pk=a.pk)


def _deploy(owner, a, name):
    dep = deployments.deploy(owner[1], a, name, template="tiny-gen")
    assert deployments.load(dep.pk) == "ready", ModelDeployment.objects.get(pk=dep.pk).failure_reason
    return dep


@pytest.fixture
def stream(settings, private_redis):
    """This process's consumer (metering.consume) and every subprocess on the private Redis and one stream."""
    settings.REDIS_URL = private_redis.url
    settings.TESSERA_USAGE_STREAM = f"tessera:test-usage:{uuid.uuid4().hex[:8]}"
    return settings.TESSERA_USAGE_STREAM


@pytest.fixture
def fleet(settings, sim_dir, h100_node, tiers, stream):
    settings.TESSERA_SIM_TRITON_HTTP = True  # before provisioning: the slices answer HTTP
    serving.reset_runtimes()
    a_owner, b_owner = _tenant("alpha"), _tenant("bravo")
    gen = _deploy(a_owner, _slice(a_owner, tiers["1g"]), "tiny-gen")
    b_gen = _deploy(b_owner, _slice(b_owner, tiers["1g"]), "tiny-gen")
    yield {"a": a_owner[0], "b": b_owner[0], "gen": gen, "b_gen": b_gen}
    sim_http.stop_all()


@pytest.fixture
def child_env(settings, stream, private_redis):
    """The environment of the gateway and consumer processes: the test database, the private Redis."""
    return {**os.environ, "DATABASE_URL": database_url(), "REDIS_URL": private_redis.url,
            "CELERY_BROKER_URL": private_redis.url, "TESSERA_USAGE_STREAM": stream,
            "SECRET_KEY": settings.SECRET_KEY,  # the slices' secret headers are derived from it
            "TESSERA_GATEWAY_REFRESH_S": "0.5", "LOG_FORMAT": "text", "LOG_LEVEL": "WARNING"}


@pytest.fixture
def gateways(child_env, tmp_path):
    """Start ``n`` gateway processes at once (they start in parallel: each is a Django + uvicorn start)."""
    started: list[GatewayProcess] = []

    def start(n: int) -> list[GatewayProcess]:
        procs = [GatewayProcess(child_env, tmp_path) for _ in range(n)]
        errors: list[BaseException] = []

        def one(g):
            try:
                g.start()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(g,)) for g in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        started.extend(procs)
        if errors:
            raise errors[0]
        return procs

    yield start
    for g in started:
        g.stop()


def _key(tenant, rpm: int) -> str:
    key, secret = make_key(tenant, ["inference"])
    ApiKey.objects.filter(pk=key.pk).update(requests_per_minute=rpm)
    return secret


class Conn:
    """One keep-alive HTTP/1.1 connection to a gateway (reopened after an error)."""

    def __init__(self, gw: GatewayProcess, key: str) -> None:
        self.port, self.key = gw.port, key
        self.c: http.client.HTTPConnection | None = None

    def chat(self) -> tuple[int, str | None, dict]:
        if self.c is None:
            self.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            self.c.request("POST", "/v1/chat/completions", body=json.dumps(CHAT),
                           headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
            resp = self.c.getresponse()
            body = json.loads(resp.read() or b"{}")
            return resp.status, resp.getheader("x-request-id"), body
        except (OSError, http.client.HTTPException):
            self.c.close()
            self.c = None
            raise


def _events() -> dict[str, tuple]:
    connection.close()  # a fresh connection: see the consumer process's commits
    rows = UsageEvent.objects.values_list("event_id", "tenant_id", "deployment_id", "input_tokens", "output_tokens",
                                          "requests")
    return {r[0]: r[1:] for r in rows}


def _hourly_requests() -> int:
    return UsageHourly.objects.aggregate(n=Sum("requests"))["n"] or 0


# --- (a) one limit and exact metering across two gateway processes ------------------------------------------

def test_request_limit_and_metering_are_shared_by_two_gateway_processes(fleet, gateways):
    key = _key(fleet["a"], rpm=10)
    gw1, gw2 = gateways(2)
    conns = [Conn(gw1, key), Conn(gw2, key)]
    served = []  # every 200, whichever attempt: each must be metered
    for _attempt in range(2):
        if time.time() % 60 > 55:  # 16 requests take well under a second; never straddle a minute window
            time.sleep(60.5 - time.time() % 60)
        minute = int(time.time() // 60)
        answers = [conns[i % 2].chat() for i in range(16)]  # alternating: 8 to each process
        served += [rid for s, rid, _ in answers if s == 200]
        if int(time.time() // 60) == minute:
            break
        key = _key(fleet["a"], rpm=10)  # the window turned anyway: again with a fresh key (and its own counter)
        time.sleep(1.5)  # both gateways reload their keys every 0.5 s
        conns = [Conn(gw1, key), Conn(gw2, key)]
    else:
        pytest.fail("could not fit 16 requests into one minute window")

    statuses = [s for s, _, _ in answers]
    assert statuses == [200] * 10 + [429] * 6, statuses  # 10 admitted in all, not 10 per process
    assert {b["error"]["code"] for s, _, b in answers if s == 429} == {"request_rate_limit"}
    ok = [rid for s, rid, _ in answers if s == 200]
    assert len(set(ok)) == 10 and all(ok)

    assert metering.consume(budget_s=10) == {"processed": len(served), "new": len(served), "refused": 0}
    events = _events()
    assert sorted(events) == sorted(served)  # every 200 has its event (x-request-id = event id); a 429 has none
    assert set(events.values()) == {(fleet["a"].pk, fleet["gen"].pk, 5, 2, 1)}
    assert _hourly_requests() == len(served)
    assert metering.consume(budget_s=2) == {"processed": 0, "new": 0, "refused": 0}


# --- (b) a gateway process SIGKILLed during concurrent load ------------------------------------------------

def test_gateway_killed_under_load_loses_no_served_event_and_counts_none_twice(fleet, gateways, private_redis):
    key = _key(fleet["a"], rpm=1_000_000)
    gw1, gw2 = gateways(2)
    lock, stop, killed = threading.Lock(), threading.Event(), threading.Event()
    ok: list[tuple[str, int]] = []  # (x-request-id, port) of every 200
    failed = {gw1.port: 0, gw2.port: 0}  # requests that got no answer (connection reset/refused)
    other: list[int] = []

    def client(n: int) -> None:
        conns = [Conn(gw1, key), Conn(gw2, key)]
        i = n
        while not stop.is_set():
            conn = conns[i % 2]
            i += 1
            if killed.is_set() and conn.port == gw1.port:
                continue  # gw1 is gone: its clients have moved to gw2
            try:
                status, rid, _ = conn.chat()
            except (OSError, http.client.HTTPException):
                with lock:
                    failed[conn.port] += 1
                time.sleep(0.01)
                continue
            with lock:
                (ok.append((rid, conn.port)) if status == 200 else other.append(status))

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(1 for _, p in ok if p == gw1.port) >= 50, 20, "gw1 serving under load")
    gw1.kill()  # SIGKILL with requests in flight: no shutdown, no drain
    killed.set()
    with lock:
        served_by_gw1 = sum(1 for _, p in ok if p == gw1.port)
    wait_for(lambda: sum(1 for _, p in ok if p == gw2.port) >= served_by_gw1 + 50, 20, "gw2 serving after the kill")
    stop.set()
    for t in threads:
        t.join(30)
    assert not other, f"answers other than 200: {sorted(set(other))}"
    assert served_by_gw1 >= 50 and failed[gw2.port] == 0

    result = metering.consume(budget_s=20)
    assert result["processed"] == result["new"]  # no event appended twice
    events = _events()
    rids = [rid for rid, _ in ok]
    assert len(set(rids)) == len(rids)
    missing = set(rids) - set(events)
    assert not missing, f"{len(missing)} answers with 200 have no usage event"
    # events without a 200 can only be requests gw1 had recorded when it was killed, before its answer went out
    assert len(events) - len(rids) <= failed[gw1.port], (len(events), len(rids), failed)
    assert set(events.values()) == {(fleet["a"].pk, fleet["gen"].pk, 5, 2, 1)}
    assert _hourly_requests() == len(events)
    assert metering.consume(budget_s=2) == {"processed": 0, "new": 0, "refused": 0}
    # what the killed gateway had in flight still holds the tenant's concurrency slots (until limits.stale_s())
    held = private_redis.client().zcard(f"{limits.PREFIX}conc:{fleet['a'].pk}")
    print(f"{len(rids)} answers with 200 ({served_by_gw1} from the killed gateway), {failed[gw1.port]} requests cut "
          f"off by the kill, {len(events) - len(rids)} events recorded for requests whose answer was cut off, "
          f"{held} concurrency slots still held")


# --- (c) the consumer killed mid-batch, Redis killed between appends and consumption -------------------------

class Consumer:
    """``manage.py usage_consumer`` as a process of its own."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Consumer:
        self.proc = subprocess.Popen([sys.executable, "manage.py", "usage_consumer"], cwd=ROOT, env=self.env,
                                     stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


def _append(events: list[dict], redis_url: str, stream: str) -> None:
    """Append through the gateway's own sink (what every served request does), on its own event loop."""
    import redis.asyncio as aioredis

    async def run():
        r = aioredis.Redis.from_url(redis_url)
        sink = RedisStreamSink(r, stream)
        await sink.start()
        for i in range(0, len(events), 1000):
            await asyncio.gather(*(sink.append(e) for e in events[i:i + 1000]))
        await sink.close()
        await r.aclose()

    run_async(run)


def _pending(r, stream: str) -> int:
    import redis

    try:
        return int(r.xpending(stream, GROUP)["pending"])
    except redis.ResponseError:  # no group yet: the consumer has not started reading
        return 0


def test_consumer_killed_mid_batch_and_redis_restarted_lose_and_double_nothing(fleet, gateways, private_redis,
                                                                               stream, child_env, tmp_path):
    key = _key(fleet["a"], rpm=1_000_000)
    (gw,) = gateways(1)
    conn = Conn(gw, key)
    served = [conn.chat() for _ in range(20)]  # real requests through a gateway process ...
    assert [s for s, _, _ in served] == [200] * 20
    served_ids = {rid for _, rid, _ in served}
    # ... and 20,000 more events through the same sink, for two tenants, so a batch (5,000) takes a while
    now = time.time()
    synthetic = [metering.event(f"syn-{i:05d}", t.pk, d.pk, 3, 7, ts=now)
                 for i, (t, d) in enumerate([(fleet["a"], fleet["gen"]), (fleet["b"], fleet["b_gen"])] * 10_000)]
    _append(synthetic, private_redis.url, stream)
    expected = served_ids | {e["id"] for e in synthetic}
    r = private_redis.client()
    assert r.xlen(stream) == len(expected) == 20_020

    private_redis.kill9()  # Redis dies with everything appended and nothing consumed ...
    down = conn.chat()
    assert down[0] == 503, "answered while its limits and usage could not be recorded"  # limits_unavailable
    private_redis.start()  # ... and comes back from its AOF on the same directory
    r = private_redis.client()
    assert r.xlen(stream) == 20_020
    # The gateway reconnects by itself (a pooled connection Redis closed is retried once on a new one): every
    # request after the restart is answered, and every answer is recorded, as before the restart.
    after = [conn.chat() for _ in range(10)]
    assert [s for s, _, _ in after] == [200] * 10, [(s, b) for s, _, b in after]
    expected |= {rid for s, rid, _ in after if s == 200}
    a_events = 10_020 + sum(1 for s, _, _ in after if s == 200)

    # The consumer process, SIGKILLed while it holds a batch it read and has not acked (mid-batch).
    pending_at_kill = stored_at_kill = 0
    for attempt in range(3):
        first = Consumer(child_env, tmp_path / f"consumer-{attempt}.log").start()
        try:
            # holding a batch, with events of this run already written (of an earlier batch, or of this one)
            wait_for(lambda: first.proc.poll() is not None or (_pending(r, stream) > 0  # noqa: B023
                                                              and UsageEvent.objects.exists()), 30,
                     "the consumer holding a batch", interval=0.005)
        finally:
            first.kill()
        pending_at_kill = _pending(r, stream)
        if pending_at_kill:
            break
        assert r.xlen(stream), f"the consumer drained the stream before it could be killed:\n{first.tail()}"
    assert pending_at_kill > 0, "never caught the consumer mid-batch"
    stored_at_kill = len(_events())
    assert 0 < stored_at_kill < len(expected)
    # events of the held batch already in the database (the kill fell between its write and its ack): replayed
    written_unacked = stored_at_kill - (len(expected) - r.xlen(stream))

    private_redis.kill9()  # and Redis again, with the dead consumer's batch pending
    private_redis.start()
    r = private_redis.client()
    assert _pending(r, stream) == pending_at_kill
    # The next consumer claims what a dead one left once it has been idle CLAIM_IDLE_MS (30 s); instead of
    # waiting, age the pending entries (XCLAIM ... IDLE re-records their idle time, to the same dead owner).
    held = [p["message_id"] for p in r.xpending_range(stream, GROUP, "-", "+", pending_at_kill)]
    dead = r.xpending_range(stream, GROUP, "-", "+", 1)[0]["consumer"]
    r.xclaim(stream, GROUP, dead, 0, held, idle=metering.CLAIM_IDLE_MS + 5_000, justid=True)

    second = Consumer(child_env, tmp_path / "consumer-restarted.log").start()
    try:
        wait_for(lambda: r.xlen(stream) == 0 and _pending(r, stream) == 0, 60, "the stream drained")
        wait_for(lambda: len(_events()) >= len(expected), 10, "every event stored")
    finally:
        second.stop()
    events = _events()
    assert set(events) == expected  # none lost
    assert len(events) == len(expected) and all(v[-1] == 1 for v in events.values())  # none doubled
    assert UsageEvent.objects.filter(event_id__startswith="syn-").aggregate(
        i=Sum("input_tokens"), o=Sum("output_tokens")) == {"i": 3 * 20_000, "o": 7 * 20_000}
    assert _hourly_requests() == len(expected)  # the hourly totals counted each event once, replayed batch included
    hourly = dict(UsageHourly.objects.values("tenant_id").annotate(n=Sum("requests")).values_list("tenant_id", "n"))
    assert hourly == {fleet["a"].pk: a_events, fleet["b"].pk: 10_000}
    assert metering.consume(budget_s=2) == {"processed": 0, "new": 0, "refused": 0}
    print(f"consumer killed holding {pending_at_kill} entries; {stored_at_kill} events stored by then, "
          f"{written_unacked} of them of the held batch")
