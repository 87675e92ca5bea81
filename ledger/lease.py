"""The lease: who may write a task row while it runs (docs/design.md, "Lease" and
"Lifecycle"). Each function runs on the caller's connection and transaction, so a
reminder's side effects can share its completion's statement (:func:`completion_with`).
The hot statements go straight to the DBAPI cursor (psycopg2 ``%(name)s`` parameters),
each prepared once per database session (ledger/prepared.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, TEXT
from sqlalchemy.engine import Connection

from ledger import artifacts, prepared
from ledger.errors import LeaseLost, LedgerError, PermissionLost
from ledger.permissions import MAY_EXPORT_SQL, export_refusal
from ledger.wake import WAKE_SQL

# The lease condition every write of a running execution carries.
_LEASE = (
    "id = %(task_id)s AND run = %(run)s AND execution_id = %(execution_id)s AND status = 'RUNNING'"
)


def _audited(update: str, event: str, effects: str = "", counted: str = "") -> str:
    """``update`` (RETURNING id, run) plus its task_audit row, in one statement; the
    statement returns one row per changed task, so its row count is the update's.
    ``effects``: more CTEs, written only through ``changed``; ``counted``: more columns
    of the returned row (what they wrote)."""
    return f"""
    WITH changed AS ({update}
        RETURNING id, run
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event, execution_id)
        SELECT id, run, {event}, CAST(%(execution_id)s AS uuid) FROM changed
    ){effects}
    SELECT id{counted} FROM changed"""


# Guard: the message's run, and its current publish (stamp = ``dispatched_at``; no stamp,
# only from the ledger's own tests and tools: not checked). A WAITING row is claimed once
# due, starting the next attempt; a RUNNING row only when silent for ``stale_after_s``,
# continuing the attempt (a redelivery to a live execution - kombu restores unacknowledged
# messages on a broker reconnect - claims nothing). Returns the attempt and the owner's
# role now. Does not wait for the WAL flush: a crash that loses the claim revokes the
# lease, and the next durable commit flushes it with everything before it.
CLAIM = """
    SELECT set_config('synchronous_commit', 'off', true);
    WITH claimed AS (
        UPDATE background_tasks
           SET status = 'RUNNING', execution_id = %(execution_id)s, lease_holder = %(holder)s,
               attempts = CASE WHEN status = 'WAITING' THEN attempts + 1
                               ELSE greatest(attempts, 1) END,
               progress = 0, updated_at = now()
         WHERE id = %(task_id)s AND run = %(run)s
           AND ((status = 'WAITING' AND run_at <= now())
                OR (status = 'RUNNING'
                    AND updated_at < now() - make_interval(secs => %(stale_after_s)s)))
           AND (CAST(%(stamp)s AS timestamptz) IS NULL
                OR dispatched_at = CAST(%(stamp)s AS timestamptz))
        RETURNING id, run, kind, team_id, owner_id, scope, filters, attempts
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event, execution_id)
        SELECT id, run, 'CLAIM', %(execution_id)s FROM claimed
    )
    SELECT c.kind, c.team_id, c.owner_id, c.scope, c.filters, c.attempts, m.role
      FROM claimed c
      LEFT JOIN memberships m ON m.team_id = c.team_id AND m.user_id = c.owner_id
"""

# Guard: the lease. Checked before side effects, so a lost lease stops work early; the
# completion's own guard is what makes it safe.
CHECK_LEASE = f"SELECT 1 FROM background_tasks WHERE {_LEASE}"

# How a progress write commits (docs/design.md, "Lease"): asynchronously when the row's
# previous write is less than ``durable_after_s`` old, else as the session says. A CTE of
# the statement itself (planned once), reading the row before the update (the CTEs share
# its snapshot); the update requires it, so the setting applies whenever the update writes.
_PROGRESS_COMMIT = """
    WITH commit_mode AS (
        SELECT set_config('synchronous_commit',
                          CASE WHEN updated_at >= now() - make_interval(secs => %(durable_after_s)s)
                               THEN 'off' ELSE current_setting('synchronous_commit') END,
                          true)
          FROM background_tasks WHERE id = %(task_id)s
    )"""
_PROGRESS_COMMIT_SET = "EXISTS (SELECT FROM commit_mode)"

# Guard: the lease. Commits as _PROGRESS_COMMIT says.
REPORT_PROGRESS = f"""{_PROGRESS_COMMIT}
    UPDATE background_tasks SET progress = %(progress)s, updated_at = now()
     WHERE {_LEASE} AND {_PROGRESS_COMMIT_SET}
