"""The Celery app, wired to Django settings (CELERY_* names)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")

app = Celery("tessera")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.task(name="tessera.ping")
def ping() -> str:
    """A no-op round trip, used by health checks and as the benchmark baseline."""
    return "pong"
