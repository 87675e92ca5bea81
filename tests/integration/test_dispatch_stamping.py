"""Which ready runs a fill stamps (docs/design.md, "Dispatch"), against real PostgreSQL:
teams take turns round robin from where the last turn ended, a team with only scheduled
runs does not hold up a turn, the team cap limits one team in flight, and two fills that
overlap never stamp or publish a run twice. Concurrency is ordered by a barrier inside
the ledger call, never by sleeping.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher.context import Cluster
from dispatcher.window import Window, fill
from harness.factories import World, task_row
from ledger import dispatch
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat
from tests.support.dispatch_scan import ids, messages, other_team, waiting_rows

# --- stamp: teams take turns -----------------------------------------------------------------


def stamped_order(engine: sa.Engine, refs: list[dispatch.RunRef]) -> list[uuid.UUID]:
    return [ref.task_id for ref in refs]


def expected_turn(
    waiting: dict[uuid.UUID, list[uuid.UUID]], cursor: uuid.UUID, n: int
) -> list[uuid.UUID]:
    """The round-robin rule, written plainly: starting after ``cursor`` in team id order
    and wrapping, the next ``n`` teams with waiting rows each give their oldest; with
    fewer teams than ``n``, each gives its next oldest in the same order, and so on."""
    teams = sorted((t for t, rows in waiting.items() if rows), key=lambda t: (t <= cursor, t))
    turn, left = teams[:n], {t: list(waiting[t]) for t in teams[:n]}
    picked: list[uuid.UUID] = []
    while len(picked) < n and any(left.values()):
        for team in turn:
            if left[team] and len(picked) < n:
                picked.append(left[team].pop(0))
    return picked


def test_teams_take_turns_round_robin_from_where_the_last_turn_ended(
    engine: sa.Engine, world: World
) -> None:
    """Team A queued 20 first, then C 2, then B 1: every turn serves the next teams after
    the one served last, one run each, so one team's backlog never stands in front of
    another team's first task."""
    team_a, team_b, team_c = world, other_team(engine, "B"), other_team(engine, "C")
    waiting = {
        team_a.team_id: waiting_rows(engine, team_a, 20),
        team_c.team_id: waiting_rows(engine, team_c, 2),
        team_b.team_id: waiting_rows(engine, team_b, 1),
    }
    cursor = dispatch.NO_TEAM
    for n in (2, 2, 2, 3):
        want = expected_turn(waiting, cursor, n)
        with engine.begin() as conn:
            turn = dispatch.stamp_ready(conn, kind="EXPORT", n=n, team_cap=0, cursor=cursor)
        assert stamped_order(engine, turn.refs) == want
        for rows in waiting.values():
            rows[:] = [r for r in rows if r not in want]
        cursor = turn.cursor
    assert waiting[team_b.team_id] == [] and waiting[team_c.team_id] == []
    assert len(waiting[team_a.team_id]) == 20 - 6  # B's one and C's two went in A's turns


def test_a_team_with_only_scheduled_runs_does_not_hold_up_a_turn(
    engine: sa.Engine, world: World
) -> None:
    """The team first in line has nothing ready (its reminder is due in an hour); the
    turn passes it over and serves the next team's ready run."""
    teams = sorted([world, other_team(engine, "B")], key=lambda team: team.team_id)
    first, second = teams
    scheduled = waiting_rows(engine, first, 1)[0]
    set_columns_sql(engine, scheduled, "run_at = now() + interval '1 hour'")
    ready = waiting_rows(engine, second, 1)[0]

    with engine.begin() as conn:
        turn = dispatch.stamp_ready(conn, kind="EXPORT", n=1, team_cap=0)

    assert stamped_order(engine, turn.refs) == [ready]
    assert turn.cursor == second.team_id
    assert task_row(engine, scheduled)["dispatched_at"] is None


