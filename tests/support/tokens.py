"""API tokens in the states the tests need: revoked through the ledger, expired by moving
``expires_at`` into the past by the database's clock (time passing, without waiting)."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from ledger.tokens import create_token, hash_token, revoke_token


def token_row(engine: sa.Engine, raw: str) -> dict[str, Any]:
    """The token's row, with ``xmin`` (it changes only when the row is written)."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT xmin::text AS xmin, * FROM api_tokens WHERE token_hash = :h"),
            {"h": hash_token(raw)},
        ).mappings()
        return dict(row.one())


def expire(engine: sa.Engine, raw: str, seconds_ago: int = 1) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE api_tokens SET expires_at = now() - make_interval(secs => :s)"
                " WHERE token_hash = :h"
            ),
            {"h": hash_token(raw), "s": seconds_ago},
        )


def revoke(engine: sa.Engine, raw: str) -> None:
    with engine.begin() as conn:
        assert revoke_token(conn, token_row(engine, raw)["id"])


def new_token(engine: sa.Engine, user_id: uuid.UUID, state: str = "active") -> str:
    """A token of ``user_id`` that is ``active``, ``revoked`` or ``expired``."""
    with engine.begin() as conn:
        raw = create_token(conn, user_id, f"{state} token")
    if state == "revoked":
        revoke(engine, raw)
    elif state == "expired":
        expire(engine, raw)
    else:
        assert state == "active", state
    return raw
