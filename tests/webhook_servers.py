"""Misbehaving HTTP endpoints on loopback for the webhook tests: each connection is served by a plain socket in its own
thread, and every connection's lifetime (accepted, closed by the client) is recorded."""

from __future__ import annotations

import itertools
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Connection:
    accepted: float
    closed: float | None = None  # when the client closed or reset it (time.monotonic())
    received: bytes = b""


@dataclass
class Endpoint:
    """`behave(conn, record)` answers one request; `interval` is the drip's pace for the slow behaviours."""

    behave: str
    interval: float = 1.0
    tls: ssl.SSLContext | None = None  # a server context: the endpoint speaks HTTPS
    connections: list[Connection] = field(default_factory=list)
    port: int = 0
    _sock: socket.socket | None = None
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/hook"

    def start(self) -> Endpoint:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._sock is not None:
            self._sock.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            record = Connection(accepted=time.monotonic())
            self.connections.append(record)
            threading.Thread(target=self._serve, args=(conn, record), daemon=True).start()

    def _serve(self, conn: socket.socket, record: Connection) -> None:
        try:
            if self.tls is not None:
                conn.settimeout(10)
                conn = self.tls.wrap_socket(conn, server_side=True)
            record.received = _read_request(conn)
            getattr(self, f"_{self.behave}")(conn)
        except OSError:
            pass
        finally:
            if record.closed is None:
                record.closed = time.monotonic()
            conn.close()

    def _drip(self, conn: socket.socket, chunks) -> None:
        """Send the next chunk every `interval` until the client goes away (noticed at once, not at the next send)."""
        for chunk in chunks:
            if self._stopped.is_set():
                return
            conn.sendall(chunk)
            readable, _, _ = select.select([conn], [], [], self.interval)
            if readable and not conn.recv(65536, socket.MSG_PEEK):
                return  # closed by the client

    # --- behaviours ---

    def _ok(self, conn: socket.socket) -> None:
        conn.sendall(OK)
        _wait_closed(conn)  # keep-alive: the client must not wait for our close

    def _slow_body(self, conn: socket.socket) -> None:
        """Slow-loris: the headers at once, then the body one byte every `interval`."""
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
        self._drip(conn, itertools.repeat(b"."))

    def _endless_headers(self, conn: socket.socket) -> None:
        """A status line, then a header line every `interval`: the headers never end."""
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        self._drip(conn, (f"X-Slow-{n}: a\r\n".encode() for n in itertools.count()))

    def _silent(self, conn: socket.socket) -> None:
        """Accepts, reads the request, never answers."""
        _wait_closed(conn)

    def _cut_headers(self, conn: socket.socket) -> None:
        """A 200 and part of its headers, then the connection closed: no blank line ends them."""
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n")
        conn.shutdown(socket.SHUT_WR)
        _wait_closed(conn)

    def _big_body(self, conn: socket.socket) -> None:
        """A 200 with a body far larger than what Tessera reads, sent at once; the connection left open."""
        body = b"x" * 1_000_000
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        conn.settimeout(5)
        try:
            conn.sendall(body)
        except OSError:
            pass
        _wait_closed(conn)


def _read_request(conn: socket.socket) -> bytes:
    """The request head and its body (by Content-Length)."""
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    conn.settimeout(None)
    return head + b"\r\n\r\n" + body


def _wait_closed(conn: socket.socket, limit: float = 120) -> None:
    """Until the client closes (recv returns nothing or fails)."""
    conn.settimeout(limit)
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass
