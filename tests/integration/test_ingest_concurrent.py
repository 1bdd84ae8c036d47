"""Two OS processes ingest overlapping batches into the same tenant at the same time (PostgreSQL):
every distinct event is stored once and added to its hour once, whatever the interleaving."""

from __future__ import annotations

import json
import os
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
from tests.fleet_fixtures import make_tier

BATCHES, SIZE = 20, 500
BASE = datetime(2025, 1, 1, tzinfo=UTC)

SCRIPT = r"""
import json, os, sys, time
import django
django.setup()
from tenants.scoping import Principal
from telemetry.services.ingest import ingest_batch

tenant, deps, offset, start_at = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
batches, size = int(sys.argv[5]), int(sys.argv[6])
base = 1735689600  # 2025-01-01T00:00:00Z

def event(n):
    return {"event_id": f"evt-{n:07d}", "deployment": deps[n % len(deps)],
            "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(base + (n % 48) * 3600 + n % 3600)),
            "input_tokens": n % 97, "output_tokens": n % 31, "requests": 1 + n % 3}

principal = Principal(is_operator=True)
while time.time() < start_at:
    time.sleep(0.001)
out = {"new": 0, "duplicates": 0, "first_round": [time.time()]}
for rnd in range(2):  # every batch twice: the second round is all replays
    for k in range(batches):
        first = k * size + offset
        r = ingest_batch(principal, tenant, [event(n) for n in range(first, first + size)])
        assert not r.rejected, r.rejected
        out["new"] += r.new
        out["duplicates"] += r.duplicates
    if rnd == 0:
        out["first_round"].append(time.time())
print(json.dumps(out))
"""


def event_values(n: int) -> tuple[int, datetime, int, int, int]:
    ts = BASE + timedelta(hours=n % 48, seconds=n % 3600)
    return n % 2, ts.replace(minute=0, second=0), n % 97, n % 31, 1 + n % 3


@pytest.mark.django_db(transaction=True)
def test_concurrent_overlapping_batches_leave_exact_totals(catalog, tmp_path):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite serializes writers (one at a time); the concurrent path is PostgreSQL's")
    tier = make_tier("conc-1g", "h100-sxm-80gb", "1g.10gb")
    tenant = TenantFactory(slug="conc")
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
    start_at = time.time() + 3  # both start together, after Django has set up
    offsets = [0, SIZE // 2]  # batch k of the second process overlaps half of batch k of the first
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(tenant.pk), json.dumps(deps), str(off),
                               str(start_at), str(BATCHES), str(SIZE)], cwd=worker_process.ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for off in offsets]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    (s0, e0), (s1, e1) = results[0]["first_round"], results[1]["first_round"]
    assert s0 < e1 and s1 < e0, "the two processes did not run at the same time"
    distinct = sorted({n for off in offsets for k in range(BATCHES) for n in range(k * SIZE + off,
                                                                                  k * SIZE + off + SIZE)})
    sent = 2 * 2 * BATCHES * SIZE
    assert sum(r["new"] for r in results) == len(distinct) == BATCHES * SIZE + SIZE // 2
    assert sum(r["new"] + r["duplicates"] for r in results) == sent
    assert UsageEvent.objects.filter(tenant=tenant).count() == len(distinct)

    expected: dict[tuple, list[int]] = {}
    for n in distinct:
        d, hour, i, o, r = event_values(n)
        e = expected.setdefault((deps[d], hour), [0, 0, 0, 0])
        e[0] += i
        e[1] += o
        e[2] += r
        e[3] += 1
    got = {(h.deployment_id, h.hour): [h.input_tokens, h.output_tokens, h.requests, h.events]
           for h in UsageHourly.objects.filter(tenant=tenant)}
    assert got == expected
    raw = UsageEvent.objects.filter(tenant=tenant).aggregate(i=Sum("input_tokens"), r=Sum("requests"))
    assert raw["i"] == sum(v[0] for v in expected.values()) and raw["r"] == sum(v[2] for v in expected.values())
