"""API tokens: random bearer tokens stored only as SHA-256 hashes (table ``api_tokens``).

A token is 32 random bytes, so a fast hash is enough (nothing to brute-force); the raw
value is shown once, at creation, and never stored or logged.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid

from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger.errors import NotFound

TOKEN_PREFIX = "tdk_"

INSERT_TOKEN = text("""
    INSERT INTO api_tokens (token_hash, user_id, name) VALUES (:token_hash, :user_id, :name)
""")
USER_FOR_TOKEN = text("SELECT user_id FROM api_tokens WHERE token_hash = :token_hash")
USER_EXISTS = text("SELECT 1 FROM users WHERE id = :user_id")
USER_BY_EMAIL = text("SELECT id FROM users WHERE lower(email) = lower(:email)")


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def create_token(conn: Connection, user_id: uuid.UUID, name: str | None = None) -> str:
    """Store a new token for ``user_id``; returns the raw token (shown once)."""
    if conn.execute(USER_EXISTS, {"user_id": user_id}).first() is None:
        raise NotFound("User not found.")
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    conn.execute(INSERT_TOKEN, {"token_hash": hash_token(raw), "user_id": user_id, "name": name})
    return raw


def user_for_token(conn: Connection, raw: str) -> uuid.UUID | None:
    """The user a bearer token belongs to, or None for an unknown token."""
    if not raw.startswith(TOKEN_PREFIX) or len(raw) > 200:
        return None
    row = conn.execute(USER_FOR_TOKEN, {"token_hash": hash_token(raw)}).first()
    return None if row is None else uuid.UUID(str(row.user_id))


def user_id_by_email(conn: Connection, email: str) -> uuid.UUID:
    row = conn.execute(USER_BY_EMAIL, {"email": email}).first()
    if row is None:
        raise NotFound("User not found.")
    return uuid.UUID(str(row.id))
