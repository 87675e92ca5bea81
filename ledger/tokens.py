"""API tokens, stored only as SHA-256 hashes (docs/design.md, "Ledger"). A token is 32
random bytes, so a fast hash is enough; the raw value is shown once and never stored or logged.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger import prepared
from ledger.creation import STATEMENT_TIMEOUT_MS
from ledger.errors import InvalidInput, NotFound

TOKEN_PREFIX = "tdk_"
MAX_TOKEN_CHARS = 200
DEFAULT_TTL_DAYS = 90
MAX_TTL_DAYS = 365
TOUCH_EVERY_S = 60

MSG_TOKEN_NOT_FOUND = "Token not found."
MSG_TTL = f"the expiry must be a whole number of days from 1 to {MAX_TTL_DAYS}"

INSERT_TOKEN = text("""
    INSERT INTO api_tokens (token_hash, user_id, name, expires_at)
    VALUES (:token_hash, :user_id, :name, now() + make_interval(days => :ttl_days))
""")

# The owner's function (migration 0014): the API's role may not read api_tokens.
RESOLVE_FUNCTION = "teamdesk_resolve_token_v1"
RESOLVE_SIGNATURE = "text, double precision"
RESOLVE_TOKEN = f"""
    SELECT token_id, token_user_id
      FROM {RESOLVE_FUNCTION}(%(token_hash)s, CAST(%(touch_every_s)s AS double precision))
"""

LIST_TOKENS = text("""
    SELECT id, name, created_at, last_used_at, expires_at, revoked_at,
           CASE WHEN revoked_at IS NOT NULL THEN 'revoked'
                WHEN expires_at <= now() THEN 'expired'
                ELSE 'active' END AS state
      FROM api_tokens WHERE user_id = :user_id
     ORDER BY created_at, id
""")

# Guard: not yet revoked (revoking twice keeps the first time).
REVOKE_TOKEN = text("""
    UPDATE api_tokens SET revoked_at = now() WHERE id = :token_id AND revoked_at IS NULL
    RETURNING id
""")
TOKEN_EXISTS = text("SELECT 1 FROM api_tokens WHERE id = :token_id")

# The live tokens of these users carrying this name (demo-seed replaces its own).
REVOKE_NAMED = text("""
    UPDATE api_tokens SET revoked_at = now()
     WHERE user_id = ANY(CAST(:user_ids AS uuid[])) AND name = :name AND revoked_at IS NULL
    RETURNING id
""")

USER_EXISTS = text("SELECT 1 FROM users WHERE id = :user_id")
USER_BY_EMAIL = text("SELECT id FROM users WHERE lower(email) = lower(:email)")


@dataclass(frozen=True)
class TokenOwner:
    """Who presented a live token: the token's id (rate limits count per token), its user,
    and its hash (what a download presents again for each chunk, ledger/artifacts.py)."""

    token_id: uuid.UUID
    user_id: uuid.UUID
    token_hash: str


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def create_token(
    conn: Connection,
    user_id: uuid.UUID,
    name: str | None = None,
    ttl_days: int = DEFAULT_TTL_DAYS,
) -> str:
    """Store a new token for ``user_id``, valid ``ttl_days`` days; returns the raw token
    (shown once)."""
    if not 1 <= ttl_days <= MAX_TTL_DAYS:
        raise InvalidInput(MSG_TTL)
    if conn.execute(USER_EXISTS, {"user_id": user_id}).first() is None:
        raise NotFound("User not found.")
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    conn.execute(
        INSERT_TOKEN,
        {"token_hash": hash_token(raw), "user_id": user_id, "name": name, "ttl_days": ttl_days},
    )
    return raw


def resolve_token(conn: Connection, raw: str) -> TokenOwner | None:
    """The live token ``raw`` and its user, or None (unknown, expired or revoked: one
    answer for all three)."""
    if not raw.startswith(TOKEN_PREFIX) or len(raw) > MAX_TOKEN_CHARS:
        return None
    token_hash = hash_token(raw)
    params = {"token_hash": token_hash, "touch_every_s": TOUCH_EVERY_S}
    row = prepared.execute(conn, RESOLVE_TOKEN, params, STATEMENT_TIMEOUT_MS).fetchone()
    if row is None:
        return None
    return TokenOwner(uuid.UUID(str(row[0])), uuid.UUID(str(row[1])), token_hash)


def user_for_token(conn: Connection, raw: str) -> uuid.UUID | None:
    """The user a live bearer token belongs to, or None."""
    owner = resolve_token(conn, raw)
    return None if owner is None else owner.user_id


def list_tokens(conn: Connection, user_id: uuid.UUID) -> list[dict[str, Any]]:
    """The user's tokens, oldest first: ids, names, times and state; never a hash."""
    return [dict(row) for row in conn.execute(LIST_TOKENS, {"user_id": user_id}).mappings()]


def revoke_token(conn: Connection, token_id: uuid.UUID) -> bool:
    """Revoke a token; False when it already was. :class:`NotFound` when there is none."""
    if conn.execute(REVOKE_TOKEN, {"token_id": token_id}).first() is not None:
        return True
    if conn.execute(TOKEN_EXISTS, {"token_id": token_id}).first() is None:
        raise NotFound(MSG_TOKEN_NOT_FOUND)
    return False


def revoke_named(conn: Connection, user_ids: list[uuid.UUID], name: str) -> int:
    """Revoke the live tokens named ``name`` of these users; returns how many."""
    rows = conn.execute(REVOKE_NAMED, {"user_ids": [str(u) for u in user_ids], "name": name})
    return len(rows.fetchall())


def user_id_by_email(conn: Connection, email: str) -> uuid.UUID:
    row = conn.execute(USER_BY_EMAIL, {"email": email}).first()
    if row is None:
        raise NotFound("User not found.")
    return uuid.UUID(str(row.id))
