"""A webhook receiver on loopback for the alerting tests: records every POSTed JSON body (Alertmanager's webhook
payload, Alertmanager's /api/v2/alerts list, or Tessera's fallback) and answers 200."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self) -> None:
        self.posts: list[tuple[str, object]] = []
        self.arrived = threading.Condition()
        received, arrived = self.posts, self.arrived

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with arrived:
                    received.append((self.path, json.loads(body or b"null")))
                    arrived.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, pred, timeout: float) -> list:
        """The posts once `pred(posts)` is true; AssertionError after `timeout` seconds without it."""
        with self.arrived:
            if not self.arrived.wait_for(lambda: pred(self.posts), timeout=timeout):
                raise AssertionError(f"not received within {timeout}s: {self.posts!r}")
            return list(self.posts)
