"""Triton statistics scraper (runs on the node's own queue: the only code that talks to the node's
Triton servers). For each ready model on the node's active slices it reads the cumulative
inference_count / fail_count and model execution time (Triton's batch_stats: what the capacity planner
divides metered tokens by), takes the increase since the last scrape (TritonCounter) and adds it to the
current hour's TritonServedHourly. A counter that went down means the server restarted: the new value
is all that was served since. The first scrape of a deployment counts everything since it was
loaded (Tessera loads every model itself, so the counters start at its deployment).

Triton is read while the deployment's counter row is locked (see record_counters): concurrent scrapes of
one deployment fold their readings in the order they took them. The cost is a row lock held for one
statistics call (a local HTTP request; the client's timeout bounds it), blocking only other scrapes of
the same deployment. Known limit: a restart is seen only when a counter went down, so a server that
restarted and served at least as many requests again (new >= last stored value) before the next scrape
is undercounted: new - last instead of new + what it served between the last scrape and the restart."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from marketplace.hardware.triton import TritonBackend
from marketplace.models import Allocation, ModelDeployment, Node
from marketplace.services.deployments import backend_for
from telemetry.models import TritonCounter, TritonServedHourly

log = logging.getLogger("tessera.scrape")
MIN_MISMATCH = 5  # requests: below this a difference is the hour boundary, not a fault


def record_counters(dep: ModelDeployment, read: Callable[[], tuple[int, ...]],
                    now: datetime | None = None) -> tuple[int, int]:
    """Fold one cumulative reading into the counter and the current hour; returns (requests, failures)
    added.

    ``read()`` asks Triton for ``(inference_count, fail_count[, execution_ns])``; it is called only once this
    deployment's TritonCounter row is locked (created first if need be), so readings are folded in the order they were
    taken. Reading before the lock let two scrapes of one deployment at once (two workers on a node queue,
    ``-c 2``, a redelivered task next to the scheduled one) fold an older, lower reading after a newer one:
    that looked like a server restart, and the older reading was counted a second time.

    Everything is one transaction: a worker killed before COMMIT leaves neither the counter nor the hour
    changed, and the task's replay reads Triton again, so what was served is counted once; a replay after
    COMMIT finds the counter already moved and adds only what was served since."""
    with transaction.atomic():
        counter = TritonCounter.objects.select_for_update().filter(deployment=dep).first()
        first = False
        if counter is None:
            try:
                with transaction.atomic():
                    counter = TritonCounter.objects.create(deployment=dep, inference_count=0, fail_count=0)
                first = True
            except IntegrityError:  # another scrape created it first (and has committed: we waited for it)
                counter = TritonCounter.objects.select_for_update().get(deployment=dep)
        reading = tuple(int(v) for v in read())
        inference_count, fail_count = reading[0], reading[1]
        execution_ns = reading[2] if len(reading) > 2 else counter.execution_ns  # not read: unchanged
        now = now or timezone.now()
        hour = now.replace(minute=0, second=0, microsecond=0)
        old_inf, old_fail, old_exec = counter.inference_count, counter.fail_count, counter.execution_ns
        restarted = not first and (inference_count < old_inf or fail_count < old_fail or execution_ns < old_exec)
        if first or restarted:  # all that was served since the model was loaded (or the server restarted)
            d_inf, d_fail, d_exec = inference_count, fail_count, execution_ns
        else:
            d_inf, d_fail, d_exec = inference_count - old_inf, fail_count - old_fail, execution_ns - old_exec
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


def reader(server: TritonBackend, name: str) -> Callable[[], tuple[int, int, int]]:
    def read() -> tuple[int, int, int]:
        stats = server.statistics(name)
        return int(stats["inference_count"]), int(stats["fail_count"]), int(stats.get("execution_ns") or 0)
    return read


def scrape_node(node_id: int) -> dict:
    """Scrape every ready model on the node's active slices. One broken server is logged and skipped."""
    deps = (ModelDeployment.objects
            .filter(allocation__node_id=node_id, allocation__state=Allocation.State.ACTIVE,
                    state=ModelDeployment.State.READY)
            .select_related("allocation__tier__profile", "allocation__tier__gpu_model")
            .order_by("pk"))
    found = {"deployments": 0, "requests": 0, "failures": 0, "errors": 0}
    for dep in deps:
        try:
            with backend_for(dep.allocation) as server:
                d_inf, d_fail = record_counters(dep, reader(server, dep.name))
        except Exception as exc:  # one server's failure must not stop the others
            found["errors"] += 1
            log.warning("triton scrape failed", extra={"node": node_id, "deployment": dep.pk, "model": dep.name,
                                                       "err": f"{exc.__class__.__name__}: {exc}"})
            continue
        found["deployments"] += 1
        found["requests"] += d_inf
        found["failures"] += d_fail
    found["mismatches"] = len(check_metering(node_id))
    return found


def check_metering(node_id: int, now: datetime | None = None) -> list[dict]:
    """Compare what Tessera metered (the gateway's usage events) with what each deployment's Triton server says
    it served, over the complete hours of the last day (the current hour is still settling: events reach the
    database within seconds, a scrape's reading within its interval). A difference beyond
    ``TESSERA_METERING_TOLERANCE`` (share of the larger count; at least MIN_MISMATCH requests) opens one
    unresolved DriftEvent per slice, which the console's overview lists until an operator resolves it."""
    from django.conf import settings

    from marketplace.models import DriftEvent
    from telemetry import selectors
    from tenants.scoping import Principal

    now = now or timezone.now()
    until = now.replace(minute=0, second=0, microsecond=0)
    since = until - timedelta(hours=24)
    rows = [r for r in selectors.metered_vs_served(Principal(is_operator=True), since, until, node_id=node_id)
            if r["allocation"] is not None]
    open_for = set(DriftEvent.objects.filter(node_id=node_id, kind=DriftEvent.Kind.METERING_MISMATCH,
                                             resolved=False).values_list("allocation_id", flat=True))
    found = []
    for r in rows:
        m, s = r["metered_requests"], r["served_requests"]
        if abs(m - s) < MIN_MISMATCH or abs(m - s) <= settings.TESSERA_METERING_TOLERANCE * max(m, s):
            continue
        found.append(r)
        if r["allocation"] in open_for:
            continue
        DriftEvent.objects.create(
            node_id=node_id, allocation_id=r["allocation"], kind=DriftEvent.Kind.METERING_MISMATCH, resolved=False,
            detail=(f"{r['tenant']}/{r['model']}: {m:,} requests metered, {s:,} served by Triton in the 24 h to "
                    f"{until:%Y-%m-%d %H:%M} UTC ({m - s:+,})"))
        log.warning("metered and served differ", extra={"deployment": r["deployment"], "metered": m, "served": s})
    return found


def fan_out() -> int:
    """One scrape per node that has active slices, each on the node's own queue."""
    from telemetry import tasks

    n = 0
    for node in Node.objects.filter(state__in=[Node.State.READY, Node.State.DRAINING],
                                    allocations__state=Allocation.State.ACTIVE).distinct():
        tasks.scrape_triton_node.apply_async(args=[node.pk], queue=node.queue)
        n += 1
    return n
