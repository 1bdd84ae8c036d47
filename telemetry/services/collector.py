"""The NVML collector: one run per node (on the node's own queue) reads every GPU through the node's
NVML client and stores one raw GpuSample per GPU and one raw MigSample per slice.

* An NVMLError on one GPU is logged, counted (CollectorError, exported as a Prometheus counter) and
  skipped; the other GPUs are still stored.
* Under MIG, ``nvmlDeviceGetUtilizationRates`` raises NotSupported; NvmlClient turns that into
  ``utilization_gpu=None`` and the sample stores utilization NULL (not an error).
* Per-slice activity (0..1) is an estimate from metering, because NVML has no per-MIG utilization
  without GPM/DCGM: tokens metered on the slice's deployments since the start of the previous UTC hour
  (UsageHourly), per second, over the tier's capacity in tokens/s (``tier_capacity_tokens_per_s``).
  The GPU's ``activity`` is NVML's utilization/100 when it reports one, else the compute-slice-weighted
  sum of its slices' activity (the same weighting the simulator uses for power).
* Simulated backend only: before reading, the simulator's load is set from that same estimate
  (``set_activity``), and the slice's memory from its deployments' declared memory, so power, energy,
  temperature, clocks and memory follow the metered traffic and the demo charts tell a true story.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db.models import F, Sum
from django.utils import timezone
from pynvml import NVMLError

from marketplace.models import Allocation, GpuInstance, ModelDeployment, Node
from marketplace.selectors.catalog import modelled_tokens_per_s
from marketplace.services import nodes
from telemetry.models import CollectorError, GpuSample, MigSample, Resolution, UsageHourly

log = logging.getLogger("tessera.telemetry.collector")
MIB = 1024 * 1024


def tier_capacity_tokens_per_s(tier) -> float:
    """What a slice of the tier serves flat out, in tokens/s (the model: selectors.catalog.modelled_tokens_per_s)."""
    return modelled_tokens_per_s(tier.gpu_model, tier.profile if tier.profile_id else None)


def _window(now: datetime) -> tuple[datetime, float]:
    start = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    return start, max(1.0, (now - start).total_seconds())


def slice_activity(allocations: list[Allocation], now: datetime) -> dict[int, float]:
    """allocation id -> activity estimate 0..1 from metered tokens (see the module docstring)."""
    if not allocations:
        return {}
    start, seconds = _window(now)
    tokens = dict(
        UsageHourly.objects.filter(deployment__allocation__in=allocations, hour__gte=start, hour__lte=now)
        .values("deployment__allocation_id")
        .annotate(t=Sum(F("input_tokens") + F("output_tokens")))
        .values_list("deployment__allocation_id", "t")
    )
    out = {}
    for a in allocations:
        cap = tier_capacity_tokens_per_s(a.tier)
        out[a.pk] = min(1.0, (tokens.get(a.pk) or 0) / seconds / cap) if cap > 0 else 0.0
    return out


def _active_allocations(node: Node) -> list[Allocation]:
    return list(
        Allocation.objects.filter(node=node, state=Allocation.State.ACTIVE, instance__isnull=False)
        .select_related("instance__gpu", "instance__placement__profile", "tier__gpu_model", "tier__profile")
    )


def drive_simulator(backend, node: Node, allocations: list[Allocation], activity: dict[int, float]) -> int:
    """Set the simulator's load for every active slice from metering. No-op on real NVML."""
    if not getattr(backend, "SIMULATED", False):
        return 0
    mem = dict(
        ModelDeployment.objects.filter(allocation__in=allocations, state=ModelDeployment.State.READY)
        .values("allocation_id").annotate(m=Sum("memory_mb")).values_list("allocation_id", "m")
    )
    n = 0
    for a in allocations:
        inst = a.instance
        if inst is None:  # never: active allocations are taken with their instance
            continue
        gpu = inst.gpu
        util = activity.get(a.pk, 0.0)
        placement = inst.placement  # None (no query) for a whole GPU
        total_mb = placement.profile.memory_mib if placement is not None else gpu.gpu_model.memory_mib
        frac = None
        if mem.get(a.pk):
            # weights resident plus a little working memory that grows with load
            frac = min(1.0, mem[a.pk] / total_mb + 0.1 * util)
        try:
            if gpu.mig_mode and inst.gi_id is not None:
                backend.set_activity(gpu.index, gi_id=inst.gi_id, utilization=util, memory_fraction=frac)
            elif not gpu.mig_mode:
                backend.set_activity(gpu.index, utilization=util, memory_fraction=frac)
            n += 1
        except (KeyError, IndexError) as exc:  # the GI is gone on the simulated GPU: reconcile's business
            log.info("sim activity skipped", extra={"node": node.hostname, "gpu": gpu.index, "err": str(exc)})
    return n