"""

# Guard: the lease, and the owner may still run this export (MAY_EXPORT_SQL: a demotion
# committed before this statement stops it, whatever the worker read). Names the
# execution's own CSV (result_key), kept 24 h. Wakes the dispatcher at commit.
COMPLETE_EXPORT = (
    WAKE_SQL
    + ";"
    + _audited(
        f"""
        UPDATE background_tasks
           SET status = 'COMPLETED', progress = 100, result_key = %(execution_id)s,
               result_sha256 = %(sha256)s, result_bytes = %(csv_bytes)s,
               result_object = %(object)s,
               result_summary = %(summary)s, expires_at = now() + interval '24 hours',
               execution_id = NULL, lease_holder = NULL, last_error = NULL, updated_at = now()
         WHERE {_LEASE} AND {MAY_EXPORT_SQL}""",
        "'COMPLETE'",
    )
)

# Why an export's completion wrote nothing: whether the lease is held, the owner's role now.
COMPLETION_REFUSED = """
    SELECT (t.run = %(run)s AND t.execution_id = %(execution_id)s AND t.status = 'RUNNING')
               AS held,
           t.scope, m.role
      FROM background_tasks t
      LEFT JOIN memberships m ON m.team_id = t.team_id AND m.user_id = t.owner_id
     WHERE t.id = %(task_id)s
