"""The dispatcher's ledger statements (docs/design.md, "Dispatch"), each one statement.

The ledger is the queue: a WAITING row with ``dispatched_at IS NULL`` is ready once its
``run_at`` has come; stamping ``dispatched_at`` puts it in the *window* (the few runs the
broker holds); a claim takes it out again. Every threshold here is the database's clock
(``now()``); no caller passes a time in.

Selections lock their rows ``FOR UPDATE SKIP LOCKED`` inside the statement that changes
them, so two dispatchers that overlap (a standby taking over) never stamp one row twice;
the round-robin selection ranks before it locks, so an overlapping copy gets fewer rows,
never a row twice. Every selection walks a partial index over live rows, so a pass costs
what it has to do, not what the table holds.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, TEXT, TIMESTAMP
from sqlalchemy.engine import Connection

from ledger.states import KINDS

MSG_TOO_MANY_RECOVERIES = "The task stopped responding too many times."


@dataclass(frozen=True)
class RunRef:
    """One run the dispatcher acts on; ``stamp`` is its ``dispatched_at`` when published."""

    task_id: uuid.UUID
    run: int
    kind: str
    status: str = "WAITING"
    stamp: datetime | None = None


# Guard: still RUNNING, and silent (no ledger write for stale_after_s, database clock) or
# held by a process whose heartbeat member is gone. Past max_recoveries the run FAILS.
# A recovered run starts its attempts afresh: stalls have their own budget
# (max_recoveries); the attempt budget is for errors the task itself raised.
# The heartbeat rule only covers rows last written before ``holders_seen_at`` (the
# database's clock when the caller read the live members): a process that registered
# and claimed after that read is missing from the members read, not dead.
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

# The window per kind: runs published and not yet claimed (ix_background_tasks_dispatched);
# the kinds with a run ready now (ix_background_tasks_due); and how long until the next
# scheduled run becomes ready.
WINDOW_STATE = text("""
    SELECT (SELECT coalesce(jsonb_object_agg(kind, n), '{}'::jsonb)
              FROM (SELECT kind, count(*) AS n FROM background_tasks
                     WHERE status = 'WAITING' AND dispatched_at IS NOT NULL
                     GROUP BY kind) k) AS queued,
           ARRAY(SELECT k.kind FROM unnest(CAST(:kinds AS text[])) AS k(kind)
                  WHERE EXISTS (SELECT 1 FROM background_tasks b
                                 WHERE b.status = 'WAITING' AND b.dispatched_at IS NULL
                                   AND b.run_at <= now() AND b.kind = k.kind)) AS ready,
           (SELECT extract(epoch FROM min(run_at) - now()) FROM background_tasks
             WHERE status = 'WAITING' AND dispatched_at IS NULL AND run_at > now()) AS next_due_s
