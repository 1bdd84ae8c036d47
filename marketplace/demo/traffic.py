"""Demo only: traffic for the simulated fleet. Each minute it sends requests to every ready model through the
inference gateway over HTTP (the gateway reaches the simulated slices' HTTP fronts), so metering, invoices,
telemetry and charts have a true story to tell: what is billed is what the gateway served. ``backfill`` seeds
the past days' usage (history from before the demo started). Enabled with TESSERA_DEMO_TRAFFIC=1 (the demo
command sets it)."""

from __future__ import annotations

import json
import logging
import random
import urllib.request
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from marketplace.gateway.state import mint_try_token
from marketplace.models import Allocation, ModelDeployment
from marketplace.selectors.catalog import modelled_tokens_per_s
from telemetry.models import TritonServedHourly
from telemetry.services.ingest import ingest_batch
from tenants.scoping import Principal

log = logging.getLogger("tessera.demo")
PROMPTS = ["summarize the quarterly GPU utilization report", "translate this support ticket to German",
           "write a haiku about memory slices", "classify the sentiment of these reviews",
           "draft a reply to the customer about latency", "explain MIG placement to a new operator"]
# How busy each tenant's application keeps its slices in the daytime: the share of the slice's modelled
# throughput (tokens/s, selectors.catalog.modelled_tokens_per_s; what the simulated Triton serves flat out)
# that its requests use. Different tenants, different stories; the GPUs' activity and power follow (the
# collector estimates a slice's activity from the tokens metered on it and drives the simulated NVML with it).
LOAD = {"acme-ai": 0.45, "borealis": 0.3, "cobalt-health": 0.6, "dynamo-search": 0.25}
DEFAULT_LOAD = 0.3
NIGHT = 0.4  # share of the daytime load outside 08:00-20:59 UTC
# A request: a document of 1,500 to 6,000 words (the tiny model counts words as tokens) and an answer of
# 100 to 1,000 tokens (the model's max_tokens is 1,024).
INPUT_WORDS = (1500, 6000)
OUTPUT_TOKENS = (100, 1000)
MEAN_TOKENS = (sum(INPUT_WORDS) + sum(OUTPUT_TOKENS)) / 2
SYSTEM = Principal(is_operator=True)  # the gateway writes usage on the tenants' behalf
#: deployments the seeded history covers (live or on their way)
TRAFFIC_STATES = (ModelDeployment.State.READY, ModelDeployment.State.LOADING, ModelDeployment.State.PENDING)


def prompt(rng: random.Random) -> str:
    """A request with a document attached (INPUT_WORDS words)."""
    words = " ".join(PROMPTS).split()
    n = rng.randint(*INPUT_WORDS)
    return f"{rng.choice(PROMPTS)}: " + " ".join(words[i % len(words)] for i in range(n))


def tokens_per_s(dep: ModelDeployment, at: datetime) -> float:
    """The tokens/s the tenant's application sends to the deployment at ``at`` (before the per-tick jitter):
    its LOAD share of the slice's modelled throughput, less at night."""
    tier = dep.allocation.tier
    capacity = modelled_tokens_per_s(tier.gpu_model, tier.profile if tier.profile_id else None)
    daytime = 1.0 if 8 <= at.hour <= 20 else NIGHT
    return LOAD.get(dep.tenant.slug, DEFAULT_LOAD) * capacity * daytime


def requests_in(dep: ModelDeployment, at: datetime, seconds: float, rng: random.Random) -> int:
    """How many requests (of MEAN_TOKENS on average) carry that load over ``seconds``."""
    return max(1, round(tokens_per_s(dep, at) * seconds / MEAN_TOKENS * rng.uniform(0.7, 1.3)))


def _deployments():
    return ModelDeployment.objects.select_related("tenant", "allocation__tier__gpu_model", "allocation__tier__profile")


def gateway_tick(node_id: int, seconds: int = 60) -> int:
    """One tick for a node: requests to each ready model through the inference gateway, over HTTP, as a
    tenant's application would send them. The gateway meters what it served (its usage stream or spool,
    written to the database by the consume-usage beat task): nothing here reports usage."""
    sent = 0
    deps = _deployments().filter(state=ModelDeployment.State.READY, allocation__node_id=node_id,
                                 allocation__state=Allocation.State.ACTIVE)
    now = timezone.now()
    for dep in deps:
        rng = random.Random(f"{dep.pk}-{now:%Y%m%d%H%M}")
        n = requests_in(dep, now, seconds, rng)
        token = mint_try_token(dep.tenant_id, 0)  # a short-lived token: the demo's "application" holds no key
        for _ in range(n):
            body = {"model": dep.name, "prompt": prompt(rng), "max_tokens": rng.randint(*OUTPUT_TOKENS)}
            try:
                _post(f"{settings.TESSERA_GATEWAY_INTERNAL_URL}/v1/completions", body, token)
                sent += 1
            except OSError as exc:
                log.warning("demo request through the gateway failed", extra={"model": dep.name, "error": str(exc)})
                break
    return sent


def _post(url: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # the configured gateway URL
        return json.loads(resp.read())


BATCH = 60  # requests per seeded usage event (an hour's)
COARSE_HOURS = 6  # the seeded history before the last days: one step of events per 6 hours


def backfill(days: int = 3, *, since: datetime | None = None) -> int:
    """Seed: the past days' history, for the demo charts: what the gateway metered (hourly batches) and what the
    slices' Triton servers served (the same requests), so metered and served agree as they would have. With
    ``since`` (the demo: the first of the previous month), the history reaches back to it, the part before the
    last ``days`` days in coarser steps (COARSE_HOURS; each event carries that many hours' batches), so a past
    month is there to invoice, finalize and credit without seeding twelve times the events."""
    total = 0
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    hourly_from = now - timedelta(hours=days * 24)
    start = min(since, hourly_from) if since is not None else hourly_from
    # the seeded history is the deployments' own: they "existed" over it (ingest refuses earlier events)
    ModelDeployment.objects.filter(state__in=TRAFFIC_STATES, created_at__gt=start).update(created_at=start)
    for dep in _deployments().filter(state__in=TRAFFIC_STATES):
        hour = start
        while hour < now:
            left = int((hourly_from - hour).total_seconds() // 3600)  # hours before the hourly part
            step = 1 if left <= 0 else min(COARSE_HOURS, left)
            rng = random.Random(f"backfill-{dep.pk}-{hour:%Y%m%d%H}")
            batch = BATCH * step  # requests per event: one event per BATCH requests an hour
            n = requests_in(dep, hour, 3600 * step, rng) // batch
            events = [{"event_id": f"bf-{dep.pk}-{hour:%Y%m%d%H}-{i}", "deployment": dep.pk,
                       "ts": (hour + timedelta(seconds=3600 * step * i / max(n, 1))).isoformat(),
                       "input_tokens": batch * rng.randint(*INPUT_WORDS),
                       "output_tokens": batch * rng.randint(*OUTPUT_TOKENS), "requests": batch} for i in range(n)]
            if events:
                total += ingest_batch(SYSTEM, dep.tenant, events).new
                served: dict[int, int] = {}  # what Triton counted, per hour: the hour each event falls in
                for i in range(n):
                    h = step * i // n
                    served[h] = served.get(h, 0) + batch
                for h, requests in served.items():
                    TritonServedHourly.objects.update_or_create(
                        tenant=dep.tenant, deployment=dep, hour=hour + timedelta(hours=h),
                        defaults={"requests": requests})
            hour += timedelta(hours=step)
    return total
