"""Hardware access (NVML, Triton) behind one interface with real and simulated backends."""

from __future__ import annotations

import os


def setting(name: str) -> str | None:
    """A Django setting if Django is configured, else the environment variable (the hardware
    modules also run without Django: the probe, the benchmarks)."""
    try:
        from django.conf import settings  # optional dependency

        if settings.configured and getattr(settings, name, None) not in (None, ""):
            return str(getattr(settings, name))
    except ImportError:
        pass
    return os.environ.get(name) or None
