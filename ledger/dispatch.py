"""The dispatcher's ledger statements, each one statement on the database's clock
(docs/design.md, "Dispatch"). Selections lock ``FOR UPDATE SKIP LOCKED`` in the statement
that changes them, so overlapping dispatchers never stamp a row twice, and each walks a
partial index over live rows, so a pass costs what it does, not what the table holds.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg2
from sqlalchemy import TextClause, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, TEXT, TIMESTAMP
from sqlalchemy.engine import Connection

from ledger import artifacts
from ledger.states import KINDS
from teamdesk.db import PREPARED_KEY, may_prepare


@dataclass(frozen=True)
class RunRef:
    """One run the dispatcher acts on; ``stamp`` is its ``dispatched_at`` when published."""

    task_id: uuid.UUID
    run: int
    kind: str
    status: str = "WAITING"
    stamp: datetime | None = None
    trace_parent: str | None = None  # the run's trace (teamdesk/tracing.py), if traced
    recovered: bool = False  # taken back from a silent execution at least once


# Promote the scheduled runs now due (oldest first; rows a cancel or retry holds wait for
# the next fill), in the fill's transaction so its stamp sees them. Then per kind: runs
# published and not yet claimed, whether any is ready (one probe of
# ix_background_tasks_ready) or promoted, and seconds until the next scheduled run is due
# (0 when the promotion was cut at its batch: more are due now).
WINDOW_STATE = text(
    """
    WITH due AS (
        SELECT id FROM background_tasks
         WHERE scheduled AND run_at <= now()
         ORDER BY run_at
         LIMIT :promote_batch
           FOR UPDATE SKIP LOCKED
    ), promoted AS (
        UPDATE background_tasks t SET scheduled = false
          FROM due WHERE t.id = due.id AND t.scheduled
        RETURNING t.kind
    )
    SELECT (SELECT coalesce(jsonb_object_agg(kind, n), '{}'::jsonb)
              FROM (SELECT kind, count(*) AS n FROM background_tasks
                     WHERE status = 'WAITING' AND dispatched_at IS NOT NULL
                     GROUP BY kind) k) AS queued,
           ARRAY(SELECT v.kind FROM (VALUES {probes}) AS v(kind, present)
                  WHERE v.present OR v.kind IN (SELECT kind FROM promoted)) AS waiting,
           CASE WHEN (SELECT count(*) FROM due) >= :promote_batch THEN 0
                ELSE (SELECT extract(epoch FROM min(run_at) - now()) FROM background_tasks
                       WHERE scheduled AND run_at > now()) END AS next_due_s,
           (SELECT count(*) FROM promoted) AS promoted
