"""Measurement: what a client that cuts a stream after three words is billed, and how soon the upstream request
is dropped. Not collected by pytest; the README's figures ("Metering") come from it.

    .venv/bin/python tests/bench/stream_cut.py [--trials 30]

A real ``manage.py gateway`` process (uvicorn, uvloop, httptools; no Redis: the spool, read here by
``metering.consume``) in front of ``tests.stream_upstream.StreamUpstream`` in this process (Triton's
generate_stream framing, each event one word and the running token count). A client on a raw socket sends a
streamed ``/v1/completions`` request, reads until it has three words, and closes. Three upstreams:

- paced: a token every 20 ms (50 tokens/s, a real model's pace), up to 500;
- unpaced: as fast as the gateway reads them, up to 2,000 (the worst case: everything in the buffers is billed);
- held: three tokens, then it waits, polling every millisecond for its connection to drop: the time from the
  client's close to the upstream seeing its request dropped.

Prints, per upstream: words the client received (in the reads it made) and tokens billed (p50 / max), the most
billed beyond what one client received, tokens the upstream produced, and (held) the drop latency p50 / p95 / max.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.gateway import Child, make_fleet, pct, wait_http  # noqa: E402
from tests.bench.scratch import setup_django  # noqa: E402


def cut_after(port: int, key: str, n_words: int, max_tokens: int) -> tuple[str, int, float]:
    """(request id, words received, when the client closed: time.monotonic())."""
    body = json.dumps({"model": "tiny-chat", "prompt": "x", "max_tokens": max_tokens, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    got, words, rid = b"", 0, ""
    while words < n_words:
        data = s.recv(65536)
        if not data:
            raise RuntimeError(f"the stream ended early: {got[-300:]!r}")
        got += data
        events = [json.loads(line[6:]) for line in got.split(b"\n")[:-1] if line.startswith(b"data: {")]
        words = sum(len(e["choices"][0]["text"].split()) for e in events if e.get("choices"))
        rid = events[0]["id"].removeprefix("cmpl-") if events else ""
    s.close()
    return rid, words, time.monotonic()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=30)
    args = ap.parse_args()
    os.environ["REDIS_URL"] = ""
    scratch = setup_django("tessera_bench_streams", "tessera-bench-streams-")
    from marketplace.gateway import metering
    from telemetry.models import UsageEvent
    from tests.bench.gateway import free_port
    from tests.stream_upstream import StreamUpstream

    up = StreamUpstream(pace_s=0.02).start()
    key, _secret = make_fleet(up.port)
    port = free_port()
    env = {**os.environ, "TESSERA_GATEWAY_REFRESH_S": "2", "LOG_FORMAT": "text", "LOG_LEVEL": "WARNING"}
    gw = Child([sys.executable, "manage.py", "gateway", "--port", str(port)], scratch / "gateway.log", env)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/health/ready", gw.proc, gw.log)
        for label, pace, hold, max_tokens in (("paced 20 ms/token", 0.02, None, 500),
                                              ("unpaced", 0.0, None, 2000),
                                              ("held after 3", 0.0, 3, 500)):
            up.pace_s, up.hold_after, up.poll_s = pace, hold, 0.001
            received, produced, latency, ids = [], [], [], []
            for _ in range(args.trials):
                up.reset()
                rid, words, closed = cut_after(port, key, 3, max_tokens)
                if not up.finished.wait(5):  # held and not dropped: let it finish (and count it)
                    up.release(held=True)
                ids.append(rid)
                received.append(words)
                produced.append(up.sent)
                if up.dropped_at is not None:
                    latency.append((up.dropped_at - closed) * 1000)
            time.sleep(0.5)
            metering.consume(budget_s=20)
            billed = dict(UsageEvent.objects.filter(event_id__in=ids).values_list("event_id", "output_tokens"))
            b = [billed[i] for i in ids if i in billed]
            over = [billed[i] - w for i, w in zip(ids, received, strict=True) if i in billed]
            line = (f"{label:18} words received p50 {statistics.median(received):.0f} max {max(received)} | "
                    f"billed p50 {statistics.median(b):.0f} max {max(b)} ({len(b)}/{len(ids)} metered), "
                    f"beyond the words received max {max(over)} | "
                    f"upstream produced p50 {statistics.median(produced):.0f} max {max(produced)}")
            if hold:
                line += (f" | dropped {len(latency)}/{len(ids)}, {pct(latency, 0.5):.1f} ms p50, "
                         f"{pct(latency, 0.95):.1f} ms p95, {max(latency):.1f} ms max after the close")
            print(line, flush=True)
    except BaseException:
        print(gw.log.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        gw.stop()
        up.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
