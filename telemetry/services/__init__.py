"""Metering writes: usage ingest (idempotent, rolled up hourly in the same transaction) and the Triton
statistics scraper."""
