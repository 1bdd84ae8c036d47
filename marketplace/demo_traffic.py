"""Demo only: an inference gateway for the simulated fleet. It sends requests to each ready
model through the slice's (simulated) Triton server and reports the tokens as usage events, as a
tenant's real gateway would, so metering, invoices, telemetry and charts have a true story to tell.
Enabled with TESSERA_DEMO_TRAFFIC=1 (the demo command sets it)."""

from __future__ import annotations

import logging
import random
import uuid
from datetime import timedelta

from django.utils import timezone

from marketplace.models import Allocation, ModelDeployment
from marketplace.services import deployments
from telemetry.services.ingest import ingest_batch
from tenants.scoping import Principal

log = logging.getLogger("tessera.demo")
PROMPTS = ["summarize the quarterly GPU utilization report", "translate this support ticket to German",
           "write a haiku about memory slices", "classify the sentiment of these reviews",
           "draft a reply to the customer about latency", "explain MIG placement to a new operator"]
# requests per minute per tenant: different tenants, different stories
RATES = {"acme-ai": 40, "borealis": 18, "cobalt-health": 60, "dynamo-search": 8}
SYSTEM = Principal(is_operator=True)  # the gateway writes usage on the tenants' behalf


def prompt(rng: random.Random) -> str:
    """A request with a document attached: 150 to 1,500 words (the tiny model counts words as tokens)."""
    words = " ".join(PROMPTS).split()
    n = rng.randint(150, 1500)
    return f"{rng.choice(PROMPTS)}: " + " ".join(words[i % len(words)] for i in range(n))


def gateway_tick(node_id: int, seconds: int = 60) -> int:
    """One tick for a node: requests through Triton, then usage events for what was served."""
    sent = 0
    deps = ModelDeployment.objects.filter(state=ModelDeployment.State.READY, allocation__node_id=node_id,
                                          allocation__state=Allocation.State.ACTIVE).select_related(
        "tenant", "allocation__tier__profile", "allocation__tier__gpu_model")
    now = timezone.now()
    for dep in deps:
        rng = random.Random(f"{dep.pk}-{now:%Y%m%d%H%M}")
        n = max(1, int(RATES.get(dep.tenant.slug, 10) * seconds / 60 * rng.uniform(0.5, 1.5)))
        server = deployments.backend_for(dep.allocation)
        events = []
        for i in range(n):
            out = server.infer_text(dep.name, prompt(rng), max_tokens=rng.randint(40, 400))
            # The tokens the model reports are the tokens metered (and, on the simulator, what its
            # execution time follows), so measured throughput per slice is consistent end to end.
            events.append({"event_id": f"gw-{uuid.uuid4().hex}", "deployment": dep.pk,
                           "ts": (now - timedelta(seconds=seconds * (n - i) / n)).isoformat(),
                           "input_tokens": out["input_tokens"], "output_tokens": out["output_tokens"],
                           "requests": 1})
        ingest_batch(SYSTEM, dep.tenant, events)
        sent += n
    return sent


def backfill(days: int = 3) -> int:
    """Seed: usage the gateway 'reported' over the past days (hourly batches), for the demo charts."""
    total = 0
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    since = now - timedelta(hours=days * 24)
    # the seeded history is the deployments' own: they "existed" over it (ingest refuses earlier events)
    ModelDeployment.objects.filter(state__in=["ready", "loading", "pending"], created_at__gt=since).update(
        created_at=since)
    for dep in ModelDeployment.objects.filter(state__in=["ready", "loading", "pending"]).select_related("tenant"):
        for h in range(days * 24, 0, -1):
            hour = now - timedelta(hours=h)
            rng = random.Random(f"backfill-{dep.pk}-{hour:%Y%m%d%H}")
            daytime = 0.4 + 0.6 * (8 <= hour.hour <= 20)
            n = int(RATES.get(dep.tenant.slug, 10) * 60 * daytime * rng.uniform(0.6, 1.4) / 20)
            events = [{"event_id": f"bf-{dep.pk}-{hour:%Y%m%d%H}-{i}", "deployment": dep.pk,
                       "ts": (hour + timedelta(seconds=3600 * i / max(n, 1))).isoformat(),
                       "input_tokens": rng.randint(200, 2400), "output_tokens": rng.randint(50, 900),
                       "requests": 20} for i in range(n)]
            if events:
                total += ingest_batch(SYSTEM, dep.tenant, events).new
    return total
