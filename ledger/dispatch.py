"""The dispatcher's ledger writes (SPEC §7), each one statement over a bounded batch.

Every selection locks its rows with ``FOR UPDATE SKIP LOCKED`` inside the caller's
transaction, so overlapping scans split the rows between them instead of handling one
twice, and every selection walks a partial index, so a scan's cost follows the number
of rows it has work for, not the size of the table.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, TEXT
from sqlalchemy.engine import Connection

MSG_TOO_MANY_RECOVERIES = "The task stopped responding too many times."
MSG_QUEUE_FAILED = "The task's queue message failed."


@dataclass(frozen=True)
class RunRef:
    task_id: uuid.UUID
    run: int
    kind: str
    status: str = "WAITING"


# Guard: still RUNNING, and silent (no ledger write since stale_before) or held by a
# process whose heartbeat member is gone. Past max_recoveries the run FAILS instead.
# The heartbeat rule only covers rows last written before ``holders_seen_at`` (the
# database's clock when the caller read the live members): a process that registered
# and claimed after that read is missing from the members read, not dead.
RECOVER_STALE = text("""
    WITH silent AS (
        SELECT id, execution_id FROM background_tasks
         WHERE status = 'RUNNING'
           AND (updated_at < :stale_before
                OR (:use_heartbeats AND lease_holder IS NOT NULL
                    AND lease_holder <> ALL(:live_members)
                    AND updated_at < COALESCE(:holders_seen_at, now())))
         ORDER BY updated_at
         LIMIT :batch
           FOR UPDATE SKIP LOCKED
    ), recovered AS (
        UPDATE background_tasks t
           SET status = CASE WHEN t.recoveries >= :max_recoveries THEN 'FAILED' ELSE 'WAITING' END,
               recoveries = CASE WHEN t.recoveries >= :max_recoveries THEN t.recoveries
                                 ELSE t.recoveries + 1 END,
               last_error = CASE WHEN t.recoveries >= :max_recoveries THEN :too_many
                                 ELSE t.last_error END,
               execution_id = NULL, lease_holder = NULL, dispatched_at = NULL, updated_at = now()
          FROM silent
         WHERE t.id = silent.id
        RETURNING t.id, t.run, t.kind, t.status, silent.execution_id AS revoked
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event, execution_id)
        SELECT id, run, 'RECOVER', revoked FROM recovered
    )
    SELECT id, run, kind, status FROM recovered
""").bindparams(bindparam("live_members", type_=ARRAY(TEXT)))

# Rows due for their first publish of this run (partial index ix_background_tasks_due).
LOCK_DUE = text("""
    SELECT id, run, kind FROM background_tasks
     WHERE status = 'WAITING' AND dispatched_at IS NULL AND run_at <= :now
     ORDER BY run_at
     LIMIT :batch
       FOR UPDATE SKIP LOCKED
""")

# Guard: the run is WAITING and unpublished; its queue message is known to have failed.
RECONCILE_FAILED = text("""
    WITH reconciled AS (
        UPDATE background_tasks
           SET status = 'FAILED', last_error = :message, updated_at = now()
         WHERE id = :task_id AND run = :run AND status = 'WAITING' AND dispatched_at IS NULL
        RETURNING id, run
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event) SELECT id, run, 'RECONCILE' FROM reconciled
    )
    SELECT id FROM reconciled
""")

# Guard: the run is WAITING and unpublished (the caller holds the row locks); ``keys``
# are "<id>/<run>" strings, so a row of another run is never stamped.
MARK_MANY_DISPATCHED = text("""
    UPDATE background_tasks SET dispatched_at = :now, updated_at = now()
     WHERE id = ANY(CAST(:ids AS uuid[])) AND id::text || '/' || run = ANY(:keys)
       AND status = 'WAITING' AND dispatched_at IS NULL
    RETURNING id, run, kind
""").bindparams(bindparam("ids", type_=ARRAY(TEXT)), bindparam("keys", type_=ARRAY(TEXT)))

# Guard: still the publish this scan stamped; nothing else happened to the row since.
CLEAR_DISPATCHED = text("""
    UPDATE background_tasks SET dispatched_at = NULL, updated_at = now()
     WHERE id = :task_id AND run = :run AND status = 'WAITING' AND dispatched_at = :stamp
""")

# Published long enough ago that the broker should have delivered it
# (partial index ix_background_tasks_dispatched).
LOCK_PUBLISHED_BEFORE = text("""
    SELECT id, run, kind FROM background_tasks
     WHERE status = 'WAITING' AND dispatched_at IS NOT NULL AND dispatched_at < :before
     ORDER BY dispatched_at
     LIMIT :batch
       FOR UPDATE SKIP LOCKED
