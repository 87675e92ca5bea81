"""Scheduled runs (docs/design.md, "Dispatch"), against real PostgreSQL: a run whose
``run_at`` is ahead is *scheduled* and outside the ready set the round-robin walks; each
fill promotes the ones the database's clock has reached, oldest first and at most a batch
at a time; a scheduled run cancelled before it is due is never promoted or stamped; a
failed attempt waits its backoff as a scheduled run; the quota still counts scheduled
runs; and with 20,000 teams whose runs are all ahead a fill reads a few index entries,
not one per team.

Time passes for real here (a few tenths of a second): "due" is the database's clock
reaching a ``run_at`` the test chose, read back from the database, never a host's sleep.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from harness.factories import World, add_ticket, audit_events, insert_task, task_row
from harness.waiting import wait_for
from ledger import dispatch, lease, service
from ledger.errors import TeamQuotaExceeded
from ledger.quota import ensure_room
from ledger.waiting import ready_by_kind

SOON_S = 0.4  # a run due this far ahead becomes due while the test waits


def database_now(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        return dispatch.database_now(conn)


def reminder(engine: sa.Engine, world: World, in_s: float) -> uuid.UUID:
    """A reminder created through the ledger's service, due ``in_s`` from the database's now."""
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
        run_at = dispatch.database_now(conn) + timedelta(seconds=in_s)
        return service.create_reminder(conn, world.team_id, world.staff_id, ticket, run_at)


def wait_until_due(engine: sa.Engine, *task_ids: uuid.UUID) -> None:
    """Until the database's clock has passed every one of these runs' run_at."""
    latest = max(task_row(engine, t)["run_at"] for t in task_ids)
    wait_for(lambda: database_now(engine) > latest, timeout=10, interval=0.02, what="run_at")


def stamp(engine: sa.Engine, kind: str = "REMINDER", n: int = 10) -> list[uuid.UUID]:
    """One fill's ledger part: promote, then stamp (as dispatcher/window.py fill)."""
    with engine.begin() as conn:
        dispatch.window_state(conn)
        return [ref.task_id for ref in dispatch.stamp_ready(conn, kind=kind, n=n, team_cap=0).refs]


def test_a_run_due_later_is_scheduled_and_outside_the_ready_walk(
    engine: sa.Engine, world: World
) -> None:
    later = reminder(engine, world, 3600)

    row = task_row(engine, later)
    assert (row["status"], row["scheduled"], row["dispatched_at"]) == ("WAITING", True, None)
    with engine.begin() as conn:
        state = dispatch.window_state(conn)
        turn = dispatch.stamp_ready(conn, kind="REMINDER", n=10, team_cap=0)
        assert dispatch.ready_kinds(conn, ["REMINDER"]) == set()
        assert ready_by_kind(conn)["REMINDER"] == 0
    assert (state.promoted, state.waiting) == (0, frozenset())
    assert state.next_due_s is not None and 3590 < state.next_due_s <= 3600
    assert turn.refs == []
    row = task_row(engine, later)
    assert (row["scheduled"], row["dispatched_at"]) == (True, None)
    assert audit_events(engine, later) == []


def test_a_scheduled_run_is_promoted_and_stamped_once_the_database_clock_reaches_it(
    engine: sa.Engine, world: World
) -> None:
    soon = reminder(engine, world, SOON_S)
    assert stamp(engine) == []  # not due yet: neither promoted nor stamped
    assert task_row(engine, soon)["scheduled"] is True

    wait_until_due(engine, soon)
    with engine.connect() as conn:  # due, not yet promoted: counted as ready all the same
        assert ready_by_kind(conn)["REMINDER"] == 1
        assert dispatch.ready_kinds(conn, ["REMINDER"]) == {"REMINDER"}
    with engine.begin() as conn:
        state = dispatch.window_state(conn)
        turn = dispatch.stamp_ready(conn, kind="REMINDER", n=10, team_cap=0)

    assert (state.promoted, state.waiting, state.next_due_s) == (1, frozenset({"REMINDER"}), None)
    assert [ref.task_id for ref in turn.refs] == [soon]
    row = task_row(engine, soon)
    assert (row["status"], row["scheduled"]) == ("WAITING", False)
    assert row["dispatched_at"] is not None and row["dispatched_at"] >= row["run_at"]
    assert audit_events(engine, soon) == []  # a promotion and a stamp are not transitions


def test_promotion_takes_the_oldest_first_a_batch_at_a_time_and_asks_for_the_next_fill(
    engine: sa.Engine, world: World
) -> None:
    due = [reminder(engine, world, SOON_S + i * 0.01) for i in range(5)]
    later = reminder(engine, world, 3600)
    wait_until_due(engine, *due)

    promoted, next_due = [], []
    for _ in range(4):
        with engine.begin() as conn:
            state = dispatch.window_state(conn, promote_batch=2)
        promoted.append(state.promoted)
        next_due.append(state.next_due_s)
        flags = [task_row(engine, t)["scheduled"] for t in due]
        assert flags == sorted(flags), flags  # the oldest were promoted first

    assert promoted == [2, 2, 1, 0]
    assert next_due[:2] == [0.0, 0.0]  # cut at the batch: more are due now
    assert all(d is not None and 3500 < d <= 3600 for d in next_due[2:]), next_due
    assert [task_row(engine, t)["scheduled"] for t in due] == [False] * 5
    assert task_row(engine, later)["scheduled"] is True
    assert sorted(stamp(engine)) == sorted(due)


