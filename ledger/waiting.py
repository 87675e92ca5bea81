"""How much work is waiting for a worker, by the database's clock (docs/design.md,
"Dispatch": ready runs). Read by ``teamdesk-tasks health --cluster`` to say which queue's
missing worker holds tasks up; a task's own wait is the view's ``waiting_s``
(ledger/service.py).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger.states import KINDS

READY_COUNT_CAP = 10_000  # counting stops here: "at least this many" is enough to say

# Ready runs not yet published, per kind, at most the cap each: the ready range of the
# ready partial index, plus scheduled runs already due that the dispatcher has not yet
# promoted (ix_background_tasks_scheduled; its next fill will).
READY_BY_KIND = text("""
    SELECT k.kind, least(:cap,
           (SELECT count(*) FROM (
                SELECT 1 FROM background_tasks t
                 WHERE t.kind = k.kind AND NOT t.scheduled AND t.status = 'WAITING'
                   AND t.dispatched_at IS NULL AND t.run_at <= now()
                 LIMIT :cap) AS capped)
           + (SELECT count(*) FROM (
                SELECT 1 FROM background_tasks t
                 WHERE t.scheduled AND t.run_at <= now() AND t.kind = k.kind
                 LIMIT :cap) AS due)) AS ready
      FROM unnest(CAST(:kinds AS text[])) AS k(kind)
""")


def ready_by_kind(conn: Connection, cap: int = READY_COUNT_CAP) -> dict[str, int]:
    """Ready, unpublished runs per kind (every kind present, 0 when none), capped at
    ``cap``."""
    rows = conn.execute(READY_BY_KIND, {"kinds": list(KINDS), "cap": cap})
    return {str(kind): int(ready) for kind, ready in rows}
