"""Retention: the ledger does not grow forever (docs/design.md, "Retention").

A finished task (COMPLETED, FAILED or CANCELLED) is removed ``TASK_RETENTION_DAYS`` after
it finished, with what is left of its audit trail; audit rows are removed
``AUDIT_RETENTION_DAYS`` after they were written, oldest first. Notifications outlive
their task (their ``task_id`` becomes NULL). Both run in the dispatcher's purge step (every
``PURGE_INTERVAL_S``), each call removing at most ``batch`` tasks and ``batch`` audit rows
in one short transaction: ``SKIP LOCKED`` on the tasks, the audit trail's primary key read
from its head, so no call holds a lock for long nor reads more than it removes. A backlog
(a first run on a large ledger) drains over several purges.

The application role may not delete audit rows (ledger/roles.py: the trail is append-only
for it), so both go through the owner's ``teamdesk_purge_ledger()`` (migration 0007,
``SECURITY DEFINER``), which never removes anything younger than a day whatever it is
asked. An auditor reading the trail (ledger/audit.py) reads the part younger than
``AUDIT_RETENTION_DAYS``: a trail cut by the retention starts after its first claim.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection

from teamdesk.config import Settings

TASK_RETENTION_DAYS = 30.0  # finished tasks are kept this long after they finished
AUDIT_RETENTION_DAYS = 30.0  # audit rows are kept this long after they were written
PURGE_FUNCTION = "teamdesk_purge_ledger"  # migration 0007; roles.py grants EXECUTE on it
SIGNATURE = "double precision, double precision, integer"
DAY_S = 86_400.0

PURGE = text(
    f"SELECT tasks, audit FROM {PURGE_FUNCTION}("
    "CAST(:task_s AS double precision), CAST(:audit_s AS double precision), :batch)"
)


@dataclass(frozen=True)
class Retention:
    task_days: float = TASK_RETENTION_DAYS
    audit_days: float = AUDIT_RETENTION_DAYS

    @classmethod
    def of(cls, settings: Settings) -> Retention:
        """The configured retention (``TASK_RETENTION_DAYS``, ``AUDIT_RETENTION_DAYS``)."""
        return cls(task_days=settings.task_retention_days, audit_days=settings.audit_retention_days)


@dataclass(frozen=True)
class Purged:
    tasks: int
    audit: int


def purge_retired(conn: Connection, retention: Retention, *, batch: int) -> Purged:
    """Remove up to ``batch`` finished tasks and ``batch`` audit rows past their retention
    (by the database's clock), in the caller's transaction."""
    row = conn.execute(
        PURGE,
        {
            "task_s": retention.task_days * DAY_S,
            "audit_s": retention.audit_days * DAY_S,
            "batch": batch,
        },
    ).one()
    return Purged(tasks=int(row.tasks), audit=int(row.audit))
