"""Retention of finished tasks and audit rows, through the owner's ``teamdesk_purge_ledger()``
(docs/design.md, "Retention").
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
