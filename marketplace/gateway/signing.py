"""Signed usage events: a process that can write to the usage stream (or to a spool file) but does not hold the
key cannot make a bill.

Every event a gateway makes durable is stored as three fields, in the Redis stream and in the spool alike:

- ``e``: the event's JSON (``metering.event``), the exact bytes that are signed;
- ``k``: the id of the key that signed it (the first 12 hex digits of ``HMAC(key, "tessera usage key id")``:
  it names a key without revealing it, so a rotation needs no version number to keep in step);
- ``s``: ``HMAC-SHA256(key, e)`` in hex.

The consumer checks the signature before it reads the JSON and refuses, with a reason, an entry that is
``unsigned`` (no ``s``), ``malformed`` (no ``e``, no ``k``, or signed JSON that is not an event object),
``unknown_key`` (``k`` names neither accepted key) or ``forged`` (the signature does not match; compared in
constant time). The accepted keys: ``TESSERA_USAGE_SIGNING_KEY`` (the one gateways sign with) and
``TESSERA_USAGE_SIGNING_KEY_PREVIOUS`` (still accepted while a rotation drains). Unset, the key is derived from
``SECRET_KEY`` with its own salt (and ``SECRET_KEY_FALLBACKS`` give the previous ones), so a fresh installation
signs and checks out of the box; a production installation sets its own key on the gateways and the consumer only
(node workers hold ``SECRET_KEY``, not this key).

Costs on the gateway's hot path: one HMAC over ~100 bytes per event (``hmac.copy`` of a keyed state, about a
microsecond; tests/bench/usage_signing.py) and 76 more bytes per stream entry.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.utils.crypto import salted_hmac

SALT = "tessera.usage-events.signing-key"
KEY_ID_MESSAGE = b"tessera usage key id"
REASONS = ("unsigned", "malformed", "unknown_key", "forged")
MAX_CLAIM_BYTES = 65_536  # a refused entry's JSON is read (for the tenant it claims) only up to this size


def key_id(key: bytes) -> str:
    return hmac.new(key, KEY_ID_MESSAGE, hashlib.sha256).hexdigest()[:12]


def derived_key(secret: str) -> bytes:
    """The default key: SECRET_KEY through Django's salted HMAC with this module's own salt."""
    return salted_hmac(SALT, "usage events", secret=secret, algorithm="sha256").digest()


def dumps(event: Mapping[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode()


def _field(fields: Mapping[Any, Any], name: str) -> bytes | None:
    value = fields.get(name)
    if value is None:
        value = fields.get(name.encode())
    if isinstance(value, str):
        return value.encode()
    return value if isinstance(value, bytes) else None


class Keyring:
    """The key events are signed with, and every key whose signatures are accepted, by key id."""

    def __init__(self, current: bytes, accepted: tuple[bytes, ...] = ()) -> None:
        self.kid = key_id(current)
        self._mac = hmac.new(current, digestmod=hashlib.sha256)  # keyed once; each signature copies it
        self.keys: dict[str, bytes] = {}
        for key in (*accepted, current):
            self.keys[key_id(key)] = key

    def sign(self, data: bytes) -> str:
        mac = self._mac.copy()
        mac.update(data)
        return mac.hexdigest()

    def seal(self, event: Mapping[str, Any]) -> dict[str, bytes | str]:
        """The stored form of one event: the fields of its stream entry (and of its spool line)."""
        data = dumps(event)
        return {"e": data, "k": self.kid, "s": self.sign(data)}

    def open(self, fields: Mapping[Any, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
        """(the event, None) for a well-signed entry, else (None, the reason it is refused)."""
        fields = fields if isinstance(fields, Mapping) else {}
        data, kid, sig = _field(fields, "e"), _field(fields, "k"), _field(fields, "s")
        if sig is None:
            return None, "unsigned"
        if data is None or kid is None:
            return None, "malformed"
        key = self.keys.get(kid.decode(errors="replace"))
        if key is None:
            return None, "unknown_key"
        expected = hmac.new(key, data, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(expected, sig):
            return None, "forged"
        try:  # only now is the JSON read: it is a gateway's
            event = json.loads(data)
        except ValueError:
            return None, "malformed"
        return (event, None) if isinstance(event, dict) else (None, "malformed")


def spool_line(sealed: Mapping[str, bytes | str]) -> str:
    """A spool line: the stream entry's three fields as one JSON object (the event's JSON as a string)."""
    data = sealed["e"]
    return json.dumps({"e": data.decode() if isinstance(data, bytes) else data, "k": sealed["k"],
                       "s": sealed["s"]}, separators=(",", ":")) + "\n"


def spool_fields(line: bytes) -> dict[str, Any] | None:
    """A spool line's fields (None: not a JSON object, which ``Keyring.open`` refuses as unsigned)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def claimed_tenant(fields: Mapping[Any, Any] | None) -> int | None:
    """The tenant id a refused entry claims (for the operator's alert), if it names one; never trusted."""
    data = _field(fields, "e") if isinstance(fields, Mapping) else None
    if data is None or len(data) > MAX_CLAIM_BYTES:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    t = obj.get("t") if isinstance(obj, dict) else None
    return t if type(t) is int and 0 < t < 2**63 else None


@functools.lru_cache(maxsize=8)
def _keyring(configured: str, previous: str, secret: str, fallbacks: tuple[str, ...]) -> Keyring:
    accepted: tuple[bytes, ...] = (previous.encode(),) if previous else ()
    if configured:
        current = configured.encode()
    else:
        current = derived_key(secret)
        accepted += tuple(derived_key(s) for s in fallbacks)
    return Keyring(current, accepted)


def keyring() -> Keyring:
    """The keys from the settings (read at each call: cheap, cached per value)."""
    return _keyring(settings.TESSERA_USAGE_SIGNING_KEY, settings.TESSERA_USAGE_SIGNING_KEY_PREVIOUS,
                    settings.SECRET_KEY, tuple(getattr(settings, "SECRET_KEY_FALLBACKS", ()) or ()))
