"""The inference gateway: the data plane in front of the slices' Triton servers.

Tenants call their models here (OpenAI-compatible and KServe v2 / Triton routes) with an API key that has the
``inference`` scope. The gateway authenticates from an in-memory table of keys, tenants and routes that a
background refresh reloads from the database every few seconds (no query per request), admits the request
against limits shared by every gateway process (Redis), forwards it to the least busy ready deployment of that
name, counts the tokens the model reported and makes one usage event per request durable (a Redis stream, or
a local append-only spool without Redis) before the last byte of the answer goes out. A consumer writes the
events into the database through the idempotent ingest (``metering.consume``).

Modules: ``protocol`` (pure translation and errors), ``state`` (the tables and their refresh), ``limits``,
``metering`` (sinks and the consumer), ``upstream`` (the Triton client and balancer), ``app`` (the ASGI app).
"""
