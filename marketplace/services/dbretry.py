"""Deadlocks and serialization failures are not outages: the transaction was rolled back and the
same work, tried again, succeeds. `retry_on_conflict` re-runs a write (outermost transaction only:
inside an outer atomic block the rollback belongs to the caller) a few times with a short backoff.
`is_conflict` tells them apart from a database that went away (the API answers those two differently:
409 "retry" versus 503 "database unavailable")."""

from __future__ import annotations

import functools
import logging
import random
import time

from django.db import OperationalError, connection

log = logging.getLogger("tessera.db")

#: PostgreSQL SQLSTATEs: deadlock_detected, serialization_failure
CONFLICT_SQLSTATES = frozenset({"40P01", "40001"})
ATTEMPTS = 4


def is_conflict(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc  # then its causes and contexts
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (getattr(current, "sqlstate", None) in CONFLICT_SQLSTATES
                or getattr(current, "pgcode", None) in CONFLICT_SQLSTATES):
            return True
        current = current.__cause__ or current.__context__
    return False


def retry_on_conflict(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outermost = not connection.in_atomic_block
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return fn(*args, **kwargs)
            except OperationalError as exc:
                if not outermost or attempt == ATTEMPTS or not is_conflict(exc):
                    raise
                log.warning("deadlock or serialization failure; retrying",
                            extra={"op": fn.__qualname__, "attempt": attempt})
                time.sleep(0.02 * attempt + random.random() * 0.03)  # jitter, not crypto
        raise AssertionError("unreachable")

    return wrapper