""".replace(
        "{probes}",
        # One probe per kind with the kind as a constant: only then does the planner
        # answer "none" from the index (a kind passed in as a value made it scan the table).
        ", ".join(
            f"('{kind}', EXISTS (SELECT 1 FROM background_tasks WHERE kind = '{kind}' "
            "AND NOT scheduled AND status = 'WAITING' AND dispatched_at IS NULL))"
            for kind in KINDS
        ),
    )
)
PROMOTE_BATCH = 1000  # scheduled runs promoted by one fill at most

# Guard: WAITING, unpublished, due. Up to :n ready runs of one kind, round-robin over
# teams from after :cursor: a loose index scan over the ready range of
# ix_background_tasks_ready (scheduled runs are not in it), wrapping around. A team whose
# oldest row is not due (promoted after this statement's now()) or that is at the :cap
# is passed over (one probe, a count of at most :cap entries). Each team of the turn
# offers its oldest ready rows up to its room, taken one per team per round. Rows are
# locked by primary key, re-checked and stamped here; returned in publish order with their
# team (the next :cursor, past the teams passed over).
# A team below the :cap (0 = no cap): its runs in flight (ix_background_tasks_inflight)
# counted up to the cap, never further.
_HAS_ROOM = """(:cap <= 0 OR (SELECT count(*) FROM (
                    SELECT 1 FROM background_tasks r
                     WHERE r.team_id = {team}.team_id
                       AND (r.status = 'RUNNING'
                            OR (r.status = 'WAITING' AND r.dispatched_at IS NOT NULL))
                     LIMIT greatest(:cap, 0)) inflight) < :cap)"""

STAMP_READY = text(
    """
    WITH RECURSIVE onward AS (
        (SELECT b.team_id, b.run_at FROM background_tasks b
          WHERE b.kind = :kind AND NOT b.scheduled AND b.status = 'WAITING'
            AND b.dispatched_at IS NULL AND b.team_id > :cursor
          ORDER BY b.kind, b.scheduled, b.team_id, b.run_at LIMIT 1)
        UNION ALL
        SELECT nxt.team_id, nxt.run_at FROM onward CROSS JOIN LATERAL (
            SELECT b.team_id, b.run_at FROM background_tasks b
             WHERE b.kind = :kind AND NOT b.scheduled AND b.status = 'WAITING'
               AND b.dispatched_at IS NULL AND b.team_id > onward.team_id
             ORDER BY b.kind, b.scheduled, b.team_id, b.run_at LIMIT 1) nxt
    ), wrapped AS (
        (SELECT b.team_id, b.run_at FROM background_tasks b
          WHERE b.kind = :kind AND NOT b.scheduled AND b.status = 'WAITING'
            AND b.dispatched_at IS NULL AND b.team_id <= :cursor
          ORDER BY b.kind, b.scheduled, b.team_id, b.run_at LIMIT 1)
        UNION ALL
        SELECT nxt.team_id, nxt.run_at FROM wrapped CROSS JOIN LATERAL (
            SELECT b.team_id, b.run_at FROM background_tasks b
             WHERE b.kind = :kind AND NOT b.scheduled AND b.status = 'WAITING'
               AND b.dispatched_at IS NULL AND b.team_id > wrapped.team_id
               AND b.team_id <= :cursor
             ORDER BY b.kind, b.scheduled, b.team_id, b.run_at LIMIT 1) nxt
    ), turn AS (
        -- each team's first row is its oldest: a team whose oldest is not due yet has
        -- nothing ready and is passed over; so is a team at the :cap, before the limit
        -- (the walk goes on past it)
        SELECT team_id, row_number() OVER (ORDER BY lap, team_id) AS pos
          FROM ((SELECT o.team_id, 0 AS lap FROM onward o
                  WHERE o.run_at <= now() AND {has_room:o} LIMIT :n)
                UNION ALL
                (SELECT w.team_id, 1 AS lap FROM wrapped w
                  WHERE w.run_at <= now() AND {has_room:w} LIMIT :n)) t
         ORDER BY lap, team_id LIMIT :n
    ), share AS (
        SELECT turn.team_id, turn.pos,
               CASE WHEN :cap > 0 THEN least(:n, :cap - (
                   SELECT count(*) FROM background_tasks r
                    WHERE r.team_id = turn.team_id
                      AND (r.status = 'RUNNING'
                           OR (r.status = 'WAITING' AND r.dispatched_at IS NOT NULL))))
                    ELSE :n END AS room
          FROM turn
    ), candidates AS (
        SELECT c.id, c.rn, share.pos, share.team_id
          FROM share CROSS JOIN LATERAL (
              SELECT b.id, row_number() OVER (ORDER BY b.run_at, b.id) AS rn
                FROM background_tasks b
               WHERE b.kind = :kind AND NOT b.scheduled AND b.team_id = share.team_id
                 AND b.status = 'WAITING' AND b.dispatched_at IS NULL AND b.run_at <= now()
               ORDER BY b.run_at, b.id
               LIMIT greatest(share.room, 0)
          ) c
    ), picked AS (
        SELECT id, rn, pos, team_id FROM candidates ORDER BY rn, pos LIMIT :n
    ), locked AS (
        SELECT t.id FROM background_tasks t
         WHERE t.id = ANY(ARRAY(SELECT id FROM picked))  -- by primary key, whatever the stats
           AND t.status = 'WAITING' AND t.dispatched_at IS NULL
           FOR UPDATE OF t SKIP LOCKED
    ), stamped AS (
        UPDATE background_tasks t SET dispatched_at = now(), updated_at = now()
          FROM locked WHERE t.id = locked.id
        RETURNING t.id, t.run, t.kind, t.dispatched_at, t.trace_parent,
                  t.recoveries > 0 AS recovered
    )
    SELECT s.id, s.run, s.kind, s.dispatched_at AS stamp, p.team_id, s.trace_parent, s.recovered
      FROM stamped s JOIN picked p ON p.id = s.id
     ORDER BY p.rn, p.pos
""".replace("{has_room:o}", _HAS_ROOM.format(team="o")).replace(
        "{has_room:w}", _HAS_ROOM.format(team="w")
    )
)

# The kinds among :kinds with a run ready now (the scan warns when nobody consumes them):
# a ready one, or a scheduled one already due and not yet promoted.
READY_KINDS = text("""
    SELECT k.kind FROM unnest(CAST(:kinds AS text[])) AS k(kind)
     WHERE EXISTS (SELECT 1 FROM background_tasks b
                    WHERE b.kind = k.kind AND NOT b.scheduled AND b.status = 'WAITING'
                      AND b.dispatched_at IS NULL AND b.run_at <= now())
        OR EXISTS (SELECT 1 FROM background_tasks b
                    WHERE b.scheduled AND b.run_at <= now() AND b.kind = k.kind)
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
    SELECT id, run, kind, dispatched_at AS stamp,
           dispatched_at < now() - make_interval(secs => :overdue_s) AS overdue
      FROM background_tasks
     WHERE status = 'WAITING' AND dispatched_at IS NOT NULL
       AND dispatched_at < now() - make_interval(secs => :grace_s)
     ORDER BY dispatched_at
     LIMIT :batch