"""

_COMPLETE_UPDATE = f"""
        UPDATE background_tasks
           SET status = 'COMPLETED', progress = 100, result_summary = %(summary)s,
               execution_id = NULL, lease_holder = NULL, last_error = NULL, updated_at = now()
         WHERE {_LEASE}"""


def completion_with(effects: str, counted: str) -> str:
    """The completion of :data:`COMPLETE` with side effects in the same statement (a
    reminder's): ``effects`` are CTEs (``, name AS (...)``) that write only through
    ``changed``, the completed row, so a lost lease writes none of them; ``counted`` are
    the columns that say what they wrote (``, (SELECT count(*) FROM name)``). Build it
    once: each distinct statement is prepared once per session."""
    return WAKE_SQL + ";" + _audited(_COMPLETE_UPDATE, "'COMPLETE'", effects, counted)


# Guard: the lease; a rollback of the caller's transaction drops the side effects and the
# wake-up with it.
COMPLETE = completion_with("", "")

# Guard: the lease. FAILED, or WAITING and unpublished with run_at = now() + the backoff.
# Wakes the dispatcher at commit.
REPORT_FAILURE = (
    WAKE_SQL
    + ";"
    + _audited(
        f"""
        UPDATE background_tasks
           SET status = %(status)s, last_error = %(message)s, execution_id = NULL,
               lease_holder = NULL, dispatched_at = NULL,
               run_at = CASE WHEN %(status)s = 'WAITING'
                             THEN now() + make_interval(secs => %(delay_s)s) ELSE run_at END,
               updated_at = now()
         WHERE {_LEASE}""",
        "CASE WHEN %(status)s = 'FAILED' THEN 'FAIL' ELSE 'WAIT' END",
    )
)


# Guard: the lease of an execution whose pool process was lost (worker/lost.py). A failed
# attempt, never a recovery: WAITING and unpublished after the backoff, or FAILED on the
# last attempt. Wakes the dispatcher at commit.
REPORT_LOST = (
    WAKE_SQL
    + ";"
    + f"""
    WITH changed AS (
        UPDATE background_tasks
           SET status = CASE WHEN attempts >= %(max_attempts)s THEN 'FAILED' ELSE 'WAITING' END,
               last_error = CASE WHEN attempts >= %(max_attempts)s
                                 THEN %(final_message)s ELSE %(message)s END,
               execution_id = NULL, lease_holder = NULL, dispatched_at = NULL,
               run_at = CASE WHEN attempts >= %(max_attempts)s THEN run_at
                             ELSE now() + make_interval(
                                 secs => %(base_delay_s)s * 2 ^ greatest(attempts - 1, 0)) END,
               updated_at = now()
         WHERE {_LEASE}
        RETURNING id, run, status, attempts, run_at
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event, execution_id)
        SELECT id, run, CASE WHEN status = 'FAILED' THEN 'FAIL' ELSE 'WAIT' END,
               CAST(%(execution_id)s AS uuid)
          FROM changed
    )
    SELECT status, attempts, greatest(extract(epoch FROM run_at - now()), 0) FROM changed"""
)


# Guard: the run's current publish, unclaimed (WAITING, ``dispatched_at`` = the message's
# stamp). Its claim failed for a lasting cause: the attempt it would have started failed
# (WAITING and unpublished after the backoff, or FAILED). Run unprepared, on a connection
# of its own (the claim's may be what failed). Wakes the dispatcher at commit.
CLAIM_REFUSED = (
    WAKE_SQL
    + ";"
    + """
    WITH changed AS (
        UPDATE background_tasks
           SET attempts = attempts + 1,
               status = CASE WHEN attempts + 1 >= %(max_attempts)s THEN 'FAILED' ELSE 'WAITING' END,
               last_error = CASE WHEN attempts + 1 >= %(max_attempts)s
                                 THEN %(final_message)s ELSE %(message)s END,
               dispatched_at = NULL,
               run_at = CASE WHEN attempts + 1 >= %(max_attempts)s THEN run_at
                             ELSE now() + make_interval(
                                 secs => %(base_delay_s)s * 2 ^ attempts) END,
               updated_at = now()
         WHERE id = %(task_id)s AND run = %(run)s AND status = 'WAITING'
           AND dispatched_at = CAST(%(stamp)s AS timestamptz)
        RETURNING id, run, status, attempts, run_at
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event, execution_id)
        SELECT id, run, CASE WHEN status = 'FAILED' THEN 'FAIL' ELSE 'WAIT' END, NULL
          FROM changed
    )
    SELECT status, attempts, greatest(extract(epoch FROM run_at - now()), 0) FROM changed"""
)


MSG_TOO_MANY_RECOVERIES = "The task stopped responding too many times."


class Recovered(NamedTuple):
    """A run the dispatcher took back (:func:`recover_stale`): WAITING, or FAILED past
    ``max_recoveries``."""

    task_id: uuid.UUID
    run: int
    kind: str
    status: str


# Guard: still RUNNING, and silent for stale_after_s or held by a member not among the
# live ones. The heartbeat rule covers only rows last written before ``holders_seen_at``
# (when the caller read the members): a process that registered and claimed after that
# read is missing from it, not dead. Attempts start afresh; past max_recoveries, FAILED.
RECOVER_STALE = text("""
    WITH silent AS (
        SELECT id, execution_id FROM background_tasks
         WHERE status = 'RUNNING'
           AND (updated_at < now() - make_interval(secs => :stale_after_s)
                OR (:use_heartbeats AND lease_holder IS NOT NULL
                    AND lease_holder <> ALL(:live_members)
                    AND updated_at < :holders_seen_at))
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
               attempts = CASE WHEN t.recoveries >= :max_recoveries THEN t.attempts ELSE 0 END,
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


@dataclass(frozen=True)
class Lease:
    task_id: uuid.UUID
    run: int
    execution_id: uuid.UUID
    attempt: int

    def params(self) -> dict[str, Any]:
        return {
            "task_id": str(self.task_id),
            "run": self.run,
            "execution_id": str(self.execution_id),
        }


@dataclass(frozen=True)
class Claim:
    lease: Lease
    kind: str
    team_id: uuid.UUID
    owner_id: uuid.UUID
    scope: str
    filters: dict[str, Any]
    owner_role: str | None  # the owner's role in the team when the claim committed


# Every statement of an execution's own connection is bounded: a frozen database ends a
# statement, never a worker process (ledger/prepared.py).
STATEMENT_TIMEOUT_MS = 60_000


def _execute(conn: Connection, sql: str | bytes, params: dict[str, Any] | None) -> Any:
    """One lease statement on ``conn``'s driver connection (ledger/prepared.py)."""
    return prepared.execute(conn, sql, params, STATEMENT_TIMEOUT_MS)


def claim(
    conn: Connection,
    task_id: uuid.UUID,
    run: int,
    holder: str | None = None,
    stamp: datetime | None = None,
    *,
    stale_after_s: float | None = None,
    execution_id: uuid.UUID | None = None,
) -> Claim | None:
    """Take the lease for ``run`` for the message published with ``stamp``, with
    ``execution_id`` (the worker's main process issues it: worker/lost.py) or a new one;
    None means skip the message. ``stale_after_s`` None: never take a RUNNING row over."""
    execution_id = execution_id or uuid.uuid4()
    params = {
        "task_id": str(task_id),
        "run": run,
        "execution_id": str(execution_id),
        "holder": holder,
        "stamp": stamp,
        "stale_after_s": stale_after_s,
    }
    row = _execute(conn, CLAIM, params).fetchone()
    if row is None:
        return None
    kind, team_id, owner_id, scope, filters, attempt, owner_role = row
    return Claim(
        lease=Lease(task_id=task_id, run=run, execution_id=execution_id, attempt=attempt),
        kind=kind,
        team_id=uuid.UUID(str(team_id)),
        owner_id=uuid.UUID(str(owner_id)),
        scope=scope,
        filters=filters,
        owner_role=owner_role,
    )


def check_lease(conn: Connection, lease: Lease) -> None:
    """Raise LeaseLost unless ``lease`` is still the row's lease."""
    if _execute(conn, CHECK_LEASE, lease.params()).fetchone() is None:
        raise LeaseLost(lease.task_id)


def report_progress(conn: Connection, lease: Lease, progress: int, durable_after_s: float) -> None:
    """Write progress; on an autocommit connection the statement commits by itself,
    durably when the row's previous write is ``durable_after_s`` old or older."""
    if not 0 <= progress <= 100:
        raise ValueError("progress must be within 0..100")
    _write_or_lose(conn, REPORT_PROGRESS, lease, progress=progress, durable_after_s=durable_after_s)


def complete_export(
    conn: Connection, lease: Lease, csv: artifacts.Artifact | bytes | str, summary: str
) -> None:
    """COMPLETED with the CSV the execution stored (an Artifact, ledger/artifacts.py), or
    given the CSV itself (a small one), stored now as chunks under the lease's key.
    Raises LeaseLost, or PermissionLost when the owner may no longer run it."""
    if not isinstance(csv, artifacts.Artifact):
        data = csv.encode() if isinstance(csv, str) else bytes(csv)
        csv = artifacts.store(conn, lease.task_id, lease.execution_id, data)
    params = {
        **lease.params(),
        "sha256": csv.sha256,
        "csv_bytes": csv.size,
        "object": csv.location,
        "summary": summary,
    }
    if _execute(conn, COMPLETE_EXPORT, params).rowcount != 1:
        raise _not_completed(conn, lease)


def _not_completed(conn: Connection, lease: Lease) -> LedgerError:
    """Why an export's completion matched no row: :class:`PermissionLost` when the lease
    is still held (so the owner's role refused it), else :class:`LeaseLost`."""
    row = _execute(conn, COMPLETION_REFUSED, lease.params()).fetchone()
    if row is not None and row[0]:
        refusal = export_refusal(row[1], row[2])
        if refusal is not None:
            return PermissionLost(refusal)
    return LeaseLost(lease.task_id)


def complete_in_transaction(
    conn: Connection, lease: Lease, summary: str, statement: str = COMPLETE, **values: Any
) -> tuple[Any, ...]:
    """Complete inside the caller's transaction, with the side effects ``statement`` (built
    by :func:`completion_with`, its parameters in ``values``) carries; returns its counted
    columns. LeaseLost (nothing written) must roll that transaction back."""
    params = {**lease.params(), "summary": summary, **values}
    row = _execute(conn, statement, params).fetchone()
    if row is None:
        raise LeaseLost(lease.task_id)
    return tuple(row[1:])


def report_failure(
    conn: Connection, lease: Lease, *, final: bool, message: str, retry_in_s: float = 0.0
) -> bool:
    """FAILED (final), or WAITING and ready again ``retry_in_s`` from now by the database's
    clock; False when a newer execution owns the task."""
    params = {
        **lease.params(),
        "status": "FAILED" if final else "WAITING",
        "message": message,
        "delay_s": float(retry_in_s),
    }
    return bool(_execute(conn, REPORT_FAILURE, params).rowcount == 1)


@dataclass(frozen=True)
class FailedAttempt:
    """What :func:`report_lost` or :func:`refuse_claim` wrote: the row's status now
    (WAITING or FAILED), the attempt that failed, and the seconds until the next attempt
    is due (0 if FAILED)."""

    status: str
    attempt: int
    retry_in_s: float


def report_lost(
    dbapi: Any,
    lease: Lease,
    *,
    max_attempts: int,
    base_delay_s: float,
    message: str,
    final_message: str,
) -> FailedAttempt | None:
    """The execution holding ``lease`` lost its process: its attempt failed (with
    ``message``, or ``final_message`` on the last). The row's attempt count decides, not
    ``lease.attempt``. None when that execution holds no lease. On ``dbapi``, a psycopg2
    connection in autocommit (worker/lost.py: no engine), unprepared and bounded."""
    params = {
        **lease.params(),
        "max_attempts": max_attempts,
        "base_delay_s": float(base_delay_s),
        "message": message,
        "final_message": final_message,
    }
    with dbapi.cursor() as cursor:
        cursor.execute(prepared.bounded(REPORT_LOST, STATEMENT_TIMEOUT_MS), params)
        row = cursor.fetchone()
    if row is None:
        return None
    return FailedAttempt(status=row[0], attempt=int(row[1]), retry_in_s=float(row[2]))


def refuse_claim(
    conn: Connection,
    task_id: uuid.UUID,
    run: int,
    stamp: datetime,
    *,
    max_attempts: int,
    base_delay_s: float,
    message: str,
    final_message: str,
) -> FailedAttempt | None:
    """The claim of the message published with ``stamp`` failed for a lasting cause: its
    attempt failed (with ``message``, or ``final_message`` on the last). None when the row
    is not that publish's, unclaimed. Unprepared: a rare path."""
    params = {
        "task_id": str(task_id),
        "run": run,
        "stamp": stamp,
        "max_attempts": max_attempts,
        "base_delay_s": float(base_delay_s),
        "message": message,
        "final_message": final_message,
    }
    row = conn.execute(prepared.as_text(CLAIM_REFUSED), params).fetchone()
    if row is None:
        return None
    return FailedAttempt(status=row[0], attempt=int(row[1]), retry_in_s=float(row[2]))


def _write_or_lose(conn: Connection, sql: str, lease: Lease, **values: Any) -> None:
    if _execute(conn, sql, {**lease.params(), **values}).rowcount != 1:
        raise LeaseLost(lease.task_id)


# Why a claim took nothing (read after it, for the log line; a rare path).
SKIP_REASON = """
    SELECT run, status, dispatched_at, run_at > now() AS early
      FROM background_tasks WHERE id = %(task_id)s
"""


CANCELLED_RUN = """
    SELECT status = 'CANCELLED' AND run = %(run)s FROM background_tasks WHERE id = %(task_id)s
"""


def was_cancelled(conn: Connection, held: Lease) -> bool:
    """After :class:`LeaseLost`: whether the lease went to a cancel of its own run (the
    row CANCELLED at that run), rather than to a newer execution or the dispatcher."""
    row = _execute(conn, CANCELLED_RUN, {"task_id": str(held.task_id), "run": held.run}).fetchone()
    return bool(row is not None and row[0])


class Skip(NamedTuple):
    """Why a claim took nothing: in words, and whether the message's own run was
    cancelled (the message then ends as REVOKED, not as a success)."""

    reason: str
    cancelled: bool = False


def skip_reason(conn: Connection, task_id: uuid.UUID, run: int, stamp: datetime | None) -> Skip:
    """Why :func:`claim` returned None for this message (read after it)."""
    row = _execute(conn, SKIP_REASON, {"task_id": str(task_id)}).fetchone()
    if row is None:
        return Skip("the task does not exist")
    current_run, status, dispatched_at, early = row
    if current_run != run:
        return Skip("the message is for another run")
    if status not in ("WAITING", "RUNNING"):
        return Skip(f"the run has ended ({status})", cancelled=status == "CANCELLED")
    if stamp is not None and dispatched_at != stamp:
        return Skip("the message is not the run's current publish")
    if status == "RUNNING":
        return Skip("the run is held by a live execution")
    return Skip("the run is not due yet" if early else "the run is not claimable")


def recover_stale(
    conn: Connection,
    *,
    stale_after_s: float,
    live_members: Collection[str],
    use_heartbeats: bool,
    holders_seen_at: datetime,
    max_recoveries: int,
    batch: int,
) -> list[Recovered]:
    """Take silent RUNNING rows back to WAITING (or FAILED past ``max_recoveries``).

    ``holders_seen_at``: the database's clock just before ``live_members`` was read
    (:func:`database_now`).
    """
    rows = conn.execute(
        RECOVER_STALE,
        {
            "stale_after_s": stale_after_s,
            "use_heartbeats": use_heartbeats,
            "live_members": list(live_members),
            "max_recoveries": max_recoveries,
            "batch": batch,
            "too_many": MSG_TOO_MANY_RECOVERIES,
            "holders_seen_at": holders_seen_at,
        },
    )
    return [Recovered(row.id, row.run, row.kind, row.status) for row in rows]
