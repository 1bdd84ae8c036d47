"""Usage events the gateway served: made durable on the hot path, written to the database by a consumer.

One event per request: ``{"id": request id, "t": tenant, "d": deployment, "ts": epoch seconds, "i": input
tokens, "o": output tokens, "ms": milliseconds from the request's arrival to its metering, "a": the LoRA adapter the
request selected, absent for the base model}``. The request id is
the usage event id, so a replay is counted once. Each event is stored signed (``signing``: its JSON ``e``, the key
id ``k`` and ``s`` = HMAC-SHA256 of ``e``), in the stream and in the spool alike.

Producers (``UsageSink``, async, in the gateway):

- ``RedisStreamSink``: ``XADD`` to the stream ``TESSERA_USAGE_STREAM``. Requests that end while a write is in
  flight are written together by the next pipeline (natural batching: one round trip under load, no added
  wait when idle); in the gateway that pipeline is the limiter's, shared with admissions. ``append`` returns
  once Redis has the event; the gateway sends the answer's last bytes only then, so an acknowledged request
  always has its event. Durable across a Redis restart as far as Redis is
  configured to be (production: ``appendonly yes``, ``appendfsync always`` or ``everysec``).
- ``SpoolSink`` (no Redis: the demo): appended to a local file and ``fsync``-ed before ``append`` returns, one
  JSON object ``{"e", "k", "s"}`` a line.
- The fallback (with Redis): a stream whose answer has gone out when its event cannot be appended (Redis down,
  or no answer within ``STREAM_METER_TIMEOUT_S``) is kept in a ``SpoolSink`` of the gateway's own
  (``fallback_dir()``: signed, fsync-ed, mode 0600), and ``RedisStreamSink.replay`` appends those lines, exactly
  as signed, to the stream once Redis answers again (the gateway tries every ``FALLBACK_REPLAY_S``). A line
  replayed twice (a gateway killed between the append and saving its offset; an event that reached Redis after
  all) has an event id already stored: the idempotent ingest counts it once. The consumer checks its signature
  like any other entry: a line changed in the folder is refused, never billed.

Consumer (``consume``, sync, Django): a consumer group reads the stream in batches (``XREADGROUP``), claims
what a killed consumer left pending (``XAUTOCLAIM``), writes each tenant's rows through the idempotent ingest
(``telemetry.services.ingest.store_rows``: COPY into a stage, ``ON CONFLICT DO NOTHING``) and only then acks
and deletes them. A consumer killed after the write and before the ack replays the batch: the event ids are
already stored, so nothing is counted twice. The spool is read the same way, its offset saved after each write.

The consumer checks every entry's signature before anything of it is read: an unsigned, malformed or forged entry
(a process that can reach Redis but holds no key) is never ingested; it is acked and deleted like the others (it
must not block the group), copied to the dead-letter stream ``<stream>:refused`` (capped at ``DEAD_LETTER_MAXLEN``
entries; the spool's refused lines go to ``refused.dead`` in the spool folder, capped by size) and counted
(``telemetry.services.refusals``: per reason for /metrics, a log line, a billing alert on the tenant it claimed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.conf import settings

from . import signing

log = logging.getLogger("tessera.gateway.metering")

GROUP = "tessera-usage"
CLAIM_IDLE_MS = 30_000
SPOOL_ROTATE_BYTES = 8 * 1024 * 1024
SPOOL_ROTATE_S = 60.0
SPOOL_IDLE_S = 120.0  # a spool file unchanged this long, fully consumed, is deleted
DEAD_LETTER_MAXLEN = 10_000  # refused stream entries kept for forensics (approximately: MAXLEN ~)
DEAD_LETTER_FIELD_BYTES = 4096  # of each field of a refused entry, this much is kept
DEAD_SPOOL = "refused.dead"  # in the spool folder; rotated to refused.dead.1 past SPOOL_ROTATE_BYTES
FALLBACK = "fallback"  # the folder of TESSERA_USAGE_SPOOL_DIR where a gateway keeps what Redis did not take
FALLBACK_REPLAY_S = 1.0  # how often a gateway with a non-empty fallback tries to replay it into the stream
FALLBACK_REPLAY_LINES = 5000  # lines appended per round trip


class MeteringUnavailable(Exception):
    """The event could not be made durable: the request must not be acknowledged as served."""


def event(request_id: str, tenant_id: int, deployment_id: int, n_in: int, n_out: int,
          ts: float | None = None, ms: float | None = None, adapter: str | None = None,
          key: str | None = None) -> dict[str, Any]:
    """One usage event; `key`: the prefix of the API key the request was served for (none: a portal session)."""
    e = {"id": request_id, "t": tenant_id, "d": deployment_id, "ts": round(ts or time.time(), 6), "i": n_in,
         "o": n_out}
    if adapter:
        e["a"] = adapter
    if key:
        e["k"] = key
    if ms is not None:
        e["ms"] = max(0, round(ms))
    return e


class UsageSink(ABC):
    """Append events; ``append`` returns only when the event is durable (else MeteringUnavailable)."""

    def __init__(self) -> None:
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.written = 0

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def append(self, e: dict[str, Any]) -> None:
        if self._task is None:
            await self.start()
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((e, fut))
        assert self._wake is not None
        self._wake.set()
        await fut

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                await self._write([e for e, _ in batch])
            except Exception as exc:  # every waiter learns the write failed
                log.error("usage events not durable", extra={"events": len(batch), "error": str(exc)})
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(MeteringUnavailable(str(exc)))
            else:
                self.written += len(batch)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)

    @abstractmethod
    async def _write(self, events: list[dict[str, Any]]) -> None: ...

    async def close(self) -> None:
        if self._task is not None:
            while self._pending:
                assert self._wake is not None
                self._wake.set()
                await asyncio.sleep(0.01)
            self._task.cancel()
            self._task = None


class RedisStreamSink(UsageSink):
    """``pipeliner``: the limiter's (``limits.Pipeliner``), shared by the gateway: each event's ``XADD`` goes in
    the next pipeline with the admissions and requests' ends queued meanwhile (one round trip under load where
    the sink and the limiter each made one); ``append`` still returns only once Redis answered for the event."""

    def __init__(self, redis: Any, stream: str | None = None, pipeliner: Any = None) -> None:
        super().__init__()
        self.redis, self.stream = redis, stream or settings.TESSERA_USAGE_STREAM
        self.keyring = signing.keyring()
        self.pipeliner = pipeliner

    async def append(self, e: dict[str, Any]) -> None:
        if self.pipeliner is None:
            await super().append(e)
            return
        fields, stream = self.keyring.seal(e), self.stream
        try:
            await self.pipeliner.run(lambda pipe: pipe.xadd(stream, fields), 1)
        except Exception as exc:  # no reply, or Redis refused this XADD: not durable
            log.error("usage events not durable", extra={"events": 1, "error": str(exc)})
            raise MeteringUnavailable(str(exc)) from None
        self.written += 1

    async def _write(self, events: list[dict[str, Any]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        seal = self.keyring.seal
        for e in events:
            pipe.xadd(self.stream, seal(e))
        await pipe.execute()

    async def replay(self, directory: Path | None = None, *, writing: Path | None = None) -> int:
        """Append the fallback's lines (``SpoolSink`` files) to the stream, from each file's saved offset, as they
        were signed; save the offset after each append; delete a file fully replayed that nobody writes any more
        (``writing``: this process's open file; the files of another process once idle past ``SPOOL_IDLE_S``).
        A file another process is replaying (its lock) is skipped. Returns the lines appended; raises when Redis
        does not take them."""
        d = Path(directory or fallback_dir())
        if not d.is_dir():
            return 0
        appended = 0
        for path in sorted(d.glob("*.jsonl")):
            appended += await self._replay_file(path, writing)
        return appended

    async def _replay_file(self, path: Path, writing: Path | None) -> int:
        import fcntl

        try:
            f = path.open("rb")
        except FileNotFoundError:  # deleted by another process's replay
            return 0
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            marker = path.with_suffix(".offset")
            offset = int(marker.read_text() or 0) if marker.exists() else 0
            appended = 0
            while True:
                f.seek(offset)
                data = f.read(SPOOL_ROTATE_BYTES)
                lines = data[:data.rfind(b"\n") + 1].split(b"\n")[:-1][:FALLBACK_REPLAY_LINES]
                if not lines:
                    break
                pipe = self.redis.pipeline(transaction=False)
                for line in lines:
                    pipe.xadd(self.stream, _stream_fields(line))
                await pipe.execute()
                offset += sum(len(line) + 1 for line in lines)
                tmp = marker.with_suffix(".offset.tmp")
                tmp.write_text(str(offset))
                os.replace(tmp, marker)
                appended += len(lines)
            if appended:
                log.warning("usage events replayed from the gateway's fallback", extra={"events": appended,
                                                                                        "file": path.name})
            st = os.fstat(f.fileno())
            ours = writing is not None and path.name.rsplit("-", 1)[0] == writing.name.rsplit("-", 1)[0]
            if offset >= st.st_size and path != writing and (ours or time.time() - st.st_mtime > SPOOL_IDLE_S):
                path.unlink(missing_ok=True)
                marker.unlink(missing_ok=True)
        return appended


def _stream_fields(line: bytes) -> dict[str, str | bytes]:
    """A spool line as a stream entry: its three fields as they were signed; anything else kept whole (cut to
    DEAD_LETTER_FIELD_BYTES) in one field, which the consumer refuses as unsigned and dead-letters."""
    fields = signing.spool_fields(line)
    if fields is not None and all(isinstance(fields.get(k), str) for k in ("e", "k", "s")):
        return {k: fields[k] for k in ("e", "k", "s")}
    return {"line": line[:DEAD_LETTER_FIELD_BYTES]}


def fallback_dir() -> Path:
    return Path(settings.TESSERA_USAGE_SPOOL_DIR) / FALLBACK


class SpoolSink(UsageSink):
    """An append-only local file per gateway process, fsync-ed per batch; rotated by size and age."""

    def __init__(self, directory: Path | None = None) -> None:
        super().__init__()
        self.dir = Path(directory or settings.TESSERA_USAGE_SPOOL_DIR)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._file: Any = None
        self._opened = 0.0
        self.writing: Path | None = None  # the file appended to now
        self.keyring = signing.keyring()

    def _target(self) -> Any:
        if self._file is not None and (self._file.tell() > SPOOL_ROTATE_BYTES
                                       or time.monotonic() - self._opened > SPOOL_ROTATE_S):
            self._file.close()
            self._file = None
        if self._file is None:
            name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.jsonl"
            fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._file = os.fdopen(fd, "ab")
            self._opened = time.monotonic()
            self.writing = self.dir / name
        return self._file

    def _write_sync(self, events: list[dict[str, Any]]) -> None:
        f = self._target()
        seal = self.keyring.seal
        f.write("".join(signing.spool_line(seal(e)) for e in events).encode())
        f.flush()
        os.fsync(f.fileno())

    async def _write(self, events: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self._write_sync, events)

    async def close(self) -> None:
        await super().close()
        if self._file is not None:
            self._file.close()
            self._file = None
            self.writing = None


# --- the consumer (sync, Django) ----------------------------------------------------------------------------

def _rows(events: list[dict[str, Any]]) -> dict[int, list[tuple]]:
    by_tenant: dict[int, dict[str, tuple]] = defaultdict(dict)
    for e in events:
        try:
            ms = e.get("ms")
            row = (str(e["id"]), int(e["d"]), datetime.fromtimestamp(float(e["ts"]), UTC), int(e["i"]), int(e["o"]), 1,
                   int(ms) if ms is not None else None, str(e.get("a") or "")[:64], str(e.get("k") or "")[:16])
            by_tenant[int(e["t"])].setdefault(row[0], row)
        except (KeyError, TypeError, ValueError):
            log.error("malformed usage event dropped", extra={"event": str(e)[:200]})
    return {t: list(rows.values()) for t, rows in by_tenant.items()}


def store(events: list[dict[str, Any]]) -> int:
    """Write events through the idempotent ingest, one transaction per tenant; returns how many were new."""
    from telemetry.services.ingest import store_rows

    return sum(store_rows(tenant, rows) for tenant, rows in sorted(_rows(events).items()))


def _consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def sync_redis() -> Any:
    import redis

    return redis.Redis.from_url(settings.REDIS_URL)


def _ensure_group(r: Any, stream: str) -> None:
    import redis

    try:
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _entry_id(entry_id: Any) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _decode(entries: list, keyring: signing.Keyring) -> tuple[list[bytes], list[dict[str, Any]], list[tuple]]:
    """Every entry's id; the events of the well-signed ones; (entry id, fields, Refused) of the others."""
    from telemetry.services.refusals import Refused

    ids, events, refused = [], [], []
    for entry_id, fields in entries or []:
        ids.append(entry_id)
        if fields is None:  # deleted while pending (Redis before 7 still lists it): nothing to read or bill
            log.warning("usage stream entry deleted while pending; acked", extra={"entry": _entry_id(entry_id)})
            continue
        e, reason = keyring.open(fields)
        if e is not None:
            events.append(e)
        else:
            refused.append((entry_id, fields, Refused(_entry_id(entry_id), reason or "malformed",
                                                      signing.claimed_tenant(fields))))
    return ids, events, refused


def _dead_letter_fields(fields: Any, reason: str, entry_id: Any) -> dict[Any, Any]:
    """What of a refused entry is kept: its first fields, each cut to DEAD_LETTER_FIELD_BYTES, and why."""
    kept: dict[Any, Any] = {}
    items = list(fields.items())[:16] if isinstance(fields, dict) else []
    for k, v in items:
        name = k if isinstance(k, bytes) else str(k).encode()
        if name in (b"refused", b"entry"):
            name = b"orig_" + name
        kept[name[:64]] = (v if isinstance(v, bytes) else str(v).encode())[:DEAD_LETTER_FIELD_BYTES]
    kept[b"refused"] = reason.encode()
    kept[b"entry"] = _entry_id(entry_id).encode()
    return kept


def dead_letter_stream(stream: str | None = None) -> str:
    return f"{stream or settings.TESSERA_USAGE_STREAM}:refused"


def consume_stream(r: Any = None, *, stream: str | None = None, count: int = 5000, block_ms: int | None = None,
                   consumer: str | None = None) -> tuple[int, int, int]:
    """One batch from the stream: (entries processed, new events stored, entries refused)."""
    r = r or sync_redis()
    stream = stream or settings.TESSERA_USAGE_STREAM
    me = consumer or _consumer_name()
    _ensure_group(r, stream)
    _next, entries, *_ = r.xautoclaim(stream, GROUP, me, min_idle_time=CLAIM_IDLE_MS, start_id="0-0", count=count)
    if not entries:
        got = r.xreadgroup(GROUP, me, {stream: ">"}, count=count, block=block_ms)
        entries = got[0][1] if got else []
    if not entries:
        return 0, 0, 0
    ids, events, refused = _decode(entries, signing.keyring())
    new = store(events)
    dead = dead_letter_stream(stream)
    if refused:  # counted before the ack: a consumer killed in between counts them again, never loses them
        from telemetry.services import refusals

        refusals.record([x for _, _, x in refused], source=stream, dead_letter=dead)
    pipe = r.pipeline(transaction=True)  # the copies, the acks and the deletes together
    for entry_id, fields, x in refused:
        pipe.xadd(dead, _dead_letter_fields(fields, x.reason, entry_id), maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    pipe.xack(stream, GROUP, *ids)
    pipe.xdel(stream, *ids)
    pipe.execute()
    return len(ids), new, len(refused)


def _dead_spool(d: Path, lines: list[bytes]) -> None:
    """Append refused spool lines to the spool's dead letter (one older file kept past SPOOL_ROTATE_BYTES)."""
    dead = d / DEAD_SPOOL
    if dead.exists() and dead.stat().st_size > SPOOL_ROTATE_BYTES:
        os.replace(dead, d / f"{DEAD_SPOOL}.1")
    fd = os.open(dead, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as f:
        f.write(b"".join(line[:DEAD_LETTER_FIELD_BYTES] + b"\n" for line in lines))


def requeue_refused(r: Any = None, *, stream: str | None = None, count: int = 1000) -> tuple[int, int]:
    """Entries of the dead-letter stream that verify now (signed with a key the consumer lacked when it read them:
    a rotation done in the wrong order) go back to the usage stream, to be consumed (and checked) again; the others
    stay. Returns (requeued, left)."""
    r = r or sync_redis()
    stream = stream or settings.TESSERA_USAGE_STREAM
    dead = dead_letter_stream(stream)
    keyring = signing.keyring()
    requeued = left = 0
    start = "-"
    while True:
        entries = r.xrange(dead, min=start, count=count)
        if not entries:
            return requeued, left
        pipe = r.pipeline(transaction=True)
        for entry_id, fields in entries:
            e, _reason = keyring.open(fields)
            if e is None:
                left += 1
                continue
            pipe.xadd(stream, {name: fields[name.encode()] for name in ("e", "k", "s")})
            pipe.xdel(dead, entry_id)
            requeued += 1
        pipe.execute()
        start = f"({_entry_id(entries[-1][0])}"


def consume_spool(directory: Path | None = None, *, max_events: int = 20_000) -> tuple[int, int, int]:
    """Read spool files from their saved offsets; delete files fully read and idle. (lines read, new events
    stored, lines refused)."""
    from telemetry.services.refusals import Refused, record

    d = Path(directory or settings.TESSERA_USAGE_SPOOL_DIR)
    if not d.is_dir():
        return 0, 0, 0
    keyring = signing.keyring()
    seen = new = refused_total = 0
    for path in sorted(d.glob("*.jsonl")):
        marker = path.with_suffix(".offset")
        offset = int(marker.read_text() or 0) if marker.exists() else 0
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only: a line being written is read next time
        if end:
            events, refused, dead = [], [], []
            at = offset
            for line in data[:end].split(b"\n")[:-1]:
                fields = signing.spool_fields(line)
                e, reason = keyring.open(fields)
                if e is not None:
                    events.append(e)
                else:
                    refused.append(Refused(f"{path.name}:{at}", reason or "malformed", signing.claimed_tenant(fields)))
                    dead.append(line)
                at += len(line) + 1
            new += store(events)
            if refused:
                record(refused, source=str(d), dead_letter=str(d / DEAD_SPOOL))
                _dead_spool(d, dead)
            seen += len(events) + len(refused)
            refused_total += len(refused)
            tmp = marker.with_suffix(".offset.tmp")
            tmp.write_text(str(offset + end))
            os.replace(tmp, marker)
        elif offset >= path.stat().st_size and time.time() - path.stat().st_mtime > SPOOL_IDLE_S:
            path.unlink(missing_ok=True)
            marker.unlink(missing_ok=True)
        if seen >= max_events:
            break
    return seen, new, refused_total


def consume(*, budget_s: float = 20.0, block_ms: int | None = None) -> dict[str, int]:
    """Drain what is there (the beat task and the consumer command): Redis stream when REDIS_URL is set,
    else the spool. Returns entries processed, new events stored and entries refused (never billed)."""
    deadline = time.monotonic() + budget_s
    total = new_total = refused_total = 0
    r = sync_redis() if settings.REDIS_URL else None
    while time.monotonic() < deadline:
        seen, new, refused = consume_stream(r, block_ms=block_ms) if r is not None else consume_spool()
        total, new_total, refused_total = total + seen, new_total + new, refused_total + refused
        if not seen:
            break
    return {"processed": total, "new": new_total, "refused": refused_total}