""")

# Guard: the run is WAITING and was last published at or before ``before``.
MARK_REDISPATCHED = text("""
    UPDATE background_tasks SET dispatched_at = :now, updated_at = now()
     WHERE id = :task_id AND run = :run AND status = 'WAITING' AND dispatched_at < :before
""")

# CSVs past their 24 h (partial index ix_background_tasks_expiring).
PURGE_EXPIRED = text("""
    WITH expired AS (
        SELECT id FROM background_tasks
         WHERE result_csv IS NOT NULL AND expires_at < :now
         ORDER BY expires_at
         LIMIT :batch
           FOR UPDATE SKIP LOCKED
    )
    UPDATE background_tasks t SET result_csv = NULL, updated_at = now()
      FROM expired WHERE t.id = expired.id
""")


DATABASE_NOW = text("SELECT clock_timestamp()")

# Bounds every statement of the caller's transaction (a scan must not hang on a lock
# or a stuck server); it ends with the transaction.
LIMIT_STATEMENT_TIME = text("SELECT set_config('statement_timeout', :ms, true)")


def database_now(conn: Connection) -> datetime:
    """The database's clock now (the clock ``updated_at`` is written with)."""
    value: datetime = conn.execute(DATABASE_NOW).scalar_one()
    return value


def limit_statement_time(conn: Connection, seconds: float) -> None:
    conn.execute(LIMIT_STATEMENT_TIME, {"ms": str(round(seconds * 1000))})


def _refs(rows: Iterable[object]) -> list[RunRef]:
    return [
        RunRef(row.id, row.run, row.kind, getattr(row, "status", "WAITING"))  # type: ignore[attr-defined]
        for row in rows
    ]


def recover_stale(
    conn: Connection,
    *,
    stale_before: datetime,
    live_members: Collection[str],
    use_heartbeats: bool,
    max_recoveries: int,
    batch: int,
    holders_seen_at: datetime | None = None,
) -> list[RunRef]:
    """Take silent RUNNING rows back to WAITING (or FAILED past ``max_recoveries``).

    ``holders_seen_at``: the database's clock just before ``live_members`` was read
    (:func:`database_now`); None means this transaction's start, which is right when the
    members were read inside this transaction.
    """
    rows = conn.execute(
        RECOVER_STALE,
        {
            "stale_before": stale_before,
            "use_heartbeats": use_heartbeats,
            "live_members": list(live_members),
            "max_recoveries": max_recoveries,
            "batch": batch,
            "too_many": MSG_TOO_MANY_RECOVERIES,
            "holders_seen_at": holders_seen_at,
        },
    )
    return _refs(rows)


def lock_due(conn: Connection, *, now: datetime, batch: int) -> list[RunRef]:
    return _refs(conn.execute(LOCK_DUE, {"now": now, "batch": batch}))


def reconcile_failed(conn: Connection, ref: RunRef) -> bool:
    result = conn.execute(
        RECONCILE_FAILED, {"task_id": ref.task_id, "run": ref.run, "message": MSG_QUEUE_FAILED}
    )
    return result.rowcount == 1


def mark_many_dispatched(conn: Connection, refs: Sequence[RunRef], now: datetime) -> list[RunRef]:
    """Stamp ``dispatched_at`` on the rows about to be published; returns those stamped."""
    if not refs:
        return []
    rows = conn.execute(
        MARK_MANY_DISPATCHED,
        {
            "ids": [str(ref.task_id) for ref in refs],
            "keys": [f"{ref.task_id}/{ref.run}" for ref in refs],
            "now": now,
        },
    )
    return _refs(rows)


def clear_dispatched(conn: Connection, ref: RunRef, stamp: datetime) -> bool:
    result = conn.execute(
        CLEAR_DISPATCHED, {"task_id": ref.task_id, "run": ref.run, "stamp": stamp}
    )
    return result.rowcount == 1


def lock_published_before(conn: Connection, *, before: datetime, batch: int) -> list[RunRef]:
    return _refs(conn.execute(LOCK_PUBLISHED_BEFORE, {"before": before, "batch": batch}))


def mark_redispatched(conn: Connection, ref: RunRef, *, now: datetime, before: datetime) -> bool:
    result = conn.execute(
        MARK_REDISPATCHED, {"task_id": ref.task_id, "run": ref.run, "now": now, "before": before}
    )
    return result.rowcount == 1


def purge_expired(conn: Connection, *, now: datetime, batch: int) -> int:
    return int(conn.execute(PURGE_EXPIRED, {"now": now, "batch": batch}).rowcount)
