"""A Celery node worker killed in the middle of the ingest work that workers do: the Triton statistics
scrape (``tessera.scrape_triton_node`` on the node's own queue; NODE_TASK: acks_late,
reject_on_worker_lost), which folds Triton's cumulative inference counters into TritonServedHourly
through TritonCounter deltas, one transaction per deployment (telemetry/services/scrape.py).

Real services throughout: PostgreSQL, Redis as the broker, real Celery worker processes, and a REAL
tritonserver (the nvidia-pytriton wheel's, CPU only) serving the slice's two models. The real server is
what makes the test faithful: it keeps counting across a worker kill, as a slice's Triton does in
production, while the simulated Triton keeps its counters inside the worker process and would die with
it. The worker provisions the slice and loads the models through its own tasks; the test makes the
inferences with tritonclient and takes the server's own statistics as the truth to compare with.

How the kill lands inside the transaction, deterministically and with no hook in the product code: the
test installs, in the test database only and for the second deployment's rows only, a DEFERRED
constraint trigger on TritonServedHourly. It fires at COMMIT, after every statement of record_counters'
transaction has run (counter row locked, created or moved; hour row inserted or updated); it writes what
the transaction wrote into the backend's application_name and then waits for an advisory lock that the
test holds (as a commit waiting for a synchronous standby would). The test polls pg_stat_activity until
that backend waits there, checks in pg_locks that it holds write locks on both tables, SIGKILLs the
worker, and waits until PostgreSQL has dropped the backend before letting go of the lock, so that
transaction can never commit (the workers connect with client_connection_check_interval set through
PGOPTIONS, so a backend notices its dead client while it waits). Polling alone, as test_ingest_killed
does for a 10,000-event statement, cannot catch this transaction: a handful of short statements, with
microseconds between the last write and COMMIT. The first deployment, scraped first by the same task,
has committed by then: the same kill also lands after a committed transaction and before the task's
ack, the case where a replay must not count twice.

1. solo pool, the whole worker SIGKILLed (the host died): Redis keeps the message unacked; a fresh worker
   restores it once the visibility timeout (5 s here) has passed and runs it again.
2. prefork pool, only the pool child SIGKILLed (the OOM killer's usual pick): reject_on_worker_lost
   requeues the message at once and the surviving worker runs it again in a new child. The visibility
   timeout is an hour there, so nothing else can bring the message back. The rerun is held at the same
   point, which shows the first deployment's committed part was not counted again.
Both end with what the server's statistics say was served counted exactly, once.

Skips, saying why, without PostgreSQL + Redis (tests/faults/conftest.py) or a runnable tritonserver.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import uuid
from dataclasses import dataclass

import psycopg
import pytest
import redis
from django.conf import settings
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from marketplace.hardware.triton import HttpTritonBackend
from marketplace.models import Allocation, ModelDeployment, TritonServer
from marketplace.services import deployments, orders, serving
from telemetry import tasks
from telemetry.models import TritonCounter, TritonServedHourly
from tenants.roles import Role
from tenants.scoping import principal_for_user
from tests import worker_process
from tests.factories import MembershipFactory, TenantFactory
from tests.faults.conftest import needs_real_services
from tests.fleet_fixtures import make_node, make_tier
from tests.triton_server import tritonserver_available
from tests.worker_process import Worker, wait_for

AVAILABLE, REASON = tritonserver_available()

pytestmark = [
    needs_real_services,
    pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}"),
    pytest.mark.worker,
    pytest.mark.triton,
    pytest.mark.django_db(transaction=True),
]

# a backend waiting on a lock checks every 200 ms whether its client is still there
WORKER_PGOPTIONS = "-c client_connection_check_interval=200"
HOURLY = TritonServedHourly._meta.db_table
COUNTER = TritonCounter._meta.db_table
SUCCEEDED = re.compile(r"Task tessera\.scrape_triton_node\[(?P<id>[0-9a-f-]+)\] succeeded in \S+: (?P<result>\{.*\})")


@dataclass
class Held:
    pid: int
    deployment: int
    requests: int  # what the held transaction wrote into the hour row
    locks: set[tuple[str, str]]


class HeldCommit:
    """Holds the COMMIT of any transaction that wrote ``dep``'s TritonServedHourly row (see the module
    docstring), until release(). Test database only; removed on exit whatever happened."""

    def __init__(self, dep: ModelDeployment):
        self.dep, self.key = dep, 7_700_000 + dep.pk
        self.fn, self.trigger = f"tessera_test_hold_{dep.pk}", f"tessera_test_hold_{dep.pk}"
        self.conn = psycopg.connect(worker_process.test_database_url(), autocommit=True)
        self.holding = False

    def __enter__(self) -> HeldCommit:
        try:
            self._install()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _install(self) -> None:
        self.conn.execute("SELECT pg_advisory_lock(%s)", [self.key])
        self.holding = True
        self.conn.execute(f"DROP TRIGGER IF EXISTS {self.trigger} ON {HOURLY}")  # left by a crashed run
        self.conn.execute(f"""
            CREATE OR REPLACE FUNCTION {self.fn}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              PERFORM set_config('application_name',
                                 format('held-by-test dep=%s requests=%s', NEW.deployment_id, NEW.requests), true);
              PERFORM pg_advisory_xact_lock({self.key});
              RETURN NULL;
            END $$""")
        self.conn.execute(f"""
            CREATE CONSTRAINT TRIGGER {self.trigger} AFTER INSERT OR UPDATE ON {HOURLY}
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.deployment_id = {self.dep.pk})
            EXECUTE FUNCTION {self.fn}()""")

    def wait_held(self, worker: Worker, not_pid: int | None = None, timeout: float = 60) -> Held:
        """The backend whose COMMIT waits here (not ``not_pid``), with the table locks it holds."""
        def held():
            return self.conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name LIKE 'held-by-test %%' AND wait_event_type = 'Lock' "
                "AND wait_event = 'advisory' AND backend_xid IS NOT NULL AND pid <> %s", [not_pid or 0]).fetchone()

        pid, name = wait_for(held, timeout, "the scrape transaction to be held at its COMMIT", worker, 0.02)
        m = re.fullmatch(r"held-by-test dep=(\d+) requests=(\d+)", name)
        locks = set(self.conn.execute(
            "SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE l.pid = %s AND l.granted AND c.relname IN (%s, %s)", [pid, HOURLY, COUNTER]).fetchall())
        return Held(pid=pid, deployment=int(m[1]), requests=int(m[2]), locks=locks)

    def backend_alive(self, pid: int) -> bool:
        return self.conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() is not None

    def wait_gone(self, pid: int, timeout: float = 30) -> None:
        """PostgreSQL noticed the dead client and rolled its transaction back (must come before release())."""
        wait_for(lambda: not self.backend_alive(pid), timeout, f"PostgreSQL to drop the killed worker's backend {pid}")

    def release(self) -> None:
        if self.holding:
            self.conn.execute("SELECT pg_advisory_unlock(%s)", [self.key])
            self.holding = False
        self.conn.execute(f"DROP TRIGGER IF EXISTS {self.trigger} ON {HOURLY}")
        self.conn.execute(f"DROP FUNCTION IF EXISTS {self.fn}()")

    def __exit__(self, *exc: object) -> None:
        try:
            self.release()
        finally:
            self.conn.close()


class Scene:
    """A node with one active 3g slice whose real tritonserver serves the slice's model repository."""

    def __init__(self, sim_dir, tmp_path, stack: contextlib.ExitStack):
        self.sim_dir, self.tmp = sim_dir, tmp_path
        self.node = make_node(f"sk-{uuid.uuid4().hex[:8]}")
        tenant = TenantFactory(max_slices=8, max_slices_per_tier=8, max_memory_gb=1000)
        self.principal = principal_for_user(MembershipFactory(tenant=tenant, role=Role.OWNER).user)
        self.hour_at_start = self.hour_now()
        # the provisioning task goes to the node queue now; the worker started by the test runs it
        self.alloc = orders.create_order(self.principal, tenant=tenant,
                                         tier=make_tier("sk-3g", "h100-sxm-80gb", "3g.40gb")).allocations.get()
        # the worker starts the slice's real tritonserver itself (serving runtime "process"); the test reads
        # the server's own statistics through its URL once the slice is active
        self.triton: HttpTritonBackend | None = None
        stack.callback(self.stop_server)
        self.workers: list[Worker] = []
        self.broker = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=5)
        stack.callback(self.broker.close)

    @staticmethod
    def hour_now():
        return timezone.now().replace(minute=0, second=0, microsecond=0)

    def worker(self, pool: str = "solo", **env: str) -> Worker:
        w = Worker(self.node.queue, self.sim_dir / "sim", self.tmp / f"worker-{len(self.workers)}.log",
                   TESSERA_TRITON_BACKEND="http", TESSERA_SERVING_RUNTIME="process", TESSERA_SERVING_ISOLATE="0",
                   PGOPTIONS=WORKER_PGOPTIONS)
        self.workers.append(w)
        return w.start(pool, **env)

    def stop_server(self) -> None:
        """The slice's tritonserver outlives the killed workers (its own session, as on a node): stop it."""
        if self.triton is not None:
            self.triton.close()
        server = TritonServer.objects.filter(allocation_id=self.alloc.pk).first()
        if server is not None and server.pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.pid, signal.SIGKILL)

    def stop_workers(self) -> None:
        # SIGTERM (warm shutdown), not SIGKILL: a worker killed while it restores unacked messages leaves
        # kombu's unacked_mutex behind, and no worker on this Redis db restores anything until it expires
        for w in self.workers:
            w.stop()

    def clear_stale_restore_mutex(self) -> None:
        """kombu takes ``unacked_mutex`` (expiry 300 s) for the milliseconds a restore scan lasts; one
        held for over 10 s was left by a worker killed mid-scan (by an earlier test) and would hold back
        the redelivery this test waits for. Deleting it is what its expiry would do later."""
        expire = 300  # kombu's Channel.unacked_mutex_expire, which the settings keep
        ttl = self.broker.ttl("unacked_mutex")
        if 0 <= ttl < expire - 10:
            self.broker.delete("unacked_mutex")
            print(f"\ndeleted a stale kombu unacked_mutex (ttl {ttl} s)")

    def deploy(self, names: list[str], worker: Worker) -> list[ModelDeployment]:
        """Slice active, then each model deployed; the worker loads them on the real server."""
        wait_for(lambda: Allocation.objects.get(pk=self.alloc.pk).state == Allocation.State.ACTIVE, 90,
                 "the slice to be active", worker)
        alloc = Allocation.objects.get(pk=self.alloc.pk)
        assert alloc.triton_url, "an active slice has its server's URL"
        server = TritonServer.objects.get(allocation=alloc)  # every API of the server needs its secret
        self.triton = HttpTritonBackend(alloc.triton_url, alloc.triton_metrics_url,
                                        headers=serving.admin_headers(server))
        deps = [deployments.deploy(self.principal, alloc, name, template="tiny-gen") for name in names]
        for d in deps:
            wait_for(lambda d=d: ModelDeployment.objects.get(pk=d.pk).state == ModelDeployment.State.READY, 90,
                     f"model {d.name} ready", worker)
        assert [self.triton.is_model_ready(d.name) for d in deps] == [True] * len(deps)
        assert deps == sorted(deps, key=lambda d: d.pk)  # scrape_node goes by pk: the first commits first
        return deps

    def stats(self, dep: ModelDeployment) -> int:
        return self.triton.statistics(dep.name)["inference_count"]

    def infer(self, dep: ModelDeployment, n: int) -> int:
        """n requests on the real server; returns its inference_count after them."""
        before = self.stats(dep)
        for i in range(n):
            out = self.triton.infer_text(dep.name, f"request {i} for {dep.name}", max_tokens=2)
            assert out["output_tokens"] == 2
        # Triton records a request's statistics when it releases it, a moment after the response
        wait_for(lambda: self.stats(dep) >= before + n, 10, f"Triton to count {n} more for {dep.name}")
        assert self.stats(dep) == before + n
        return before + n

    def scrape(self) -> str:
        return tasks.scrape_triton_node.apply_async(args=[self.node.pk], queue=self.node.queue).id

    @staticmethod
    def results(worker: Worker, task_id: str) -> list[dict]:
        """What each successful run of ``task_id`` in this worker's log returned."""
        text = worker.log_path.read_text(errors="replace")
        return [ast.literal_eval(m["result"]) for m in SUCCEEDED.finditer(text) if m["id"] == task_id]

    def wait_succeeded(self, worker: Worker, task_id: str, timeout: float) -> dict:
        try:
            runs = wait_for(lambda: self.results(worker, task_id), timeout, f"scrape {task_id} to succeed", worker)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- broker ---\n{self.broker_state()}") from None
        assert len(runs) == 1, runs
        return runs[0]

    def broker_state(self) -> str:
        b = self.broker
        return (f"unacked={b.hlen('unacked')} index={b.zrange('unacked_index', 0, -1, withscores=True)} "
                f"mutex_ttl={b.ttl('unacked_mutex')} queued={b.llen(self.node.queue)} now={timezone.now().timestamp()}")

    def unacked(self, task_id: str) -> bool:
        """The message is in kombu's unacked hash: delivered, not acknowledged."""
        return any(task_id.encode() in v for v in self.broker.hvals("unacked"))

    @staticmethod
    def served(dep: ModelDeployment) -> int:
        return TritonServedHourly.objects.filter(deployment=dep).aggregate(r=Sum("requests"))["r"] or 0

    @staticmethod
    def counter(dep: ModelDeployment) -> list[int]:
        return list(TritonCounter.objects.filter(deployment=dep).values_list("inference_count", flat=True))

    def assert_exact(self, dep: ModelDeployment, expected: int) -> None:
        """Served = what the real server counted = what the test sent; one counter row at that value;
        one hour row (two only where the test crossed an hour boundary), nothing failed."""
        assert self.stats(dep) == expected
        assert self.served(dep) == expected, (dep.name, self.served(dep), expected)
        assert self.counter(dep) == [expected]
        hours = list(TritonServedHourly.objects.filter(deployment=dep).values_list("hour", "requests", "failures"))
        assert all(f == 0 for _h, _r, f in hours)
        assert len(hours) == (1 if self.hour_now() == self.hour_at_start else len({h for h, _r, _f in hours}))
        assert len(hours) <= 2


