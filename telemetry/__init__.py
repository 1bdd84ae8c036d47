"""Telemetry: NVML collector, Triton scraper, usage metering and rollups, energy, charts, metrics."""
