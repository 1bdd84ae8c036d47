"""The money charts' figure_json timed on SQLite test data (a benchmark, not a test: run it explicitly,
``pytest tests/bench/money_figures.py -s``): 16 tenants over 24 hours, cost-per-tier, h100-vs-h200 and
tenant-usage (hourly buckets, TOP_TENANTS + 1 series) built 20 times each; prints the median and best ms."""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import pytest

from telemetry import charts
from tests.unit.test_telemetry import _hour, many_tenants_with_usage, op_p, shop  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


def test_time_money_figures(shop, op_p, tiers):  # noqa: F811
    from django.utils import timezone

    end = _hour(timezone.now())
    start = end - timedelta(hours=24)
    many_tenants_with_usage(tiers["1g"], start, 24, 16)
    params = {"start": start.isoformat(), "end": end.isoformat()}
    for name in ("cost-per-tier", "h100-vs-h200", "tenant-usage"):
        charts.figure_json(name, op_p, params)  # warm (caches, imports)
        runs = []
        for _ in range(20):
            t = time.perf_counter()
            charts.figure_json(name, op_p, params)
            runs.append(1000 * (time.perf_counter() - t))
        print(f"{name:14s} median {statistics.median(runs):7.2f} ms  best {min(runs):7.2f} ms")
