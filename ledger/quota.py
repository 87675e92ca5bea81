"""The per-team cap on unfinished tasks and the daily export quota, checked in the creating
or retrying transaction under the team's lock (docs/design.md, "HTTP API", abuse limits).

Only a creation and a retry add an unfinished row, so only they are checked.
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

# Apart from the reminders' lock (tasks/reminder.py hashes another prefix). Statements are
# in psycopg2's form, as ledger/creation.py sends them; ``as_text`` makes SQLAlchemy's.
LOCK_TEAM_SQL = (
    "SELECT pg_advisory_xact_lock(hashtextextended('teamdesk.quota:' || %(team_id)s, 0))"
)


LOCK_TEAM = as_text(LOCK_TEAM_SQL)

# Per kind and per ``scheduled`` value: equalities on the ready index's leading columns are
# a range scan, where ``kind IN (...)`` or a free ``scheduled`` walked every team's rows
# (PostgreSQL < 18 has no skip scan). Each part stops at :cap rows.
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
    """A team's daily export quota: ``per_day`` runs, ``bytes_per_day`` of CSVs, an
    unfinished export holding ``reserve_bytes`` (``EXPORT_MAX_BYTES``); 0 turns each off."""

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
    """For a new export run: the cap on unfinished tasks, then the daily quota, under one
    take of the team's lock (held until the caller's transaction ends). Raises
    :class:`TeamQuotaExceeded` or :class:`ExportQuotaExceeded`; with neither on, no lock."""
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
