"""P9: what one fill costs at tenant scale (``ledger.dispatch.stamp_ready``, the statement
every fill of a queue runs), on the database alone.

- ``p9_fill_ms_empty``: one team with ``FILL_N`` ready reminders; a fill of ``FILL_N``;
- ``p9_fill_ms_100k_future``: the same, once ``FUTURE_TEAMS`` other teams each hold one
  reminder due tomorrow (TeamDesk schedules reminders ahead);
- ``p9_fill_ms_10k_ready``: ``READY_TEAMS`` teams with two ready reminders each; a fill of
  ``FILL_N`` (one run from each of the next ``FILL_N`` teams);
- ``p9_capped_fills``: ``CAPPED_TEAMS`` teams at a cap of 1 with backlogs and one new team
  with one run; fills of ``CAPPED_N`` (a window of 2), each from the previous fill's
  cursor, until the new team's run is stamped (``CAPPED_MAX_FILLS`` means never).

Every timed fill runs in its own transaction and is rolled back, so each one sees the same
ledger; the median of ``FILLS`` (after ``WARMUP``) is reported. Fixtures are built with
set-based SQL and analysed.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.env import BenchEnv
from ledger import dispatch

FILL_N = 64
FUTURE_TEAMS = 100_000
READY_TEAMS = 10_000
CAPPED_TEAMS, CAPPED_N, CAPPED_MAX_FILLS = 20, 2, 50
FILLS, WARMUP = 25, 5

OWNER = sa.text("INSERT INTO users (email, name) VALUES ('p9@bench.test', 'p9') RETURNING id")

# :teams new teams, each with :per reminders due :due_s from now (negative: ready).
TEAMS_WITH_REMINDERS = sa.text("""
    WITH t AS (
        INSERT INTO teams (name) SELECT 'p9-' || g FROM generate_series(1, :teams) g
        RETURNING id
    )
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, run_at)
    SELECT 'REMINDER', t.id, :owner, 'TEAM', '{}'::jsonb,
           now() + make_interval(secs => :due_s) + k * interval '1 millisecond'
      FROM t CROSS JOIN generate_series(1, :per) k
    RETURNING team_id
""")

ANALYZE = sa.text("ANALYZE background_tasks")


def add_teams(engine: sa.Engine, owner: uuid.UUID, teams: int, per: int, due_s: float) -> set[Any]:
    with engine.begin() as conn:
        rows = conn.execute(
            TEAMS_WITH_REMINDERS, {"teams": teams, "per": per, "due_s": due_s, "owner": owner}
        )
        made = {row.team_id for row in rows}
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(ANALYZE)
    return made


def fill_ms(engine: sa.Engine, expected: int) -> list[float]:
    """Timed fills of FILL_N reminders from the first team on, each rolled back."""
    times: list[float] = []
    with engine.connect() as conn:
        for i in range(WARMUP + FILLS):
            with conn.begin() as tx:
                started = time.perf_counter()
                turn = dispatch.stamp_ready(conn, kind="REMINDER", n=FILL_N, team_cap=0)
                elapsed = time.perf_counter() - started
                assert len(turn.refs) == expected, (len(turn.refs), expected)
                tx.rollback()
            if i >= WARMUP:
                times.append(elapsed * 1000)
    return times


def capped_fills(engine: sa.Engine, owner: uuid.UUID) -> int:
    """Fills (of CAPPED_N, cap 1, each from the last cursor) until the new team is served."""
    add_teams(engine, owner, CAPPED_TEAMS, 5, -1.0)
    with engine.begin() as conn:  # one run each published by the ledger's own fill: at the cap
        turn = dispatch.stamp_ready(conn, kind="REMINDER", n=CAPPED_TEAMS, team_cap=1)
    assert len(turn.refs) == CAPPED_TEAMS
    (new_team,) = add_teams(engine, owner, 1, 1, -1.0)
    new_runs = team_runs(engine, new_team)
    cursor = dispatch.NO_TEAM
    with engine.connect() as conn:
        for fills in range(1, CAPPED_MAX_FILLS + 1):
            with conn.begin():
                turn = dispatch.stamp_ready(
                    conn, kind="REMINDER", n=CAPPED_N, team_cap=1, cursor=cursor
                )
            cursor = turn.cursor
            if any(ref.task_id in new_runs for ref in turn.refs):
                return fills
    return CAPPED_MAX_FILLS


def team_runs(engine: sa.Engine, team: Any) -> set[Any]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id FROM background_tasks WHERE team_id = :t"), {"t": team}
        )
        return {row.id for row in rows}


def run_p9(
    env: BenchEnv, future_teams: int = FUTURE_TEAMS, ready_teams: int = READY_TEAMS
) -> dict[str, Any]:
    scheduled = env.part("p9-scheduled")
    with scheduled.engine.begin() as conn:
        owner = conn.execute(OWNER).scalar_one()
    add_teams(scheduled.engine, owner, 1, FILL_N, -1.0)
    empty = fill_ms(scheduled.engine, FILL_N)
    started = time.perf_counter()
    add_teams(scheduled.engine, owner, future_teams, 1, 86_400.0)
    build_s = time.perf_counter() - started
    future = fill_ms(scheduled.engine, FILL_N)

    ready = env.part("p9-ready")
    with ready.engine.begin() as conn:
        ready_owner = conn.execute(OWNER).scalar_one()
    add_teams(ready.engine, ready_owner, ready_teams, 2, -1.0)
    many_ready = fill_ms(ready.engine, FILL_N)

    capped = env.part("p9-capped")
    with capped.engine.begin() as conn:
        capped_owner = conn.execute(OWNER).scalar_one()
    fills = capped_fills(capped.engine, capped_owner)

    empty_ms, future_ms = statistics.median(empty), statistics.median(future)
    return {
        "p9_fill_ms_empty": round(empty_ms, 2),
        "p9_fill_ms_100k_future": round(future_ms, 2),
        "p9_fill_ratio_100k_future": round(future_ms / empty_ms, 2),
        "p9_fill_ms_10k_ready": round(statistics.median(many_ready), 2),
        "p9_capped_fills": fills,
        "p9_detail": {
            "fill_n": FILL_N,
            "future_teams": future_teams,
            "ready_teams": ready_teams,
            "build_future_s": round(build_s, 1),
            "fill_ms_empty": [round(t, 2) for t in empty],
            "fill_ms_future": [round(t, 2) for t in future],
            "fill_ms_10k_ready": [round(t, 2) for t in many_ready],
            "capped": {"teams": CAPPED_TEAMS, "fill_n": CAPPED_N, "max_fills": CAPPED_MAX_FILLS},
        },
    }
