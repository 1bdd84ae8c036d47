"""ASGI entry point of the inference gateway: ``uvicorn marketplace.gateway.asgi:app`` (``manage.py gateway``)."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
django.setup()

from marketplace.gateway.app import build  # noqa: E402 - Django first

app = build()
