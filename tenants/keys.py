"""API key format and hashing. Format: ``tsk_<prefix>_<secret>``; only SHA-256(key) is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "tsk"


def generate() -> tuple[str, str, str]:
    """Returns (full key shown once, display prefix, hash to store)."""
    prefix = secrets.token_hex(6)  # 12 hex chars, unique per key (indexed)
    secret = secrets.token_urlsafe(32)
    key = f"{KEY_PREFIX}_{prefix}_{secret}"
    return key, prefix, hash_key(key)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_prefix(key: str) -> str | None:
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != 12 or not parts[2]:
        return None
    return parts[1]


def matches(key: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(key), stored_hash)


def new_token() -> tuple[str, str]:
    """An invitation token (shown once, in the e-mail) and its hash."""
    token = secrets.token_urlsafe(32)
    return token, hash_key(token)