""")

# Guard: WAITING and still carrying the stamp the caller judged lost (a row claimed or
# re-stamped meanwhile is left alone). Stamps it anew for the re-publish.
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
    RETURNING t.id, t.run, t.kind, t.dispatched_at AS stamp, t.trace_parent,
              t.recoveries > 0 AS recovered
""").bindparams(
    bindparam("ids", type_=ARRAY(TEXT)), bindparam("stamps", type_=ARRAY(TIMESTAMP(timezone=True)))
)

# CSVs past their 24 h, by the database's clock: those held as chunks (0013,
# ix_background_tasks_results_expiring), their chunks deleted with the key...
PURGE_EXPIRED_CHUNKS = text("""
    WITH expired AS (
        SELECT id, result_key FROM background_tasks
         WHERE result_key IS NOT NULL AND result_object IS NULL AND expires_at < now()
         ORDER BY expires_at
         LIMIT :batch
           FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM export_chunks c USING expired e
         WHERE c.task_id = e.id AND c.execution_id = e.result_key
    )
    UPDATE background_tasks t SET result_key = NULL, result_sha256 = NULL, updated_at = now()
      FROM expired WHERE t.id = expired.id
""")

# ... and those an earlier release stored in the row (ix_background_tasks_expiring).
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

# How many unpublished WAITING rows there are (counted up to a cap) and how many the
# planner believes ix_background_tasks_ready holds (as of the last ANALYZE or VACUUM).
STATISTICS_DRIFT = text("""
    SELECT (SELECT count(*) FROM (SELECT 1 FROM background_tasks
                                   WHERE status = 'WAITING' AND dispatched_at IS NULL
                                   LIMIT :cap) w) AS waiting,
           (SELECT reltuples FROM pg_class
             WHERE oid = CAST('ix_background_tasks_ready' AS regclass)) AS believed
""")

# ANALYZE through the owner's function (migration 0006): the processes run as the
# application role, which may not ANALYZE before PostgreSQL 17 (ledger/database_roles.py).
ANALYZE = text("SELECT teamdesk_analyze_ledger()")

DRIFT_CAP = 100_000  # rows counted at most
DRIFT_MIN_ROWS = 1000  # a difference smaller than this never triggers an ANALYZE

DATABASE_NOW = text("SELECT clock_timestamp()")

# Bounds every statement of the caller's transaction; ends with it.
LIMIT_STATEMENT_TIME = text("SELECT set_config('statement_timeout', :ms, true)")


@dataclass(frozen=True)
class WindowState:
    """Runs published and not yet claimed per kind, the kinds with ready runs (promoted
    ones included), seconds until the next scheduled run is due (0: more are due now), and
    how many scheduled runs this fill promoted."""

    queued: dict[str, int]
    waiting: frozenset[str]
    next_due_s: float | None
    promoted: int = 0


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
            getattr(row, "trace_parent", None),
            bool(getattr(row, "recovered", False)),
        )
        for row in rows
    ]


def window_state(conn: Connection, *, promote_batch: int = PROMOTE_BATCH) -> WindowState:
    """Promote the scheduled runs now due (at most ``promote_batch``), then read the window."""
    params = {"promote_batch": promote_batch}
    [(queued_by_kind, waiting, next_due_s, promoted)] = _prepared(
        conn, "td_window_state", WINDOW_STATE, params
    )
    queued = {kind: int(queued_by_kind.get(kind, 0)) for kind in KINDS}
    next_due = None if next_due_s is None else max(0.0, float(next_due_s))
    return WindowState(queued, frozenset(waiting), next_due, int(promoted))


NO_TEAM = uuid.UUID(int=0)  # the cursor before any team: a turn starts at the first


@dataclass(frozen=True)
class Turn:
    """What one round-robin turn stamped, and the team to start the next turn after."""

    refs: list[RunRef]
    cursor: uuid.UUID


def stamp_ready(
    conn: Connection, *, kind: str, n: int, team_cap: int, cursor: uuid.UUID = NO_TEAM
) -> Turn:
    """Stamp up to ``n`` ready runs of ``kind``, round-robin over teams from ``cursor``;
    in publish order."""
    if n <= 0:
        return Turn([], cursor)
    params = {"kind": kind, "n": n, "cap": team_cap, "cursor": str(cursor)}
    rows = _prepared(conn, "td_stamp_ready", STAMP_READY, params)
    refs = [
        RunRef(uuid.UUID(str(i)), int(r), str(k), "WAITING", st, tp, bool(rec))
        for i, r, k, st, _, tp, rec in rows
    ]
    return Turn(refs, uuid.UUID(str(rows[-1][4])) if rows else cursor)