@pytest.fixture
def scene(catalog, sim_dir, tmp_path, settings):
    if connection.pg_version < 140000:
        pytest.skip(f"needs PostgreSQL 14+ (client_connection_check_interval); this is {connection.pg_version}")
    settings.TESSERA_TRITON_BACKEND = "http"
    with contextlib.ExitStack() as stack:
        s = Scene(sim_dir, tmp_path, stack)
        stack.callback(s.stop_workers)  # before the server stops (ExitStack unwinds last-in first)
        yield s


def test_worker_killed_inside_the_scrape_transaction_counts_exactly_once(scene):
    w1 = scene.worker("solo")
    d1, d2 = scene.deploy(["gen-a", "gen-b"], w1)
    n1, n2 = scene.infer(d1, 7), scene.infer(d2, 4)

    with HeldCommit(d2) as hold:
        task_id = scene.scrape()
        held = hold.wait_held(w1)
        # inside the transaction, every statement run: the counter was created and moved, the hour row
        # inserted with all of d2's requests; the worker is at COMMIT, nothing of it committed yet
        assert (held.deployment, held.requests) == (d2.pk, n2)
        assert {(COUNTER, "RowExclusiveLock"), (HOURLY, "RowExclusiveLock")} <= held.locks
        assert scene.counter(d2) == [] and scene.served(d2) == 0
        # d1, scraped first by the same task, has committed; the task is not acked
        assert scene.counter(d1) == [n1] and scene.served(d1) == n1
        assert scene.unacked(task_id)
        w1.kill()
        hold.wait_gone(held.pid)
        hold.release()
        assert w1.proc.returncode == -signal.SIGKILL

    # nothing half-written: d2 has neither a counter nor an hour; d1's committed scrape stays
    assert scene.counter(d2) == [] and not TritonServedHourly.objects.filter(deployment=d2).exists()
    assert scene.counter(d1) == [n1] and scene.served(d1) == n1
    assert scene.unacked(task_id)  # the dead worker never acknowledged it

    m1, m2 = 5, 3  # the server keeps serving while no worker runs
    total1, total2 = scene.infer(d1, m1), scene.infer(d2, m2)
    scene.clear_stale_restore_mutex()
    w2 = scene.worker("solo")  # restores the unacked message after the visibility timeout
    replay = scene.wait_succeeded(w2, task_id, 120)
    # the replay adds only what d1 served since its committed scrape, and all of d2
    assert replay == {"deployments": 2, "requests": m1 + n2 + m2, "failures": 0, "errors": 0, "mismatches": 0}
    scene.assert_exact(d1, total1)
    scene.assert_exact(d2, total2)
    assert not scene.unacked(task_id)

    nxt = scene.scrape()  # the next scheduled scrape: nothing new was served, nothing is added
    assert scene.wait_succeeded(w2, nxt, 60) == {"deployments": 2, "requests": 0, "failures": 0, "errors": 0,
                                                 "mismatches": 0}
    scene.assert_exact(d1, total1)
    scene.assert_exact(d2, total2)
    print(f"\nheld backend {held.pid} at COMMIT (d2 requests={held.requests}); N=({n1}, {n2}) M=({m1}, {m2}); "
          f"replay added {replay['requests']}; served {scene.served(d1)} + {scene.served(d2)}")


