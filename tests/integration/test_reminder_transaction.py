"""A reminder is one transaction on its execution's own connection: no second connection
from the pool, side effects and completion committed together, and a lost lease rolls
everything back and leaves the pooled connection outside any transaction."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2.extensions
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from harness.factories import World, add_ticket, insert_task, task_row
from ledger import lease, service
from ledger.errors import LeaseLost
from tasks import reminder
from tasks.execution import Context
from tasks.reminder import run_reminder
from teamdesk import config
from tests.support.scenario import side_effects


def reminder_for(engine: sa.Engine, world: World) -> tuple[uuid.UUID, uuid.UUID]:
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
        task_id = insert_task(conn, world, kind="REMINDER", filters={"ticket_id": str(ticket)})
    return ticket, task_id


@contextmanager
def execution(engine: sa.Engine, task_id: uuid.UUID) -> Iterator[tuple[Connection, Context]]:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        claimed = lease.claim(conn, task_id, 0)
        assert claimed is not None
        yield conn, Context(claimed, config.get_settings(), conn, engine, lambda *_: None)


def checkouts(engine: sa.Engine) -> list[object]:
    seen: list[object] = []
    sa.event.listen(engine, "checkout", lambda *args: seen.append(args[0]), named=False)
    return seen


def idle(conn: Connection) -> bool:
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    status = dbapi.get_transaction_status()
    return bool(status == psycopg2.extensions.TRANSACTION_STATUS_IDLE)


def test_a_reminder_takes_no_second_connection_and_commits_once(
    engine: sa.Engine, world: World
) -> None:
    ticket, task_id = reminder_for(engine, world)
    before = side_effects(engine, ticket)
    with execution(engine, task_id) as (conn, ctx):
        taken = checkouts(engine)
        summary = run_reminder(ctx)
        assert taken == []  # the execution's connection did all of it
        assert idle(conn)  # committed: no transaction left open on a pooled connection
    assert summary == f"reminder sent to {world.staff_id}"
    row = task_row(engine, task_id)
    assert (row["status"], row["result_summary"], row["execution_id"]) == (
        "COMPLETED",
        summary,
        None,
    )
    after = side_effects(engine, ticket)
    assert (after.notifications, after.events, after.version) == (1, 1, before.version + 1)
    with engine.connect() as conn:
        assert service.get_task(conn, task_id, world.staff_id).as_dict()["skipped"] is False


def test_a_lost_lease_rolls_everything_back_and_ends_the_transaction(
    engine: sa.Engine, world: World
) -> None:
    ticket, task_id = reminder_for(engine, world)
    before = side_effects(engine, ticket)
    with execution(engine, task_id) as (conn, ctx):
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
            # Celery's re-send after the pool process was lost takes it over
            assert lease.claim(other, task_id, 0, stale_after_s=0) is not None
        with pytest.raises(LeaseLost):
            run_reminder(ctx)
        assert idle(conn)
        assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1  # still usable
    assert side_effects(engine, ticket) == before
    assert task_row(engine, task_id)["status"] == "RUNNING"  # the newer execution's


def test_the_completion_statement_writes_no_side_effect_for_a_lost_lease(
    engine: sa.Engine, world: World
) -> None:
    """The side effects are written through the completed row: with the lease gone the
    statement writes none of them, even in a transaction that then commits."""
    ticket, task_id = reminder_for(engine, world)
    before = side_effects(engine, ticket)
    with execution(engine, task_id) as (conn, ctx):
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
            newer = lease.claim(other, task_id, 0, stale_after_s=0)
            assert newer is not None
        values = reminder.effect_values(ctx.claim, ticket, world.staff_id)
        conn.exec_driver_sql("BEGIN")
        with pytest.raises(LeaseLost):
            lease.complete_in_transaction(
                conn, ctx.claim.lease, "late", reminder.SEND_AND_COMPLETE, **values
            )
        conn.exec_driver_sql("COMMIT")  # what the statement wrote, if anything, stays
    assert side_effects(engine, ticket) == before
    row = task_row(engine, task_id)
    assert (row["status"], row["execution_id"]) == ("RUNNING", newer.lease.execution_id)
    with engine.connect() as conn:
        audit = conn.execute(
            sa.text("SELECT event FROM task_audit WHERE task_id = :t ORDER BY id"), {"t": task_id}
        ).scalars()
        assert list(audit) == ["CLAIM", "CLAIM"]
