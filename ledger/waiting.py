"""How much work waits for a worker, by the database's clock: for ``health --cluster`` and
the backlog gauges (docs/design.md, "Dispatch" and "Observe").
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger.states import KINDS

READY_COUNT_CAP = 10_000  # counting stops here: "at least this many" is enough to say

# The three parts of "due and not yet claimed", per kind k.kind, each on a partial index:
# ready, scheduled but due (not yet promoted), published (the window).
_READY = (
    "t.kind = k.kind AND NOT t.scheduled AND t.status = 'WAITING'"
    " AND t.dispatched_at IS NULL AND t.run_at <= now()"
)
_DUE = "t.scheduled AND t.run_at <= now() AND t.kind = k.kind"
_PUBLISHED = "t.status = 'WAITING' AND t.dispatched_at IS NOT NULL AND t.kind = k.kind"


def _count(where: str) -> str:
    return f"(SELECT count(*) FROM (SELECT 1 FROM background_tasks t WHERE {where} LIMIT :cap) p)"


def _oldest(where: str) -> str:
    return f"(SELECT min(t.run_at) FROM background_tasks t WHERE {where})"


# Ready runs not yet published, per kind, at most the cap each.
READY_BY_KIND = text(f"""
    SELECT k.kind, least(:cap, {_count(_READY)} + {_count(_DUE)}) AS ready
      FROM unnest(CAST(:kinds AS text[])) AS k(kind)
""")


def ready_by_kind(conn: Connection, cap: int = READY_COUNT_CAP) -> dict[str, int]:
    """Ready, unpublished runs per kind (every kind present, 0 when none), capped at
    ``cap``."""
    rows = conn.execute(READY_BY_KIND, {"kinds": list(KINDS), "cap": cap})
    return {str(kind): int(ready) for kind, ready in rows}


BACKLOG_COUNT_CAP = 100_000  # the backlog gauge counts this many per part at most

BACKLOG_BY_KIND = text(f"""
    SELECT k.kind, {_count(_READY)} + {_count(_DUE)} + {_count(_PUBLISHED)} AS backlog,
           coalesce(extract(epoch FROM now() - least(
               {_oldest(_READY)}, {_oldest(_DUE)}, {_oldest(_PUBLISHED)})), 0) AS oldest_s
      FROM unnest(CAST(:kinds AS text[])) AS k(kind)
""")


def backlog_by_kind(conn: Connection, cap: int = BACKLOG_COUNT_CAP) -> dict[str, tuple[int, float]]:
    """Per kind (every kind present): runs due and not yet claimed (each of its three parts
    counted up to ``cap``), and the age in seconds of the oldest (0 when none)."""
    rows = conn.execute(BACKLOG_BY_KIND, {"kinds": list(KINDS), "cap": cap})
    return {str(kind): (int(backlog), max(0.0, float(oldest))) for kind, backlog, oldest in rows}


TOP_TEAMS = 5  # teams named per queue by ``health --cluster`` (cli/cluster_health.py)

# The teams with the most ready runs, per kind (the ready range of ix_background_tasks_ready
# read whole: the caller asks only for kinds whose ready runs are under its count's cap).
TOP_READY_TEAMS = text("""
    SELECT kind, team_id, ready FROM (
        SELECT t.kind, t.team_id, count(*) AS ready,
               row_number() OVER (PARTITION BY t.kind ORDER BY count(*) DESC, t.team_id) AS r
          FROM background_tasks t
         WHERE t.kind = ANY(CAST(:kinds AS text[])) AND NOT t.scheduled
           AND t.status = 'WAITING' AND t.dispatched_at IS NULL AND t.run_at <= now()
         GROUP BY t.kind, t.team_id
    ) ranked
     WHERE r <= :top
     ORDER BY kind, ready DESC, team_id
""")


def top_ready_teams(
    conn: Connection, kinds: Sequence[str], top: int = TOP_TEAMS
) -> dict[str, list[tuple[uuid.UUID, int]]]:
    """Per kind of ``kinds``: up to ``top`` teams with the most ready runs, most first."""
    found: dict[str, list[tuple[uuid.UUID, int]]] = {kind: [] for kind in kinds}
    if kinds:
        rows = conn.execute(TOP_READY_TEAMS, {"kinds": list(kinds), "top": top})
        for kind, team_id, ready in rows:
            found[str(kind)].append((uuid.UUID(str(team_id)), int(ready)))
    return found
