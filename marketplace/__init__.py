"""Tessera's project package (settings, root URLs, Celery app) and the marketplace app:
catalog, fleet, placement, tiers, orders and allocations, provisioning, deployments, billing."""

from .celery import app as celery_app

__all__ = ("celery_app",)
