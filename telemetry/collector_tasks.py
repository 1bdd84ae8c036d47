"""GPU telemetry tasks (collector, downsampling, pruning): thin wrappers around services.
Imported by telemetry/tasks.py so Celery's autodiscovery registers them."""

from __future__ import annotations

from celery import shared_task

from marketplace.services import planner_rollup
from telemetry.services import collector, downsample, energy

NODE_TASK = {"acks_late": True, "reject_on_worker_lost": True, "time_limit": 120, "soft_time_limit": 100}


@shared_task(name="tessera.collect_gpu_node", ignore_result=True, **NODE_TASK)
def collect_gpu_node(node_id: int) -> dict:
    """On the node's queue: read every GPU's telemetry once and store raw samples (a failing GPU is
    counted and skipped). Replaying it within the same second stores nothing twice."""
    return collector.collect_node(node_id)


@shared_task(name="tessera.collect_gpu_fleet", acks_late=True, time_limit=120)
def collect_gpu_fleet() -> int:
    """Beat (control queue): one collection per ready/draining node, on each node's own queue."""
    return collector.fan_out()


@shared_task(name="tessera.downsample_telemetry", acks_late=True, time_limit=600)
def downsample_telemetry() -> dict:
    """Beat (control queue): roll raw samples up into 5-minute and hourly averages, apportion the energy of
    each hour that has ended (EnergyHourly) and sum each complete day (EnergyDaily), then prune by retention
    (never a bucket that has not been rolled up), then roll the capacity planner's measurements up per hour
    (after pruning: hours whose samples were pruned are rolled again). Idempotent."""

    rolled = downsample.downsample()
    energy_hours = energy.rollup_hours()
    energy_days = energy.rollup_days()
    pruned = downsample.prune()
    planner = planner_rollup.roll()
    return {"rolled": rolled, "energy_hours": energy_hours, "energy_days": energy_days, "pruned": pruned,
            "planner": planner}