def _record_error(gpu, exc: Exception, now: datetime) -> None:
    kind = exc.__class__.__name__
    log.warning("nvml telemetry read failed",
                extra={"node": gpu.node.hostname, "gpu": gpu.index, "kind": kind, "err": str(exc)})
    row, _ = CollectorError.objects.get_or_create(gpu=gpu, kind=kind)
    CollectorError.objects.filter(pk=row.pk).update(count=F("count") + 1, last_message=str(exc)[:500], last_at=now)


def collect_node(node_id: int, now: datetime | None = None) -> dict:
    """Read every GPU of the node once; store raw samples. Returns counts."""
    now = (now or timezone.now()).replace(microsecond=0)
    node = Node.objects.select_related("platform__gpu_model").get(pk=node_id)
    gpus = list(node.gpus.select_related("gpu_model", "node").order_by("index"))
    allocations = _active_allocations(node)
    activity = slice_activity(allocations, now)
    placed = [(a, a.instance) for a in allocations if a.instance is not None]  # all (_active_allocations)
    by_gi = {(i.gpu_id, i.gi_id): a for a, i in placed if i.gi_id is not None}
    whole = {i.gpu_id: a for a, i in placed if i.placement_id is None}
    instances = {(i.gpu_id, i.gi_id): i for i in GpuInstance.objects.filter(gpu__node=node, gi_id__isnull=False)
                 .select_related("placement__profile")}

    client = nodes.nvml_client(node)
    drive_simulator(client.nv, node, allocations, activity)
    gpu_rows: list[GpuSample] = []
    mig_rows: list[MigSample] = []
    errors = 0
    with client:
        for gpu in gpus:
            try:
                t = client.telemetry(gpu.index)
            except NVMLError as exc:
                errors += 1
                _record_error(gpu, exc, now)
                continue
            slices = []
            for m in t.mig:
                inst = instances.get((gpu.pk, m.gi_id))
                alloc = by_gi.get((gpu.pk, m.gi_id))
                placement = inst.placement if inst is not None else None
                cs = placement.profile.compute_slices if placement is not None else 0
                act = activity.get(alloc.pk, 0.0) if alloc else 0.0
                slices.append(MigSample(
                    gpu=gpu, mig_uuid=m.uuid, gi_id=m.gi_id, compute_slices=cs, allocation=alloc,
                    tenant_id=alloc.tenant_id if alloc else (inst.tenant_id if inst else None),
                    resolution=Resolution.RAW, ts=now, memory_used_mb=m.memory_used / MIB,
                    memory_total_mb=m.memory_total / MIB, activity=act))
            if t.utilization_gpu is not None:
                gpu_activity = t.utilization_gpu / 100.0
            else:
                total_cs = gpu.gpu_model.compute_slices or 7
                gpu_activity = min(1.0, sum(s.activity * s.compute_slices for s in slices) / total_cs)
            if gpu.pk in whole and not t.mig:
                a = whole[gpu.pk]
                slices.append(MigSample(
                    gpu=gpu, mig_uuid=t.uuid, gi_id=None, compute_slices=gpu.gpu_model.compute_slices,
                    allocation=a, tenant_id=a.tenant_id, resolution=Resolution.RAW, ts=now,
                    memory_used_mb=t.memory_used / MIB, memory_total_mb=t.memory_total / MIB,
                    activity=gpu_activity))
            mig_rows.extend(slices)
            gpu_rows.append(GpuSample(
                gpu=gpu, resolution=Resolution.RAW, ts=now, samples=1,
                utilization=None if t.utilization_gpu is None else float(t.utilization_gpu),
                utilization_samples=0 if t.utilization_gpu is None else 1, activity=gpu_activity,
                memory_used_mb=t.memory_used / MIB, memory_total_mb=t.memory_total / MIB, power_w=t.power_w,
                energy_j=t.energy_j, temperature_c=float(t.temperature_c), sm_clock_mhz=float(t.sm_clock_mhz),
                mig=t.utilization_gpu is None and bool(gpu.mig_mode)))
    GpuSample.objects.bulk_create(gpu_rows, ignore_conflicts=True)
    MigSample.objects.bulk_create(mig_rows, ignore_conflicts=True)
    return {"node": node.hostname, "gpus": len(gpu_rows), "slices": len(mig_rows), "errors": errors}


def fan_out() -> int:
    """Beat (control queue): one collection per node, each on the node's own queue."""
    from telemetry import collector_tasks

    n = 0
    for node in Node.objects.filter(state__in=[Node.State.READY, Node.State.DRAINING]):
        collector_tasks.collect_gpu_node.apply_async(args=[node.pk], queue=node.queue)
        n += 1
    return n
