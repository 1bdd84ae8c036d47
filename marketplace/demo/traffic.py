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
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from marketplace.gateway.state import mint_try_token
from marketplace.models import Allocation, ModelDeployment
from telemetry.models import TritonServedHourly
from telemetry.services.ingest import ingest_batch
from tenants.scoping import Principal

log = logging.getLogger("tessera.demo")
PROMPTS = ["summarize the quarterly GPU utilization report", "translate this support ticket to German",
           "write a haiku about memory slices", "classify the sentiment of these reviews",
           "draft a reply to the customer about latency", "explain MIG placement to a new operator"]
# requests per minute per tenant: different tenants, different stories
RATES = {"acme-ai": 40, "borealis": 18, "cobalt-health": 60, "dynamo-search": 8}
SYSTEM = Principal(is_operator=True)  # the gateway writes usage on the tenants' behalf
#: deployments the seeded history covers (live or on their way)
TRAFFIC_STATES = (ModelDeployment.State.READY, ModelDeployment.State.LOADING, ModelDeployment.State.PENDING)


def prompt(rng: random.Random) -> str:
    """A request with a document attached: 150 to 1,500 words (the tiny model counts words as tokens)."""
    words = " ".join(PROMPTS).split()
    n = rng.randint(150, 1500)
    return f"{rng.choice(PROMPTS)}: " + " ".join(words[i % len(words)] for i in range(n))


def gateway_tick(node_id: int, seconds: int = 60) -> int:
    """One tick for a node: requests to each ready model through the inference gateway, over HTTP, as a
    tenant's application would send them. The gateway meters what it served (its usage stream or spool,
    written to the database by the consume-usage beat task): nothing here reports usage."""
    sent = 0
    deps = ModelDeployment.objects.filter(state=ModelDeployment.State.READY, allocation__node_id=node_id,
                                          allocation__state=Allocation.State.ACTIVE).select_related("tenant")
    now = timezone.now()
    for dep in deps:
        rng = random.Random(f"{dep.pk}-{now:%Y%m%d%H%M}")
        n = max(1, int(RATES.get(dep.tenant.slug, 10) * seconds / 60 * rng.uniform(0.5, 1.5)))
        token = mint_try_token(dep.tenant_id, 0)  # a short-lived token: the demo's "application" holds no key
        for _ in range(n):
            body = {"model": dep.name, "prompt": prompt(rng), "max_tokens": rng.randint(40, 400)}
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


def backfill(days: int = 3) -> int:
    """Seed: the past days' history, for the demo charts: what the gateway metered (hourly batches) and what the
    slices' Triton servers served (the same requests), so metered and served agree as they would have."""
    total = 0
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    since = now - timedelta(hours=days * 24)
    # the seeded history is the deployments' own: they "existed" over it (ingest refuses earlier events)
    ModelDeployment.objects.filter(state__in=TRAFFIC_STATES, created_at__gt=since).update(created_at=since)
    for dep in ModelDeployment.objects.filter(state__in=TRAFFIC_STATES).select_related("tenant"):
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
                TritonServedHourly.objects.update_or_create(tenant=dep.tenant, deployment=dep, hour=hour,
                                                            defaults={"requests": 20 * n})
    return total