_PARAM = re.compile(r"(?<![:\w]):([a-z_]+)")
_PARAM_NAMES: dict[str, list[str]] = {}  # prepared name -> its parameters, in $n order


def _prepared(
    conn: Connection, name: str, statement: TextClause, params: dict[str, Any]
) -> list[tuple[Any, ...]]:
    """Run one of the fill's statements as a prepared statement of this session, inside the
    caller's transaction. The fill runs on every notification, and planning these CTEs
    costs as much as running them; prepared, a session plans them once (again after every
    ANALYZE of the table, which :func:`refresh_statistics` keeps current)."""
    if name not in _PARAM_NAMES:
        _PARAM_NAMES[name] = list(dict.fromkeys(_PARAM.findall(statement.text)))
    names = _PARAM_NAMES[name]
    if not may_prepare(conn.connection.info):  # DATABASE_PREPARED_STATEMENTS=off
        return [tuple(row) for row in conn.execute(statement, params)]
    prepared: set[str] = conn.connection.info.setdefault(PREPARED_KEY, set())
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    cursor = dbapi.cursor()
    try:
        if name not in prepared:
            sql = _PARAM.sub(lambda m: f"${names.index(m.group(1)) + 1}", statement.text)
            cursor.execute(f"PREPARE {name} AS {sql}")
            prepared.add(name)
        arguments = f"({', '.join(['%s'] * len(names))})" if names else ""
        cursor.execute(f"EXECUTE {name}{arguments}", [params[n] for n in names])
        return list(cursor.fetchall())
    except (psycopg2.OperationalError, psycopg2.InterfaceError):
        conn.invalidate()  # the server connection is gone: the pool must not reuse it
        raise
    finally:
        cursor.close()


def ready_kinds(conn: Connection, kinds: Collection[str]) -> set[str]:
    return {str(row.kind) for row in conn.execute(READY_KINDS, {"kinds": list(kinds)})}


def unstamp(conn: Connection, refs: Sequence[RunRef]) -> int:
    """Make runs whose publish failed ready again (only if still carrying their stamp)."""
    cleared = 0
    for stamp in {ref.stamp for ref in refs}:
        ids = [str(ref.task_id) for ref in refs if ref.stamp == stamp]
        cleared += int(conn.execute(UNSTAMP, {"ids": ids, "stamp": stamp}).rowcount)
    return cleared


def published_before(
    conn: Connection, *, grace_s: float, overdue_s: float, batch: int
) -> list[tuple[RunRef, bool]]:
    """Published runs still WAITING, stamped more than ``grace_s`` ago, oldest first, each
    with whether its stamp is more than ``overdue_s`` old (the database's clock)."""
    params = {"grace_s": grace_s, "overdue_s": overdue_s, "batch": batch}
    rows = conn.execute(PUBLISHED_BEFORE, params).all()
    return list(zip(_refs(rows), (bool(row.overdue) for row in rows), strict=True))


def restamp(conn: Connection, refs: Sequence[RunRef]) -> list[RunRef]:
    """Stamp again the runs judged lost, if each still carries the stamp it was judged by."""
    if not refs:
        return []
    params = {"ids": [str(ref.task_id) for ref in refs], "stamps": [ref.stamp for ref in refs]}
    return _refs(conn.execute(RESTAMP, params))


def refresh_statistics(conn: Connection) -> bool:
    """ANALYZE the ledger when the planner's idea of its waiting rows is off by more than
    half (and ``DRIFT_MIN_ROWS``); True when it did (why: docs/decisions.md, "Dispatch").
    ANALYZE reads a fixed sample and takes no lock that blocks writes."""
    row = conn.execute(STATISTICS_DRIFT, {"cap": DRIFT_CAP}).one()
    waiting, believed = int(row.waiting), max(float(row.believed or 0), 0.0)
    if abs(waiting - believed) < max(DRIFT_MIN_ROWS, believed / 2, waiting / 2):
        return False
    conn.execute(ANALYZE)
    return True


def purge_expired(conn: Connection, *, batch: int) -> int:
    """Expired CSVs (up to ``batch`` of each kind of storage), then the chunks of
    executions that never completed (ledger/artifacts.py); how many CSVs went."""
    expired = int(conn.execute(PURGE_EXPIRED_CHUNKS, {"batch": batch}).rowcount)
    expired += int(conn.execute(PURGE_EXPIRED, {"batch": batch}).rowcount)
    artifacts.purge_orphans(conn, batch)
    return expired
