"""P9: what one fill costs at tenant scale, on the database alone: the ledger's part of a
fill (``ledger.dispatch.window_state``, which promotes the scheduled runs now due, then
``stamp_ready`` for the queue), as dispatcher/window.py ``fill`` runs them.

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

Then the same two cases through the real path (``celery -A tasks beat`` and ``celery -A
tasks worker`` subprocesses, every time from the database's clock):

- ``p9_reminder_start_p50_ms_100k_future``: on the ledger of ``p9_fill_ms_100k_future``, one
  worker (``-c 2``) and beat; ``REMINDER_STARTS`` reminders due now, created one at a time
  through ``ledger.service`` as the API does: ``created_at`` -> the run's first CLAIM;
- ``p9_capped_start_s``: ``TEAM_MAX_RUNNING=1`` and ``DISPATCH_WINDOW=2``; ``CAPPED_TEAMS``
  teams with ``CAPPED_BACKLOG`` exports each, one of each held RUNNING after its claim
  (bench/park_hooks.py) by a worker with a free process; then a new team's export:
  ``created_at`` -> its CLAIM (``CAPPED_TIMEOUT_S`` means not within that).
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.dispatch_path import (
    FINAL,
    IDLE_PAUSE_S,
    TASK_TIMEOUT_S,
    WARMUP_TASKS,
    Rig,
    ms,
    require_claims,
    spread,
    status_of,
    terminate,
    times_of,
    wait_finished,
    wait_logged,
)
from bench.env import BenchEnv, Part, wait_until
from bench.throughput import TicketRef, seed_world
from ledger import dispatch, service
from tasks.names import EXPORTS_QUEUE
from teamdesk.heartbeat import slots_by_queue

FILL_N = 64
FUTURE_TEAMS = 100_000
READY_TEAMS = 10_000
CAPPED_TEAMS, CAPPED_N, CAPPED_MAX_FILLS = 20, 2, 50
FILLS, WARMUP = 25, 5
REMINDER_STARTS = 30
CAPPED_BACKLOG = 3
CAPPED_TIMEOUT_S = 30.0
BEAT_START_TIMEOUT_S = 60.0

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
                dispatch.window_state(conn)
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


def reminder_starts(env: BenchEnv, part: Part, n: int) -> list[float]:
    """created_at -> first CLAIM (ms, database clock) of ``n`` reminders due now, one at a
    time, through one worker and beat."""
    refs = seed_world(part.engine)
    rig = Rig(env, part)
    try:
        rig.add_workers(1)
        rig.start_beat()
        rig.warm_up(refs, WARMUP_TASKS)
        ids: list[uuid.UUID] = []
        for i in range(n):
            ref = refs[i % len(refs)]
            with part.engine.begin() as conn:  # as the API does: validate, insert, commit
                ids.append(service.create_reminder(conn, ref.team_id, ref.staff_id, ref.ticket_id))
            wait_until(
                lambda t=ids[-1]: status_of(part.engine, t) in FINAL,
                TASK_TIMEOUT_S,
                0.005,
                "a reminder",
            )
            time.sleep(IDLE_PAUSE_S)  # idle again before the next sample (not timed)
    finally:
        rig.close()
    rows = times_of(part.engine, ids)
    require_claims(rows, "reminders")
    return [ms(r.claimed - r.created_at) for r in rows]


RUNNING_BY_TEAM = sa.text("""
    SELECT count(DISTINCT team_id) AS teams, count(*) AS runs FROM background_tasks
     WHERE status = 'RUNNING' AND team_id = ANY(CAST(:teams AS uuid[]))
""")


def capped_start(env: BenchEnv) -> dict[str, Any]:
    """A new team's export, created while CAPPED_TEAMS teams are at their cap of 1 with
    backlogs, DISPATCH_WINDOW=2: created_at -> its CLAIM, through beat and a worker."""
    part = env.part("p9-capped-path")
    teams: dict[uuid.UUID, TicketRef] = {}
    for ref in seed_world(part.engine):
        teams.setdefault(ref.team_id, ref)
    capped, (newcomer,) = list(teams.values())[:CAPPED_TEAMS], list(teams.values())[-1:]
    park = env.workdir / "p9-park"
    park.touch()
    processes = CAPPED_TEAMS + 1
    worker = env.worker(
        part,
        "p9-capped",
        concurrency=processes,
        hooks="bench.park_hooks",
        BENCH_PARK_FILE=str(park),  # bench/park_hooks.py
    )
    beat = None
    try:
        worker.wait_event("worker.started", timeout=120)
        wait_until(
            lambda: slots_by_queue(env.redis, part.prefix).get(EXPORTS_QUEUE, 0) == processes,
            60,
            0.05,
            "the capped worker's processes in the heartbeats",
        )
        beat = env.beat(part, name="p9-capped-beat", TEAM_MAX_RUNNING=1, DISPATCH_WINDOW=2)
        wait_logged(beat, "dispatcher.listen", BEAT_START_TIMEOUT_S, state="listening")
        ids: list[uuid.UUID] = []
        with part.engine.begin() as conn:
            for ref in capped:
                for _ in range(CAPPED_BACKLOG):
                    ids.append(service.create_export(conn, ref.team_id, ref.staff_id, "TEAM", {}))
        team_ids = [str(ref.team_id) for ref in capped]

        def all_capped() -> bool:
            with part.engine.connect() as conn:
                row = conn.execute(RUNNING_BY_TEAM, {"teams": team_ids}).one()
            if row.runs > row.teams:
                raise RuntimeError("bench: TEAM_MAX_RUNNING=1 did not hold (two runs of a team)")
            return int(row.teams) == CAPPED_TEAMS

        wait_until(all_capped, 60, 0.02, "every capped team running its one export")
        with part.engine.begin() as conn:
            new_id = service.create_export(conn, newcomer.team_id, newcomer.staff_id, "TEAM", {})
        try:
            wait_until(
                lambda: status_of(part.engine, new_id) != "WAITING",
                CAPPED_TIMEOUT_S,
                0.005,
                "the new team's export claimed",
            )
        except Exception:
            start_s = CAPPED_TIMEOUT_S  # not claimed in time: the goal's "never"
        else:
            (row,) = times_of(part.engine, [new_id])
            start_s = ms(row.claimed - row.created_at) / 1000
        park.unlink()
        wait_finished(part.engine, [*ids, new_id], 120, 0.05, "capped exports")
    finally:
        park.unlink(missing_ok=True)
        codes = terminate([p for p in (beat, worker) if p is not None])
    return {
        "start_s": round(start_s, 3),
        "teams": CAPPED_TEAMS,
        "backlog_each": CAPPED_BACKLOG,
        "exit_codes": codes,
    }


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

    future_starts = reminder_starts(env, scheduled, REMINDER_STARTS)
    capped_path = capped_start(env)

    empty_ms, future_ms = statistics.median(empty), statistics.median(future)
    return {
        "p9_fill_ms_empty": round(empty_ms, 2),
        "p9_fill_ms_100k_future": round(future_ms, 2),
        "p9_fill_ratio_100k_future": round(future_ms / empty_ms, 2),
        "p9_fill_ms_10k_ready": round(statistics.median(many_ready), 2),
        "p9_capped_fills": fills,
        "p9_reminder_start_p50_ms_100k_future": round(statistics.median(future_starts), 2),
        "p9_capped_start_s": capped_path["start_s"],
        "p9_detail": {
            "reminder_start_ms_100k_future": spread(future_starts),
            "capped_path": capped_path,
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