""").bindparams(bindparam("kinds", type_=ARRAY(TEXT)))

# Guard: WAITING, unpublished, due by the database's clock. Chooses up to :n ready runs of
# one kind, round-robin over teams: a loose index scan finds the teams with ready rows
# (ix_background_tasks_ready), each team offers its oldest rows up to its share
# (:cap minus what it has in flight; :cap 0 = no cap), and the rows are ranked by their
# team's load after taking them, so the least loaded team goes first. The chosen rows are
# locked, re-checked and stamped in the same statement; returned in publish order.
STAMP_READY = text("""
    WITH RECURSIVE busy AS (
        (SELECT b.team_id FROM background_tasks b
          WHERE b.kind = :kind AND b.status = 'WAITING' AND b.dispatched_at IS NULL
          ORDER BY b.team_id LIMIT 1)
        UNION ALL
        SELECT (SELECT b.team_id FROM background_tasks b
                 WHERE b.kind = :kind AND b.status = 'WAITING' AND b.dispatched_at IS NULL
                   AND b.team_id > busy.team_id
                 ORDER BY b.team_id LIMIT 1)
          FROM busy WHERE busy.team_id IS NOT NULL
    ), load AS (
        SELECT busy.team_id,
               (SELECT count(*) FROM background_tasks r
                 WHERE r.team_id = busy.team_id
                   AND (r.status = 'RUNNING'
                        OR (r.status = 'WAITING' AND r.dispatched_at IS NOT NULL))) AS n
          FROM busy WHERE busy.team_id IS NOT NULL
    ), candidates AS (
        SELECT c.id, c.run_at, load.n + c.rn AS slot
          FROM load CROSS JOIN LATERAL (
              SELECT b.id, b.run_at, row_number() OVER (ORDER BY b.run_at, b.id) AS rn
                FROM background_tasks b
               WHERE b.kind = :kind AND b.team_id = load.team_id AND b.status = 'WAITING'
                 AND b.dispatched_at IS NULL AND b.run_at <= now()
               ORDER BY b.run_at, b.id
               LIMIT CASE WHEN :cap > 0 THEN least(:n, greatest(:cap - load.n, 0)) ELSE :n END
          ) c
    ), picked AS (
        SELECT id, slot, run_at FROM candidates ORDER BY slot, run_at, id LIMIT :n
    ), locked AS (
        SELECT t.id FROM background_tasks t JOIN picked p ON p.id = t.id
         WHERE t.status = 'WAITING' AND t.dispatched_at IS NULL
           FOR UPDATE OF t SKIP LOCKED
    ), stamped AS (
        UPDATE background_tasks t SET dispatched_at = now(), updated_at = now()
          FROM locked WHERE t.id = locked.id
        RETURNING t.id, t.run, t.kind, t.dispatched_at
    )
    SELECT s.id, s.run, s.kind, s.dispatched_at AS stamp
      FROM stamped s JOIN picked p ON p.id = s.id
     ORDER BY p.slot, p.run_at, p.id
""")

# The kinds among :kinds with a run ready now (the scan warns when nobody consumes them).
READY_KINDS = text("""
    SELECT k.kind FROM unnest(CAST(:kinds AS text[])) AS k(kind)
     WHERE EXISTS (SELECT 1 FROM background_tasks b
                    WHERE b.kind = k.kind AND b.status = 'WAITING' AND b.dispatched_at IS NULL
                      AND b.run_at <= now())
""").bindparams(bindparam("kinds", type_=ARRAY(TEXT)))

# Guard: still the publish this dispatcher stamped (``stamp``); nothing happened since.
# Used when the broker refused the message: the run is ready again.
UNSTAMP = text("""
    UPDATE background_tasks SET dispatched_at = NULL, updated_at = now()
     WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'WAITING' AND dispatched_at = :stamp
""").bindparams(bindparam("ids", type_=ARRAY(TEXT)))

# Published at least :grace_s ago (database clock) and still not claimed
# (ix_background_tasks_dispatched): the runs whose message may have been lost.
PUBLISHED_BEFORE = text("""
    SELECT id, run, kind, dispatched_at AS stamp FROM background_tasks
     WHERE status = 'WAITING' AND dispatched_at IS NOT NULL
       AND dispatched_at < now() - make_interval(secs => :grace_s)
     ORDER BY dispatched_at
     LIMIT :batch
""")

# Guard: WAITING and still carrying the stamp the caller judged lost (locks it; a row
# claimed or re-stamped meanwhile is left alone). Stamps it anew for the re-publish.
RESTAMP = text("""
    WITH judged AS (
        SELECT j.id, j.stamp
          FROM unnest(CAST(:ids AS uuid[]), CAST(:stamps AS timestamptz[])) AS j(id, stamp)
    ), lost AS (
        SELECT t.id FROM background_tasks t JOIN judged j ON j.id = t.id
         WHERE t.status = 'WAITING' AND t.dispatched_at = j.stamp
           FOR UPDATE OF t SKIP LOCKED
    )
    UPDATE background_tasks t SET dispatched_at = now(), updated_at = now()
      FROM lost WHERE t.id = lost.id
    RETURNING t.id, t.run, t.kind, t.dispatched_at AS stamp
