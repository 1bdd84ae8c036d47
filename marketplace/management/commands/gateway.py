"""`manage.py gateway`: run the inference gateway (uvicorn, uvloop, httptools)."""

from __future__ import annotations

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Run the inference gateway: OpenAI-compatible and KServe v2 routes to the tenants' models."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8001)
        parser.add_argument("--workers", type=int, default=1, help="gateway processes (they share limits in Redis)")

    def handle(self, *args, **opts):
        import uvicorn

        uvicorn.run("marketplace.gateway.asgi:app", host=opts["host"], port=opts["port"], workers=opts["workers"],
                    loop="uvloop", http="httptools", lifespan="on", access_log=False, log_level="warning",
                    timeout_keep_alive=30)
