"""`manage.py usage_consumer`: write the gateway's usage stream into the database, continuously."""

from __future__ import annotations

import signal
import time

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Consume the gateway's usage stream (Redis consumer group, or the local spool) into the database."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="drain what is there, then exit")
        parser.add_argument("--idle-sleep", type=float, default=0.5, help="seconds between polls of the spool")
        parser.add_argument("--requeue-refused", action="store_true",
                            help="move the dead-letter stream's entries that verify now (a key rotated in the wrong "
                                 "order) back to the usage stream, then exit")

    def handle(self, *args, **opts):
        import logging

        from django.conf import settings

        from marketplace.gateway import metering

        log = logging.getLogger("tessera.gateway.metering")
        if opts["requeue_refused"]:
            if not settings.REDIS_URL:
                self.stderr.write("--requeue-refused: the dead-letter stream is in Redis (REDIS_URL is not set)")
                return
            requeued, left = metering.requeue_refused()
            self.stdout.write(f"usage consumer: {requeued} refused entries verify now and were requeued, {left} left "
                              f"in {metering.dead_letter_stream()}")
            return
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        while not stop:
            try:
                result = metering.consume(budget_s=5, block_ms=1000 if settings.REDIS_URL else None)
            except Exception as exc:  # the database or Redis is away: nothing acked, try again
                log.error("usage consumer: batch not written; retrying", extra={"error": str(exc)})
                from django.db import connection

                connection.close()
                time.sleep(2)
                continue
            if opts["once"]:
                self.stdout.write(f"usage consumer: {result['processed']} events read, {result['new']} new, "
                                  f"{result['refused']} refused (unsigned or forged: not billed)")
                return
            if not result["processed"] and not settings.REDIS_URL:
                time.sleep(opts["idle_sleep"])
