"""Reading the task audit trail (``task_audit``): proof that no replaced execution wrote.

Every lease change is audited by the statement that makes it (see lease.py, dispatch.py,
service.py). A write by an execution (COMPLETE, WAIT, FAIL) is legitimate only if the
task's previous audited change is that same execution's CLAIM: anything in between (a
newer claim, a recovery, a cancel) would have revoked the lease.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection

STALE_WRITES = text("""
    WITH ordered AS (
        SELECT id, task_id, run, event, execution_id,
               lag(event) OVER w AS previous_event,
               lag(execution_id) OVER w AS previous_execution
          FROM task_audit
        WINDOW w AS (PARTITION BY task_id ORDER BY id)
    )
    SELECT id, task_id, run, event, execution_id FROM ordered
     WHERE event IN ('COMPLETE', 'WAIT', 'FAIL')
       AND (previous_event IS DISTINCT FROM 'CLAIM'
            OR previous_execution IS DISTINCT FROM execution_id)
     ORDER BY id
""")

REPEATED_COMPLETIONS = text("""
    SELECT task_id, count(*) AS completions FROM task_audit
     WHERE event = 'COMPLETE' GROUP BY task_id HAVING count(*) > 1
""")


@dataclass(frozen=True)
class StaleWrite:
    audit_id: int
    task_id: uuid.UUID
    run: int
    event: str
    execution_id: uuid.UUID | None


def stale_writes(conn: Connection) -> list[StaleWrite]:
    """Writes made by an execution that did not hold the lease at that moment."""
    return [
        StaleWrite(r.id, r.task_id, r.run, r.event, r.execution_id)
        for r in conn.execute(STALE_WRITES)
    ]


def repeated_completions(conn: Connection) -> dict[uuid.UUID, int]:
    """Tasks completed more than once (a completed task can never be claimed again)."""
    return {r.task_id: int(r.completions) for r in conn.execute(REPEATED_COMPLETIONS)}