def test_pool_child_killed_inside_the_scrape_transaction_is_requeued_and_counts_exactly_once(scene):
    # an hour: only reject_on_worker_lost can bring the message back within this test
    w = scene.worker("prefork", CELERY_VISIBILITY_TIMEOUT="3600")
    d1, d2 = scene.deploy(["gen-a", "gen-b"], w)
    n1, n2 = scene.infer(d1, 6), scene.infer(d2, 3)
    first = scene.scrape()
    assert scene.wait_succeeded(w, first, 60)["requests"] == n1 + n2
    total1, total2 = scene.infer(d1, 4), scene.infer(d2, 5)  # M = (4, 5)

    with HeldCommit(d2) as hold:
        task_id = scene.scrape()
        held = hold.wait_held(w)
        # the killed transaction moves existing rows: d2's hour row updated to its new total
        assert (held.deployment, held.requests) == (d2.pk, total2)
        assert {(COUNTER, "RowExclusiveLock"), (HOURLY, "RowExclusiveLock")} <= held.locks
        assert scene.counter(d1) == [total1] and scene.served(d1) == total1  # committed before the kill
        assert scene.counter(d2) == [n2] and scene.served(d2) == n2
        children = w.pool_pids()
        assert len(children) == 1, children
        os.kill(children[0], signal.SIGKILL)
        hold.wait_gone(held.pid)
        assert scene.counter(d2) == [n2] and scene.served(d2) == n2  # nothing of it committed
        # requeued at once; the new child reruns the task and is held at the same point: by then its d1
        # transaction has committed, and d1 is not counted twice
        again = hold.wait_held(w, not_pid=held.pid)
        assert (again.deployment, again.requests) == (d2.pk, total2)
        assert scene.counter(d1) == [total1] and scene.served(d1) == total1
        assert w.proc.poll() is None and w.pool_pids() not in ([], children)  # same worker, new child
        hold.release()  # the rerun commits

    rerun = scene.wait_succeeded(w, task_id, 60)
    assert rerun == {"deployments": 2, "requests": total2 - n2, "failures": 0, "errors": 0, "mismatches": 0}
    assert "WorkerLostError" in w.log_path.read_text(errors="replace")
    scene.assert_exact(d1, total1)
    scene.assert_exact(d2, total2)

    total1, total2 = scene.infer(d1, 2), scene.infer(d2, 1)
    nxt = scene.scrape()
    assert scene.wait_succeeded(w, nxt, 60) == {"deployments": 2, "requests": 3, "failures": 0, "errors": 0,
                                                "mismatches": 0}
    scene.assert_exact(d1, total1)
    scene.assert_exact(d2, total2)
    print(f"\nheld backend {held.pid}, child {children[0]} killed; rerun held as {again.pid}; "
          f"served {scene.served(d1)} + {scene.served(d2)}")
