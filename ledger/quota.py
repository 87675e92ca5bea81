"""The per-team cap on unfinished tasks (docs/design.md, "HTTP API": ``TEAM_MAX_UNFINISHED``)
and the daily export quota (``TEAM_EXPORTS_PER_DAY``, ``TEAM_EXPORT_BYTES_PER_DAY``).

Only creating a task and retrying one add an unfinished (WAITING or RUNNING) row; every
other transition keeps a row unfinished or finishes it. So :func:`ensure_room` runs in
the creating transaction, right before its write, under a per-team advisory lock held
until that transaction ends: the next creation of the same team waits for it and counts
after it committed (READ COMMITTED takes a new snapshot per statement), so two requests
at ``cap - 1`` cannot both see room. Other teams never wait. A refusal raises
:class:`TeamQuotaExceeded` and the caller's transaction rolls back: nothing is written.

The count reads only the two partial indexes the dispatcher already keeps over live rows
(``ix_background_tasks_ready`` and ``ix_background_tasks_inflight``, migrations 0004 and
0008), whose predicates split WAITING + RUNNING exactly in two, and stops at ``cap``
entries per part: no new index to maintain on the ledger's hot path, and the work is
bounded by the cap.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from ledger.errors import ExportQuotaExceeded, TeamQuotaExceeded
from ledger.prepared import as_text
from ledger.states import KINDS
from teamdesk.config import Settings

NO_CAP = 0

# Held until the creating transaction ends; the key space is distinct from the
# reminders' lock (tasks/reminder.py), which hashes another prefix.
# The statements below are written with psycopg2 parameters (``%(name)s``), the form the
# one-round-trip creation (ledger/creation.py) sends to the driver; ``as_text``
# (ledger/prepared.py) makes the SQLAlchemy form of the same statement.
LOCK_TEAM_SQL = (
    "SELECT pg_advisory_xact_lock(hashtextextended('teamdesk.quota:' || %(team_id)s, 0))"
)


LOCK_TEAM = as_text(LOCK_TEAM_SQL)

# WAITING and not published, counted per kind and per value of ``scheduled`` on the ready
# index (kind, scheduled, team_id, ...): equalities on its leading columns are a range
# scan, where `kind IN (...)` or a free ``scheduled`` led the planner (PostgreSQL < 18 has
# no skip scan) to walk every team's rows instead. Plus the rows in flight (RUNNING, or
# WAITING and published) on the in-flight index (team_id, kind). Each part stops at :cap
# rows: the sum reaches :cap exactly when the team has that many.
_READY = (
    "kind = '{kind}' AND scheduled = {scheduled} AND team_id = %(team_id)s"
    " AND status = 'WAITING' AND dispatched_at IS NULL"
)
_INFLIGHT = (
    "team_id = %(team_id)s"
    " AND (status = 'RUNNING' OR (status = 'WAITING' AND dispatched_at IS NOT NULL))"
)


def _bounded_count(where: str) -> str:
    return (
        f"(SELECT count(*) FROM (SELECT 1 FROM background_tasks WHERE {where} LIMIT %(cap)s) AS p)"
    )


# The team's unfinished tasks, counted up to %(cap)s (an expression).
UNFINISHED_SQL = (
    "("
    + "\n     + ".join(
        [
            *(
                _bounded_count(_READY.format(kind=kind, scheduled=scheduled))
                for kind in KINDS
                for scheduled in ("false", "true")
            ),
            _bounded_count(_INFLIGHT),
        ]
    )
    + ")"
)
COUNT_UNFINISHED = as_text("SELECT " + UNFINISHED_SQL)


def ensure_room(conn: Connection, team_id: uuid.UUID, cap: int) -> None:
    """Raise :class:`TeamQuotaExceeded` when ``team_id`` has ``cap`` unfinished tasks or
    more; else return holding the team's lock until the caller's transaction ends.
    ``cap`` :data:`NO_CAP` checks nothing and takes no lock."""
    if cap <= NO_CAP:
        return
    conn.execute(LOCK_TEAM, {"team_id": str(team_id)})
    _check_room(conn, team_id, cap)


def _check_room(conn: Connection, team_id: uuid.UUID, cap: int) -> None:
    """The count, under the team's lock the caller holds."""
    if conn.execute(COUNT_UNFINISHED, {"team_id": str(team_id), "cap": cap}).scalar_one() >= cap:
        raise TeamQuotaExceeded()


