"""NodeActivity, the second copy of the GPU samples' activity kept for speed: the database's triggers hold it equal
to the samples summed per (node, resolution, time) whatever writes them (the collector, the downsampler, the pruner,
an update, a delete: property test), and the per-node heatmap read from it is the heatmap read from the samples."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marketplace.models import Gpu
from telemetry import charts
from telemetry.models import GpuSample, NodeActivity
from telemetry.services import downsample
from tenants.scoping import principal_for_user
from tests.fleet_fixtures import make_node

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 10, 1, 12, tzinfo=UTC)


@pytest.fixture
def gpus(catalog, sim_dir):
    """Two registered nodes, three of their GPUs each."""
    out = []
    for host in ("na-1", "na-2"):
        node = make_node(host)
        out += list(Gpu.objects.filter(node=node).order_by("index")[:3])
    return out


def _sample(gpu: Gpu, ts: datetime, activity: float, resolution: str = "raw", samples: int = 1) -> GpuSample:
    return GpuSample(gpu=gpu, resolution=resolution, ts=ts, samples=samples, activity=activity, memory_used_mb=1,
                     memory_total_mb=80, power_w=300, energy_j=1e6, temperature_c=50, sm_clock_mhz=1800, mig=False)


def _from_samples() -> dict[tuple, tuple]:
    node_of = dict(Gpu.objects.values_list("pk", "node_id"))
    out: dict[tuple, list] = defaultdict(lambda: [0.0, 0, 0])
    for s in GpuSample.objects.all():
        acc = out[(node_of[s.gpu_id], s.resolution, s.ts)]
        acc[0] += s.activity * s.samples
        acc[1] += s.samples
        acc[2] += 1
    return {k: (round(v[0], 6), v[1], v[2]) for k, v in out.items()}


def _kept() -> dict[tuple, tuple]:
    return {(r.node_id, r.resolution, r.ts): (round(r.activity_samples, 6), r.samples, r.gpus)
            for r in NodeActivity.objects.all()}


op = st.one_of(
    st.tuples(st.just("collect"), st.integers(0, 5), st.integers(0, 180), st.floats(0, 1)),
    st.tuples(st.just("change"), st.integers(0, 99), st.floats(0, 1), st.integers(1, 60)),
    st.tuples(st.just("move"), st.integers(0, 99), st.integers(0, 180)),
    st.tuples(st.just("delete"), st.integers(0, 99)),
    st.tuples(st.just("downsample"), st.integers(0, 200)),
    st.tuples(st.just("prune"), st.integers(0, 3)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=10))
def test_node_rows_are_the_gpu_samples_summed_whatever_writes_them(gpus, ops):
    with transaction.atomic():
        GpuSample.objects.bulk_create([_sample(g, T0 + timedelta(minutes=m), (g.pk * 7 + m) % 10 / 10)
                                       for g in gpus for m in range(0, 20, 3)])
        for o in ops:
            rows = list(GpuSample.objects.order_by("pk"))
            if o[0] == "collect":
                GpuSample.objects.get_or_create(gpu=gpus[o[1]], resolution="raw", ts=T0 + timedelta(minutes=o[2]),
                                                defaults={"activity": o[3], "memory_used_mb": 1, "memory_total_mb": 80,
                                                          "power_w": 300, "energy_j": 1e6, "temperature_c": 50,
                                                          "sm_clock_mhz": 1800})
            elif o[0] == "downsample":  # the downsampler's rollups (bulk_create, conflicts ignored)
                downsample.downsample(now=T0 + timedelta(minutes=o[1]), grace=timedelta(0))
            elif o[0] == "prune":
                downsample.prune(now=T0 + timedelta(days=o[1]))
            elif rows:
                s = rows[o[1] % len(rows)]
                if o[0] == "change":
                    s.activity, s.samples = o[2], o[3]
                    s.save()
                elif o[0] == "move":
                    if not GpuSample.objects.filter(gpu=s.gpu_id, resolution=s.resolution,
                                                    ts=T0 + timedelta(minutes=o[2])).exists():
                        s.ts = T0 + timedelta(minutes=o[2])
                        s.save()
                else:
                    s.delete()
            assert _kept() == _from_samples(), o
        transaction.set_rollback(True)


def test_the_per_node_heatmap_reads_the_node_rows_and_says_what_the_samples_say(gpus, operator):
    """Two nodes, a day of raw samples rolled up to 5 minutes, raw minutes after the last rollup: the per-node
    heatmap's cells (node rows) equal the samples' own averages per node and bucket, and it read no GPU sample."""
    now = timezone.now().replace(second=0, microsecond=0)
    start = now - timedelta(hours=6)
    GpuSample.objects.bulk_create([_sample(g, start + timedelta(minutes=m), ((g.pk * 13 + m * 7) % 100) / 100)
                                   for g in gpus for m in range(0, 6 * 60)])
    downsample.downsample(now=now - timedelta(minutes=30), grace=timedelta(0))  # the last 30 minutes stay raw
    per = charts.period({"start": start.isoformat(), "end": now.isoformat()})
    step = charts.bucket_step(per, charts.HEATMAP_COLUMNS)
    want: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for r in charts._sample_rows(per):
        b = int(r.ts.timestamp()) // step * step
        acc = want[(r.gpu.node.hostname, b)]
        acc[0] += r.activity * r.samples
        acc[1] += r.samples
    with mock.patch.object(charts, "HEATMAP_ROWS", 4):  # one row per node
        read = []
        from django.db import connection

        with connection.execute_wrapper(lambda ex, sql, *a: read.append(sql) or ex(sql, *a)):
            _fig, data = charts.gpu_heatmap(per, principal_for_user(operator))
    assert data["per_node"] and [g.split(" ")[0] for g in data["gpus"]] == ["na-1", "na-2"]
    assert not any("telemetry_gpusample" in sql for sql in read)
    got = {(label.split(" ")[0], int(datetime.fromisoformat(t).timestamp())): v
           for label, row in zip(data["gpus"], data["z"], strict=True) for t, v in zip(data["ts"], row, strict=True)
           if v is not None}
    assert got == {k: round(100 * w / n, 1) for k, (w, n) in want.items()}
    assert len(got) == 2 * len(data["ts"]) > 20
