"""Hardware access (NVML, Triton) behind one interface with real and simulated backends."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def setting_value(name: str, default: T) -> T:
    """A Django setting (all of them are parsed from the environment in ``marketplace.settings``), or
    ``default`` when Django is not configured or the setting is empty: the hardware modules also run
    without Django (the probe, the benchmarks), with their defaults or explicit arguments."""
    try:
        from django.conf import settings  # optional dependency
    except ImportError:
        return default
    if not settings.configured:
        return default
    value: Any = getattr(settings, name, None)
    return default if value in (None, "") else value


def setting(name: str) -> str | None:
    """A string setting (see ``setting_value``), None when unset."""
    value = setting_value(name, None)
    return None if value is None else str(value)
