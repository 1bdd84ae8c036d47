"""Benchmark: what signing usage events costs the gateway and the consumer, against the unsigned form, same run.

    REDIS_URL=redis://127.0.0.1:6379/0 .venv/bin/python tests/bench/usage_signing.py [--events 100000] [--runs 5]

(a) Per event, in this process: the stored form before signing (``json.dumps`` of the event, encoded) against
``Keyring.seal`` (the same bytes plus a key id and HMAC-SHA256 over them); the consumer's read before
(``json.loads``) against ``Keyring.open`` (the HMAC checked in constant time, then ``json.loads``). Best of
``--runs`` runs of ``--events`` events each.

(b) With REDIS_URL: the gateway's sink (``RedisStreamSink``: every append waits for its pipeline, appends that
arrive while one is in flight share the next) writing ``--events`` events, 1,000 appends in flight at a time,
signed against a sink that XADDs the unsigned ``{"e": json}`` exactly as before, alternating, on a scratch stream
each; events/s and the stream's bytes per entry (``MEMORY USAGE``). No database is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
os.environ.setdefault("LOG_LEVEL", "WARNING")

import django  # noqa: E402

django.setup()

from marketplace.gateway import metering, signing  # noqa: E402
from marketplace.gateway.metering import RedisStreamSink  # noqa: E402


def events(n: int) -> list[dict]:
    now = time.time()
    return [metering.event(uuid.uuid4().hex, 17, 4242, 100 + i % 900, 1 + i % 300, ts=now + i / 1000, ms=12.0)
            for i in range(n)]


def best_us(fn, items, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for x in items:
            fn(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(items) * 1e6


class UnsignedSink(RedisStreamSink):
    """The sink as it was: {"e": json} per event."""

    async def _write(self, batch: list[dict]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for e in batch:
            pipe.xadd(self.stream, {"e": signing.dumps(e)})
        await pipe.execute()


async def sink_rate(cls, url: str, evs: list[dict]) -> tuple[float, float]:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url, max_connections=4096)
    stream = f"tessera:bench-signing:{uuid.uuid4().hex[:8]}"
    sink = cls(r, stream)
    await sink.start()
    t0 = time.perf_counter()
    for i in range(0, len(evs), 1000):
        await asyncio.gather(*(sink.append(e) for e in evs[i:i + 1000]))
    elapsed = time.perf_counter() - t0
    await sink.close()
    per_entry = (await r.memory_usage(stream, samples=0) or 0) / max(1, await r.xlen(stream))
    await r.delete(stream)
    await r.aclose()
    return len(evs) / elapsed, per_entry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    evs = events(args.events)
    ring = signing.keyring()

    dump_us = best_us(lambda e: signing.dumps(e), evs, args.runs)
    seal_us = best_us(ring.seal, evs, args.runs)
    sealed = [ring.seal(e) for e in evs]
    raw = [s["e"] for s in sealed]
    load_us = best_us(json.loads, raw, args.runs)
    open_us = best_us(ring.open, sealed, args.runs)
    size = statistics.mean(len(s["e"]) for s in sealed)
    print(f"(a) per event ({args.events:,} events, best of {args.runs}; event JSON {size:.0f} bytes)")
    print(f"    gateway:  unsigned dumps {dump_us:.2f} us   signed seal {seal_us:.2f} us   "
          f"signing adds {seal_us - dump_us:.2f} us")
    print(f"    consumer: unsigned loads {load_us:.2f} us   signed open {open_us:.2f} us   "
          f"checking adds {open_us - load_us:.2f} us")

    url = os.environ.get("REDIS_URL")
    if not url:
        print("(b) skipped: REDIS_URL is not set")
        return
    rates: dict[str, list[float]] = {"unsigned": [], "signed": []}
    sizes: dict[str, float] = {}
    for _ in range(args.runs):
        for name, cls in (("unsigned", UnsignedSink), ("signed", RedisStreamSink)):
            rate, per_entry = asyncio.run(sink_rate(cls, url, evs))
            rates[name].append(rate)
            sizes[name] = per_entry
    print(f"(b) RedisStreamSink, {args.events:,} events, 1,000 appends in flight, {args.runs} alternating runs")
    for name in ("unsigned", "signed"):
        print(f"    {name:8s} median {statistics.median(rates[name]):,.0f} events/s "
              f"(min {min(rates[name]):,.0f}, max {max(rates[name]):,.0f}), {sizes[name]:.0f} bytes/entry in Redis")
    print(f"    signed / unsigned: {statistics.median(rates['signed']) / statistics.median(rates['unsigned']):.3f}")


if __name__ == "__main__":
    main()