@dataclass(frozen=True)
class ExportQuota:
    """A team's exports in any 24 hours (database clock), counted where each one's current
    run opened (its creation, or the retry that opened it): at most ``per_day`` of them,
    and their CSVs at most ``bytes_per_day`` bytes, where an unfinished export holds
    ``reserve_bytes`` (the most one CSV may be, ``EXPORT_MAX_BYTES``) until its completion
    stores its real size. A new run is refused unless its own reservation still fits, so
    a team never holds more than its quota, however many of its exports run at once. 0
    turns each limit off."""

    per_day: int = NO_CAP
    bytes_per_day: int = NO_CAP
    reserve_bytes: int = NO_CAP

    @property
    def enabled(self) -> bool:
        return self.per_day > NO_CAP or self.bytes_per_day > NO_CAP

    @classmethod
    def of(cls, settings: Settings) -> ExportQuota:
        return cls(
            settings.team_exports_per_day,
            settings.team_export_bytes_per_day,
            settings.export_max_bytes,
        )


NO_EXPORT_QUOTA = ExportQuota()

MSG_EXPORTS_PER_DAY = (
    "this team has created its quota of exports for the last 24 hours; "
    "try again after Retry-After seconds"
)
MSG_EXPORT_BYTES_PER_DAY = (
    "this team's exports of the last 24 hours hold its quota of CSV data; "
    "try again after Retry-After seconds"
)

# The team's exports whose current run opened in the last 24 hours
# (ix_background_tasks_team_export_runs; at most per_day of them, as this check keeps it).
EXPORTS_OF_THE_DAY_SQL = """
      FROM background_tasks
     WHERE team_id = %(team_id)s AND kind = 'EXPORT'
       AND run_opened_at > now() - interval '1 day'"""
# What they hold: the CSV bytes a completion stored, and the most an unfinished one may
# store (its reservation).
HELD_BYTES_SQL = """coalesce(sum(CASE WHEN status IN ('WAITING', 'RUNNING')
                             THEN %(reserve_bytes)s ELSE result_bytes END), 0)"""
EXPORTS_TODAY = as_text(f"""
    SELECT count(*) AS created, {HELD_BYTES_SQL} AS bytes,
           ceil(extract(epoch FROM min(run_opened_at) + interval '1 day' - now()))
             AS frees_in_s
      {EXPORTS_OF_THE_DAY_SQL}
""")


def ensure_export_room(conn: Connection, team_id: uuid.UUID, cap: int, quota: ExportQuota) -> None:
    """For a new export run (a creation or a retry): :func:`ensure_room` (the cap on
    unfinished tasks, ``cap``), then the daily export quota, under one take of the team's
    lock, held until the caller's transaction ends so two requests cannot both take the
    last place. Raises :class:`TeamQuotaExceeded` or :class:`ExportQuotaExceeded`; with
    neither limit on it checks nothing and takes no lock."""
    if cap <= NO_CAP and not quota.enabled:
        return
    params = {"team_id": str(team_id)}
    conn.execute(LOCK_TEAM, params)
    if cap > NO_CAP:
        _check_room(conn, team_id, cap)
    if not quota.enabled:
        return
    row = conn.execute(EXPORTS_TODAY, {**params, "reserve_bytes": quota.reserve_bytes}).one()
    retry_after_s = max(1, int(row.frees_in_s or 1))
    if quota.per_day > NO_CAP and row.created >= quota.per_day:
        raise ExportQuotaExceeded(MSG_EXPORTS_PER_DAY, retry_after_s)
    if quota.bytes_per_day > NO_CAP and row.bytes + quota.reserve_bytes > quota.bytes_per_day:
        raise ExportQuotaExceeded(MSG_EXPORT_BYTES_PER_DAY, retry_after_s)