def set_columns_sql(engine: sa.Engine, task_id: uuid.UUID, assignment: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE background_tasks SET {assignment} WHERE id = :id"), {"id": task_id}
        )


def test_team_cap_limits_one_team_in_flight(engine: sa.Engine, world: World) -> None:
    team_b = other_team(engine, "B")
    a_rows = waiting_rows(engine, world, 10)
    b_rows = waiting_rows(engine, team_b, 10)

    with engine.begin() as conn:
        stamped = dispatch.stamp_ready(conn, kind="EXPORT", n=10, team_cap=2).refs

    assert sorted(stamped_order(engine, stamped)) == sorted(a_rows[:2] + b_rows[:2])
    with engine.begin() as conn:
        assert dispatch.stamp_ready(conn, kind="EXPORT", n=10, team_cap=2).refs == []


def test_teams_at_their_cap_do_not_hold_up_the_turn_of_a_team_with_room(
    engine: sa.Engine, world: World
) -> None:
    """The next two teams after the cursor are at the cap with backlogs, a third has
    nothing in flight: a fill of two serves the third. Before, the turn took the next
    two teams before it knew their room, stamped nothing, and every fill made the same
    choice until one of the capped teams finished a run (issue 24, finding 2)."""
    teams = sorted(
        [world, other_team(engine, "B"), other_team(engine, "C")], key=lambda w: w.team_id
    )
    capped, free = teams[:2], teams[2]
    backlog = {team.team_id: waiting_rows(engine, team, 3) for team in capped}
    for team in capped:  # one published, unclaimed run each: at a cap of 1
        set_columns_sql(engine, backlog[team.team_id][0], "dispatched_at = now()")
    free_rows = waiting_rows(engine, free, 2)

    with engine.begin() as conn:
        turn = dispatch.stamp_ready(conn, kind="EXPORT", n=2, team_cap=1)
    assert stamped_order(engine, turn.refs) == free_rows[:1]
    assert turn.cursor == free.team_id
    # Every team is at its cap now: nothing more, and the capped backlogs are untouched.
    with engine.begin() as conn:
        assert (
            dispatch.stamp_ready(conn, kind="EXPORT", n=2, team_cap=1, cursor=turn.cursor).refs
            == []
        )
    for team in capped:
        assert [task_row(engine, t)["dispatched_at"] is None for t in backlog[team.team_id]] == [
            False,
            True,
            True,
        ]
    assert task_row(engine, free_rows[1])["dispatched_at"] is None


def test_overlapping_fills_never_stamp_or_publish_a_run_twice(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two dispatchers overlap (a standby taking over): both select while the other holds
    its row locks. SKIP LOCKED: the second takes fewer rows, never a row twice."""
    offer(concurrency=20)
    rows = waiting_rows(engine, world, 30)
    both_inside = threading.Barrier(2, timeout=20)
    stamped: list[list[dispatch.RunRef]] = []
    real = dispatch.stamp_ready

    def stamp_then_wait(conn: sa.Connection, **kw: Any) -> dispatch.Turn:
        turn = real(conn, **kw)
        if kw["kind"] == "EXPORT":
            stamped.append(turn.refs)
            both_inside.wait()  # both fills hold their locks at the same time
        return turn

    monkeypatch.setattr(dispatch, "stamp_ready", stamp_then_wait)
    errors: list[BaseException] = []

    def one_fill() -> None:
        cluster = Cluster(celery_app, settings)
        try:
            fill(cluster, Window(cluster))
        except BaseException as exc:
            errors.append(exc)
        finally:
            cluster.close()

    threads = [threading.Thread(target=one_fill) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(stamped) == 2

    chosen = [ref.task_id for refs in stamped for ref in refs]
    assert len(chosen) == len(set(chosen)) and 0 < len(chosen) <= 30
    assert messages(redis_client, queue_prefix)["exports"] == ids(sorted(chosen, key=str))
    assert {t for t in rows if task_row(engine, t)["dispatched_at"]} == set(chosen)
