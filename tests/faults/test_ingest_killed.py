"""A process killed (SIGKILL) in the middle of ingesting a 10,000-event batch -> nothing of that batch
is counted; replaying the same batch afterwards counts every event exactly once.

(Celery workers killed: during provisioning -> converges: tests/integration/test_worker.py::
test_worker_killed_mid_provision_converges_without_orphans; during the ingest work workers do, the Triton
statistics scrape, inside its transaction and after a commit before the ack -> served counted exactly
once: tests/faults/test_worker_killed_scrape.py. Neither is repeated here.)

The ingesting process is a real OS process on the test database. It reports its PostgreSQL backend pid;
the test polls pg_stat_activity until that backend is inside the ingest transaction (it has a
transaction id and its statement is the INSERT .. ON CONFLICT .. RETURNING that writes the events and
upserts their hours, running or just done, before COMMIT) and then SIGKILLs the process, so the kill lands
mid-transaction after rows were written, not before or after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.db.models import Sum

from marketplace.models import Allocation, ModelDeployment, Order
from telemetry.models import UsageEvent, UsageHourly
from tests import worker_process
from tests.factories import TenantFactory
from tests.faults.conftest import needs_real_services
from tests.fleet_fixtures import make_tier

pytestmark = [needs_real_services, pytest.mark.django_db(transaction=True)]

N = 10_000
BASE = datetime(2025, 1, 1, tzinfo=UTC)

SCRIPT = r"""
import json, sys, time
import django
django.setup()
from django.db import connection
from tenants.scoping import Principal
from telemetry.services.ingest import ingest_batch

tenant, deps, n = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
base = 1735689600  # 2025-01-01T00:00:00Z
events = [{"event_id": f"kill-{i:06d}", "deployment": deps[i % len(deps)],
           "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(base + (i % 48) * 3600 + i % 3600)),
           "input_tokens": i % 97, "output_tokens": i % 31, "requests": 1 + i % 3} for i in range(n)]
with connection.cursor() as cur:
    cur.execute("SELECT pg_backend_pid()")
    print(cur.fetchone()[0], flush=True)
r = ingest_batch(Principal(is_operator=True), tenant, events)
print(json.dumps(r.as_dict()), flush=True)
"""


def expected_hours(deps):
    exp: dict[tuple, list[int]] = {}
    for i in range(N):
        ts = BASE + timedelta(hours=i % 48, seconds=i % 3600)
        e = exp.setdefault((deps[i % len(deps)], ts.replace(minute=0, second=0)), [0, 0, 0, 0])
        e[0] += i % 97
        e[1] += i % 31
        e[2] += 1 + i % 3
        e[3] += 1
    return exp


def hours_of(tenant):
    return {(h.deployment_id, h.hour): [h.input_tokens, h.output_tokens, h.requests, h.events]
            for h in UsageHourly.objects.filter(tenant=tenant)}


def backend(pid):
    with connection.cursor() as cur:
        # inside the transaction, at (or just after) the statement that writes the events and their hours
        cur.execute("SELECT backend_xid IS NOT NULL AND position('WITH ins AS' IN query) > 0, state "
                    "FROM pg_stat_activity WHERE pid = %s", [pid])
        return cur.fetchone()


def test_ingest_killed_mid_transaction_then_replayed_counts_exactly_once(catalog):
    tier = make_tier("kill-1g", "h100-sxm-80gb", "1g.10gb")
    tenant = TenantFactory(slug="kill")
    order = Order.objects.create(tenant=tenant, tier=tier)
    deps = []
    for i in range(2):
        alloc = Allocation.objects.create(order=order, tenant=tenant, tier=tier, state=Allocation.State.ACTIVE)
        deps.append(ModelDeployment.objects.create(allocation=alloc, tenant=tenant, name=f"m{i}", backend="python",
                                                   spec={}, memory_mb=1, state=ModelDeployment.State.READY,
                                                   created_at=datetime(2024, 12, 1, tzinfo=UTC)).pk)
    env = {**os.environ, "DATABASE_URL": worker_process.test_database_url(),
           "DJANGO_SETTINGS_MODULE": "marketplace.settings", "LOG_LEVEL": "WARNING",
           "PYTHONPATH": str(worker_process.ROOT)}
    argv = [sys.executable, "-c", SCRIPT, str(tenant.pk), json.dumps(deps), str(N)]

    def spawn():
        return subprocess.Popen(argv, cwd=worker_process.ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    landed = []  # what the backend was running when a kill landed inside the transaction
    for _attempt in range(10):
        proc = spawn()
        pid = int(proc.stdout.readline())
        seen = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            row = backend(pid)
            if row and row[0]:
                os.kill(proc.pid, signal.SIGKILL)
                seen = f"the events+hours upsert, backend {row[1]}"
                break
            time.sleep(0.002)
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
        deadline = time.monotonic() + 30  # the server notices the dead client and rolls back
        while backend(pid) is not None:
            assert time.monotonic() < deadline, "the killed client's backend is still there"
            time.sleep(0.05)
        stored = UsageEvent.objects.filter(tenant=tenant).count()
        assert stored in (0, N), f"a killed ingest left {stored} of {N} events: a partial batch"
        if stored == 0:
            assert UsageHourly.objects.filter(tenant=tenant).count() == 0, "hours counted without their events"
            if seen is not None:
                landed.append(seen)
                break
        else:  # the commit won the race with the kill: all of it, exactly; start over
            assert hours_of(tenant) == expected_hours(deps)
            UsageEvent.objects.filter(tenant=tenant).delete()
            UsageHourly.objects.filter(tenant=tenant).delete()
    assert landed, "no SIGKILL landed inside the ingest transaction in 10 tries"

    # replay the very same batch twice: counted once
    for round_, want in ((1, {"new": N, "duplicates": 0}), (2, {"new": 0, "duplicates": N})):
        proc = spawn()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert {k: result[k] for k in want} == want, (round_, result)
        assert not result["rejected"]
    assert UsageEvent.objects.filter(tenant=tenant).count() == N
    exp = expected_hours(deps)
    assert hours_of(tenant) == exp
    raw = UsageEvent.objects.filter(tenant=tenant).aggregate(i=Sum("input_tokens"), o=Sum("output_tokens"))
    assert raw == {"i": sum(v[0] for v in exp.values()), "o": sum(v[1] for v in exp.values())}
    print(f"SIGKILL landed while the backend ran: {landed[0]!r}")