""").bindparams(
    bindparam("ids", type_=ARRAY(TEXT)), bindparam("stamps", type_=ARRAY(TIMESTAMP(timezone=True)))
)

# CSVs past their 24 h, by the database's clock (ix_background_tasks_expiring).
PURGE_EXPIRED = text("""
    WITH expired AS (
        SELECT id FROM background_tasks
         WHERE result_csv IS NOT NULL AND expires_at < now()
         ORDER BY expires_at
         LIMIT :batch
           FOR UPDATE SKIP LOCKED
    )
    UPDATE background_tasks t SET result_csv = NULL, updated_at = now()
      FROM expired WHERE t.id = expired.id
""")

DATABASE_NOW = text("SELECT clock_timestamp()")

# Bounds every statement of the caller's transaction (a pass must not hang on a lock or a
# stuck server); it ends with the transaction.
LIMIT_STATEMENT_TIME = text("SELECT set_config('statement_timeout', :ms, true)")


@dataclass(frozen=True)
class WindowState:
    """Runs published and not yet claimed per kind, the kinds with a run ready now, and
    seconds until the next scheduled run is ready."""

    queued: dict[str, int]
    ready: frozenset[str]
    next_due_s: float | None


def database_now(conn: Connection) -> datetime:
    """The database's clock now (the clock ``updated_at`` is written with)."""
    value: datetime = conn.execute(DATABASE_NOW).scalar_one()
    return value


def limit_statement_time(conn: Connection, seconds: float) -> None:
    conn.execute(LIMIT_STATEMENT_TIME, {"ms": str(round(seconds * 1000))})


def _refs(rows: Iterable[object]) -> list[RunRef]:
    return [
        RunRef(
            row.id,  # type: ignore[attr-defined]
            row.run,  # type: ignore[attr-defined]
            row.kind,  # type: ignore[attr-defined]
            getattr(row, "status", "WAITING"),
            getattr(row, "stamp", None),
        )
        for row in rows
    ]


def recover_stale(
    conn: Connection,
    *,
    stale_after_s: float,
    live_members: Collection[str],
    use_heartbeats: bool,
    holders_seen_at: datetime,
    max_recoveries: int,
    batch: int,
) -> list[RunRef]:
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
    return _refs(rows)


def window_state(conn: Connection) -> WindowState:
    row = conn.execute(WINDOW_STATE, {"kinds": list(KINDS)}).one()
    queued = {kind: int(row.queued.get(kind, 0)) for kind in KINDS}
    next_due = None if row.next_due_s is None else max(0.0, float(row.next_due_s))
    return WindowState(queued, frozenset(row.ready), next_due)


def stamp_ready(conn: Connection, *, kind: str, n: int, team_cap: int) -> list[RunRef]:
    """Stamp up to ``n`` ready runs of ``kind``, round-robin over teams; in publish order."""
    if n <= 0:
        return []
    return _refs(conn.execute(STAMP_READY, {"kind": kind, "n": n, "cap": team_cap}))


def ready_kinds(conn: Connection, kinds: Collection[str]) -> set[str]:
    return {str(row.kind) for row in conn.execute(READY_KINDS, {"kinds": list(kinds)})}


def unstamp(conn: Connection, refs: Sequence[RunRef]) -> int:
    """Make runs whose publish failed ready again (only if still carrying their stamp)."""
    cleared = 0
    for stamp in {ref.stamp for ref in refs}:
        ids = [str(ref.task_id) for ref in refs if ref.stamp == stamp]
        cleared += int(conn.execute(UNSTAMP, {"ids": ids, "stamp": stamp}).rowcount)
    return cleared


def published_before(conn: Connection, *, grace_s: float, batch: int) -> list[RunRef]:
    return _refs(conn.execute(PUBLISHED_BEFORE, {"grace_s": grace_s, "batch": batch}))


def restamp(conn: Connection, refs: Sequence[RunRef]) -> list[RunRef]:
    """Stamp again the runs judged lost, if each still carries the stamp it was judged by."""
    if not refs:
        return []
    params = {"ids": [str(ref.task_id) for ref in refs], "stamps": [ref.stamp for ref in refs]}
    return _refs(conn.execute(RESTAMP, params))


def purge_expired(conn: Connection, *, batch: int) -> int:
    return int(conn.execute(PURGE_EXPIRED, {"batch": batch}).rowcount)