def test_a_scheduled_run_cancelled_before_it_is_due_is_never_promoted_or_stamped(
    engine: sa.Engine, world: World
) -> None:
    soon = reminder(engine, world, SOON_S)
    with engine.begin() as conn:
        service.cancel(conn, soon, world.staff_id)
    row = task_row(engine, soon)
    assert (row["status"], row["scheduled"]) == ("CANCELLED", False)

    wait_until_due(engine, soon)
    with engine.begin() as conn:
        assert dispatch.window_state(conn).promoted == 0
    assert stamp(engine) == []
    row = task_row(engine, soon)
    assert (row["status"], row["scheduled"], row["dispatched_at"]) == ("CANCELLED", False, None)
    assert audit_events(engine, soon) == ["CANCEL"]


def test_a_failed_attempt_waits_its_backoff_as_a_scheduled_run(
    engine: sa.Engine, world: World
) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
        claim = lease.claim(conn, task_id, 0, "host/1")
        assert claim is not None
    with engine.begin() as conn:
        assert lease.report_failure(
            conn, claim.lease, final=False, message="boom", retry_in_s=SOON_S
        )
    row = task_row(engine, task_id)
    assert (row["status"], row["scheduled"], row["dispatched_at"]) == ("WAITING", True, None)
    assert stamp(engine, "EXPORT") == []

    wait_until_due(engine, task_id)
    assert stamp(engine, "EXPORT") == [task_id]
    row = task_row(engine, task_id)
    assert (row["status"], row["scheduled"], row["attempts"]) == ("WAITING", False, 1)
    assert audit_events(engine, task_id) == ["CLAIM", "WAIT"]


def set_sql(engine: sa.Engine, task_id: uuid.UUID, assignment: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE background_tasks SET {assignment} WHERE id = :id"), {"id": task_id}
        )


def test_the_flag_follows_every_write_of_status_run_at_or_dispatched_at(
    engine: sa.Engine, world: World
) -> None:
    """The row trigger keeps ``scheduled`` whoever writes the row (an operator's SQL too),
    and the check constraint refuses a scheduled row that is not WAITING and unpublished."""
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    assert task_row(engine, task_id)["scheduled"] is False  # created ready
    set_sql(engine, task_id, "run_at = now() + interval '1 hour'")
    assert task_row(engine, task_id)["scheduled"] is True
    set_sql(engine, task_id, "dispatched_at = now()")
    assert task_row(engine, task_id)["scheduled"] is False  # published
    set_sql(engine, task_id, "dispatched_at = NULL")
    assert task_row(engine, task_id)["scheduled"] is True  # unpublished, still ahead
    set_sql(engine, task_id, "status = 'CANCELLED'")
    assert task_row(engine, task_id)["scheduled"] is False
    with pytest.raises(sa.exc.IntegrityError, match="ck_background_tasks_scheduled_waiting"):
        set_sql(engine, task_id, "scheduled = true")
    assert task_row(engine, task_id)["scheduled"] is False


def test_the_quota_counts_scheduled_runs(engine: sa.Engine, world: World) -> None:
    reminder(engine, world, 3600)
    with engine.begin() as conn:
        ensure_room(conn, world.team_id, 2)  # one unfinished of two: room
    with engine.begin() as conn:
        insert_task(conn, world)  # and one ready
    with engine.begin() as conn, pytest.raises(TeamQuotaExceeded):
        ensure_room(conn, world.team_id, 2)


# --- at tenant scale ---------------------------------------------------------------------

FUTURE_TEAMS = 20_000

# :teams teams with one reminder each due tomorrow, in one statement (rows the service
# would write; the ticket is irrelevant to dispatch).
FUTURE = sa.text("""
    WITH t AS (
        INSERT INTO teams (name) SELECT 'future-' || g FROM generate_series(1, :teams) g
        RETURNING id
    )
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, run_at)
    SELECT 'REMINDER', t.id, :owner, 'TEAM', '{}'::jsonb, now() + interval '1 day' FROM t
""")
READY = sa.text("""
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)
    SELECT 'REMINDER', :team, :owner, 'TEAM', '{}'::jsonb FROM generate_series(1, 5)
""")


def index_entries_read(plan: dict[str, Any]) -> int:
    """Rows every scan of background_tasks in this plan returned, over all its loops."""
    own = 0
    if plan.get("Relation Name") == "background_tasks" and "Scan" in plan["Node Type"]:
        own = int(plan["Actual Rows"]) * int(plan["Actual Loops"])
    return own + sum(index_entries_read(child) for child in plan.get("Plans", []))


def test_a_fill_reads_no_entry_of_a_team_whose_runs_are_all_ahead(
    engine: sa.Engine, world: World
) -> None:
    """20,000 teams each hold one reminder due tomorrow, one team has 5 ready. A fill's
    promotion and round-robin read a handful of index entries: before scheduled runs left
    the ready set, the walk read one entry per team (20,000)."""
    with engine.begin() as conn:
        conn.execute(FUTURE, {"teams": FUTURE_TEAMS, "owner": world.staff_id})
        conn.execute(READY, {"team": world.team_id, "owner": world.staff_id})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE background_tasks"))

    params = {"kind": "REMINDER", "n": 64, "cap": 0, "cursor": str(dispatch.NO_TEAM)}
    with engine.connect() as conn:
        read, stamped = {}, 0
        for name, statement, values in (
            ("window", dispatch.WINDOW_STATE, {"promote_batch": dispatch.PROMOTE_BATCH}),
            ("stamp", dispatch.STAMP_READY, params),
        ):
            explain = sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + statement.text).bindparams(
                *statement._bindparams.values()
            )
            [plan] = conn.execute(explain, values).scalar_one()
            read[name] = index_entries_read(plan["Plan"])
            if name == "stamp":
                stamped = int(plan["Plan"]["Actual Rows"])
        conn.rollback()

    assert stamped == 5
    assert read["stamp"] < 100, read
    assert read["window"] < 100, read
