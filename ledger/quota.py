"""The per-team cap on unfinished tasks (docs/design.md, "HTTP API": ``TEAM_MAX_UNFINISHED``).

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

from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger.errors import TeamQuotaExceeded
from ledger.states import KINDS

NO_CAP = 0

# Held until the creating transaction ends; the key space is distinct from the
# reminders' lock (tasks/reminder.py), which hashes another prefix.
LOCK_TEAM = text("SELECT pg_advisory_xact_lock(hashtextextended('teamdesk.quota:' || :team_id, 0))")

# WAITING and not published, counted per kind and per value of ``scheduled`` on the ready
# index (kind, scheduled, team_id, ...): equalities on its leading columns are a range
# scan, where `kind IN (...)` or a free ``scheduled`` led the planner (PostgreSQL < 18 has
# no skip scan) to walk every team's rows instead. Plus the rows in flight (RUNNING, or
# WAITING and published) on the in-flight index (team_id, kind). Each part stops at :cap
# rows: the sum reaches :cap exactly when the team has that many.
_READY = (
    "kind = '{kind}' AND scheduled = {scheduled} AND team_id = :team_id"
    " AND status = 'WAITING' AND dispatched_at IS NULL"
)
_INFLIGHT = (
    "team_id = :team_id"
    " AND (status = 'RUNNING' OR (status = 'WAITING' AND dispatched_at IS NOT NULL))"
)


def _bounded_count(where: str) -> str:
    return f"(SELECT count(*) FROM (SELECT 1 FROM background_tasks WHERE {where} LIMIT :cap) AS p)"


COUNT_UNFINISHED = text(
    "SELECT "
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
)


def ensure_room(conn: Connection, team_id: uuid.UUID, cap: int) -> None:
    """Raise :class:`TeamQuotaExceeded` when ``team_id`` has ``cap`` unfinished tasks or
    more; else return holding the team's lock until the caller's transaction ends.
    ``cap`` :data:`NO_CAP` checks nothing and takes no lock."""
    if cap <= NO_CAP:
        return
    params = {"team_id": str(team_id), "cap": cap}
    conn.execute(LOCK_TEAM, params)
    if conn.execute(COUNT_UNFINISHED, params).scalar_one() >= cap:
        raise TeamQuotaExceeded()
