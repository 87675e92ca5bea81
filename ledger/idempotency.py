"""Idempotency keys (docs/design.md, "Idempotent requests"; migration 0016).

A request is known by its fingerprint, the SHA-256 of its route, user and canonical body
(:meth:`IdempotencyKey.of`), so the key table holds no request body.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from psycopg2 import errors as pg_errors
from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger.errors import InvalidInput, LedgerError
from ledger.prepared import as_text

KEPT_HOURS = 24
MAX_KEY_LENGTH = 128
KEY_CHARACTERS = "letters, digits or - _ . : ~ + / ="
KEY_PATTERN = re.compile(rf"[A-Za-z0-9._:~+/=-]{{1,{MAX_KEY_LENGTH}}}")
HEADER = "Idempotency-Key"
PRIMARY_KEY = "pk_idempotency_keys"

MSG_KEY = (
    f"{HEADER} must be 1 to {MAX_KEY_LENGTH} characters, {KEY_CHARACTERS} "
    "(a new UUID per request is a good key)"
)
MSG_KEY_REUSED = (
    f"this {HEADER} was used in the last {KEPT_HOURS} hours for a different request "
    "(another body, route or user); send a new key with a new request"
)

LIVE_SQL = f"created_at > now() - interval '{KEPT_HOURS} hours'"
_THE_KEY = "team_id = CAST(%(team_id)s AS uuid) AND key = %(idem_key)s"

# Before the one-statement creation, in its round trip: the purge may not have run yet.
FORGET_EXPIRED_KEY_SQL = f"DELETE FROM idempotency_keys WHERE {_THE_KEY} AND NOT ({LIVE_SQL})"
# What the key did, read by the creating statement (expired rows were deleted just before).
HELD_SQL = f"SELECT fingerprint, task_id, run FROM idempotency_keys WHERE {_THE_KEY}"
# The key's row, from the creation's ``task`` CTE: inserted only with the task.
CLAIM_SQL = """
    INSERT INTO idempotency_keys (team_id, key, user_id, fingerprint, task_id, run)
    SELECT team_id, %(idem_key)s, owner_id, %(fingerprint)s, id, run FROM task"""

LOCK_KEY = text(
    "SELECT pg_advisory_xact_lock(hashtextextended("
    "'teamdesk.idempotency:' || CAST(:team_id AS text) || ':' || :idem_key, 0))"
)
FORGET_EXPIRED_KEY = as_text(FORGET_EXPIRED_KEY_SQL)
FIND = text(f"""
    SELECT user_id, fingerprint, task_id, run FROM idempotency_keys
     WHERE team_id = :team_id AND key = :idem_key AND {LIVE_SQL}
""")
REMEMBER = text("""
    INSERT INTO idempotency_keys (team_id, key, user_id, fingerprint, task_id, run)
    VALUES (:team_id, :idem_key, :user_id, :fingerprint, :task_id, :run)
""")
# The dispatcher's purge: up to :batch expired keys, oldest first (by the index).
PURGE_EXPIRED = text(f"""
    DELETE FROM idempotency_keys WHERE (team_id, key) IN (
        SELECT team_id, key FROM idempotency_keys
         WHERE NOT ({LIVE_SQL}) ORDER BY created_at LIMIT :batch
           FOR UPDATE SKIP LOCKED)
""")


class KeyInUse(LedgerError):
    """A concurrent request with this Idempotency-Key committed first; read it again."""


@dataclass(frozen=True)
class IdempotencyKey:
    """A request's key and its fingerprint."""

    key: str
    fingerprint: bytes

    @classmethod
    def of(cls, raw: str, request: Mapping[str, Any]) -> IdempotencyKey:
        """The key of a request (``request``: its route, user and body, JSON-able); a key
        given as a structured-field string (``"..."``, as the draft writes it) is taken
        without its quotes. :class:`InvalidInput` when the key is not one we keep."""
        key = raw.strip()
        if len(key) >= 2 and key[0] == key[-1] == '"':
            key = key[1:-1]
        if KEY_PATTERN.fullmatch(key) is None:
            raise InvalidInput(MSG_KEY)
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
        return cls(key, hashlib.sha256(canonical.encode()).digest())

    def params(self) -> dict[str, Any]:
        """The parameters of :data:`CLAIM_SQL` and :data:`HELD_SQL`."""
        return {"idem_key": self.key, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class Remembered:
    """What a key's first request did: the task and the run."""

    task_id: uuid.UUID
    run: int


def find(conn: Connection, team_id: uuid.UUID, key: IdempotencyKey) -> Remembered | None:
    """What ``key`` did in ``team_id`` in the last :data:`KEPT_HOURS` hours, None if
    nothing; :class:`InvalidInput` (:data:`MSG_KEY_REUSED`) when it was another request."""
    row = conn.execute(FIND, {"team_id": team_id, "idem_key": key.key}).one_or_none()
    if row is None:
        return None
    if bytes(row.fingerprint) != key.fingerprint:
        raise InvalidInput(MSG_KEY_REUSED)
    return Remembered(row.task_id, int(row.run))


def hold(conn: Connection, team_id: uuid.UUID, key: IdempotencyKey) -> Remembered | None:
    """Take the key's lock until the caller's transaction ends, free it if it expired, and
    say what it did (:func:`find`): the sequential path's first step."""
    params = {"team_id": team_id, "idem_key": key.key}
    conn.execute(LOCK_KEY, params)
    conn.execute(FORGET_EXPIRED_KEY, params)
    return find(conn, team_id, key)


def remember(
    conn: Connection,
    team_id: uuid.UUID,
    key: IdempotencyKey,
    user_id: uuid.UUID,
    done: Remembered,
) -> None:
    """Record what ``key`` did, in the caller's transaction; :class:`KeyInUse` when a
    concurrent request recorded it first (the caller's transaction is then spoiled)."""
    params = {"team_id": team_id, "idem_key": key.key, "user_id": user_id}
    try:
        conn.execute(
            REMEMBER,
            {**params, "fingerprint": key.fingerprint, "task_id": done.task_id, "run": done.run},
        )
    except sa_exc.IntegrityError as exc:
        if is_key_taken(exc.orig):
            raise KeyInUse() from exc
        raise


def is_key_taken(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a second insert of a key: the primary key's violation."""
    return (
        isinstance(exc, pg_errors.UniqueViolation)
        and getattr(exc.diag, "constraint_name", None) == PRIMARY_KEY
    )


def purge_expired(conn: Connection, *, batch: int) -> int:
    """Remove up to ``batch`` keys older than :data:`KEPT_HOURS` hours (the database's
    clock), in the caller's transaction; how many went."""
    return int(conn.execute(PURGE_EXPIRED, {"batch": batch}).rowcount)
