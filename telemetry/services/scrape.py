"""Triton statistics scraper (runs on the node's own queue: the only code that talks to the node's
Triton servers). For each ready model on the node's active slices it reads the cumulative
inference_count / fail_count and model execution time (batch_stats), takes the increase since the
last scrape (TritonCounter) and adds it to the current hour's TritonServedHourly. A counter that went
down means the server restarted: the new value is all that was served since. The first scrape of a
deployment counts everything since it was loaded (Tessera loads every model itself, so the counters
start at its deployment)."""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from marketplace.models import Allocation, ModelDeployment, Node
from marketplace.services.deployments import backend_for
from telemetry.models import TritonCounter, TritonServedHourly

log = logging.getLogger("tessera.scrape")


def _delta(new: int, old: int | None) -> int:
    if old is None:
        return new
    return new - old if new >= old else new  # went down: the server restarted


def record_counters(dep: ModelDeployment, inference_count: int, fail_count: int,
                    now: datetime | None = None, execution_ns: int = 0) -> tuple[int, int]:
    """Fold one cumulative reading into the counter and the current hour; returns (requests, failures)
    added. ``execution_ns`` is the cumulative model execution time (batch_stats), folded the same way.
    Safe against a concurrent scrape of the same deployment (the counter row is locked)."""
    now = now or timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    with transaction.atomic():
        counter = TritonCounter.objects.select_for_update().filter(deployment=dep).first()
        if counter is None:
            try:
                with transaction.atomic():
                    counter = TritonCounter.objects.create(deployment=dep, inference_count=0, fail_count=0,
                                                           scraped_at=now)
                old_inf = old_fail = old_exec = None
            except IntegrityError:  # another scrape created it first
                counter = TritonCounter.objects.select_for_update().get(deployment=dep)
                old_inf, old_fail, old_exec = counter.inference_count, counter.fail_count, counter.execution_ns
        else:
            old_inf, old_fail, old_exec = counter.inference_count, counter.fail_count, counter.execution_ns
        restarted = old_inf is not None and (inference_count < old_inf or fail_count < old_fail
                                             or execution_ns < old_exec)
        if restarted:
            d_inf, d_fail, d_exec = inference_count, fail_count, execution_ns
        else:
            d_inf, d_fail = _delta(inference_count, old_inf), _delta(fail_count, old_fail)
            d_exec = _delta(execution_ns, old_exec)
        TritonCounter.objects.filter(pk=counter.pk).update(inference_count=inference_count, fail_count=fail_count,
                                                           execution_ns=execution_ns, scraped_at=now)
        if d_inf or d_fail or d_exec:
            add = {"requests": F("requests") + d_inf, "failures": F("failures") + d_fail,
                   "execution_ns": F("execution_ns") + d_exec}
            updated = TritonServedHourly.objects.filter(deployment=dep, hour=hour).update(**add)
            if not updated:
                try:
                    with transaction.atomic():
                        TritonServedHourly.objects.create(tenant_id=dep.tenant_id, deployment=dep, hour=hour,
                                                          requests=d_inf, failures=d_fail, execution_ns=d_exec)
                except IntegrityError:
                    TritonServedHourly.objects.filter(deployment=dep, hour=hour).update(**add)
        if restarted:
            log.info("triton counters went down (server restarted)",
                     extra={"deployment": dep.pk, "before": old_inf, "now": inference_count})
    return d_inf, d_fail


def scrape_node(node_id: int) -> dict:
    """Scrape every ready model on the node's active slices. One broken server is logged and skipped."""
    deps = (ModelDeployment.objects
            .filter(allocation__node_id=node_id, allocation__state=Allocation.State.ACTIVE,
                    state=ModelDeployment.State.READY)
            .select_related("allocation__tier__profile", "allocation__tier__gpu_model")
            .order_by("pk"))
    found = {"deployments": 0, "requests": 0, "failures": 0, "errors": 0}
    now = timezone.now()
    for dep in deps:
        try:
            stats = backend_for(dep.allocation).statistics(dep.name)
            d_inf, d_fail = record_counters(dep, int(stats["inference_count"]), int(stats["fail_count"]), now,
                                            execution_ns=int(stats.get("execution_ns") or 0))
        except Exception as exc:  # noqa: BLE001 - one server's failure must not stop the others
            found["errors"] += 1
            log.warning("triton scrape failed", extra={"node": node_id, "deployment": dep.pk, "model": dep.name,
                                                       "err": f"{exc.__class__.__name__}: {exc}"})
            continue
        found["deployments"] += 1
        found["requests"] += d_inf
        found["failures"] += d_fail
    return found


def fan_out() -> int:
    """One scrape per node that has active slices, each on the node's own queue."""
    from telemetry import tasks  # noqa: PLC0415

    n = 0
    for node in Node.objects.filter(state__in=[Node.State.READY, Node.State.DRAINING],
                                    allocations__state=Allocation.State.ACTIVE).distinct():
        tasks.scrape_triton_node.apply_async(args=[node.pk], queue=node.queue)
        n += 1
    return n
