"""Enqueue in the caller's own transaction (docs/api.md, "Enqueue in your own transaction";
docs/design.md, "Ledger"): TeamDesk's web application creates a ticket and its reminder
in one transaction by passing its connection to ``ledger.service``. Against real
PostgreSQL and a real dispatcher LISTEN connection:

- commit: the ticket and the task exist together, and the dispatcher's notification is
  delivered at the commit, never before (PostgreSQL sends a NOTIFY at commit: a round trip
  on the listening connection before it shows nothing, deterministically);
- rollback: neither exists, and no notification is ever delivered;
- the team's cap holds under the caller's transaction: a second creation waits for the
  first transaction's end on the team's lock, then sees its task and is refused;
- a committed reminder runs: the dispatcher and a worker send it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2
import sqlalchemy as sa
from celery import Celery

from harness.factories import World, add_ticket, audit_events, notifications, task_row
from harness.waiting import wait_for
from ledger import service
from ledger.errors import TeamQuotaExceeded
from ledger.wake import WAKE_CHANNEL
from tests.support.dispatching import running_cluster

LOCK_WAIT_TIMEOUT_S = 20.0


@contextmanager
def listening(database_url: str) -> Iterator[psycopg2.extensions.connection]:
    """A connection LISTENing on the dispatcher's channel, as the dispatcher's own does."""
    conn = psycopg2.connect(database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cursor:
            cursor.execute(f"LISTEN {WAKE_CHANNEL}")
        yield conn
    finally:
        conn.close()


def received(listener: psycopg2.extensions.connection) -> int:
    """Notifications delivered so far: one round trip reads whatever the server sent."""
    with listener.cursor() as cursor:
        cursor.execute("SELECT 1")
    listener.poll()
    return len(listener.notifies)


def tickets_titled(engine: sa.Engine, title: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM tickets WHERE title = :t"), {"t": title}
            ).scalar_one()
        )


def ticket_and_reminder(conn: sa.Connection, world: World, title: str) -> uuid.UUID:
    """What the web application does in its own transaction: a ticket, then its reminder."""
    ticket = add_ticket(conn, world.team_id, world.customer_id, title, assignee_id=world.staff2_id)
    return service.create_reminder(conn, world.team_id, world.staff_id, ticket)


def test_a_committed_task_exists_with_its_ticket_and_wakes_the_dispatcher_at_commit(
    engine: sa.Engine, world: World, database_url: str
) -> None:
    with listening(database_url) as listener:
        with engine.connect() as conn:
            tx = conn.begin()
            task_id = ticket_and_reminder(conn, world, "Printer on fire")
            assert received(listener) == 0  # inserted, not committed: nobody is told
            with engine.connect() as other:  # nor can anyone see it
                assert (
                    other.execute(
                        sa.text("SELECT count(*) FROM background_tasks WHERE id = :id"),
                        {"id": task_id},
                    ).scalar_one()
                    == 0
                )
            tx.commit()
        wait_for(lambda: received(listener) == 1, timeout=10, what="the notification")
        assert listener.notifies[0].channel == WAKE_CHANNEL
    assert task_row(engine, task_id)["status"] == "WAITING"
    assert tickets_titled(engine, "Printer on fire") == 1


def test_a_rolled_back_task_leaves_nothing_and_never_wakes_the_dispatcher(
    engine: sa.Engine, world: World, database_url: str
) -> None:
    with listening(database_url) as listener:
        with engine.connect() as conn:
            tx = conn.begin()
            task_id = ticket_and_reminder(conn, world, "Never happened")
            tx.rollback()
        assert received(listener) == 0  # the rollback has ended: nothing was sent
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT count(*) FROM background_tasks WHERE id = :id"), {"id": task_id}
            ).scalar_one()
            == 0
        )
    assert tickets_titled(engine, "Never happened") == 0


def waiting_on_an_advisory_lock(engine: sa.Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = :pid"
                    " AND locktype = 'advisory' AND NOT granted)"
                ),
                {"pid": pid},
            ).scalar_one()
        )


def test_the_team_cap_holds_under_the_callers_transaction(engine: sa.Engine, world: World) -> None:
    """TEAM_MAX_UNFINISHED=1. The first caller's transaction created one (uncommitted); a
    second caller's creation waits on the team's lock, sees the first task once it is
    committed, and is refused: never two."""
    outcome: list[object] = []
    with engine.connect() as first:
        tx = first.begin()
        ticket_and_reminder_capped = service.create_reminder(
            first,
            world.team_id,
            world.staff_id,
            add_ticket(first, world.team_id, world.customer_id, "one", assignee_id=world.staff2_id),
            max_unfinished=1,
        )
        second = engine.connect()
        second_pid = second.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]

        def create_second() -> None:
            try:
                with second.begin():
                    ticket = add_ticket(second, world.team_id, world.customer_id, "two")
                    outcome.append(
                        service.create_reminder(
                            second, world.team_id, world.staff_id, ticket, max_unfinished=1
                        )
                    )
            except TeamQuotaExceeded as exc:
                outcome.append(exc)

        worker = threading.Thread(target=create_second)
        worker.start()
        try:
            wait_for(
                lambda: waiting_on_an_advisory_lock(engine, second_pid),
                timeout=LOCK_WAIT_TIMEOUT_S,
                what="the second creation to wait for the team's lock",
            )
            tx.commit()
        finally:
            if tx.is_active:
                tx.rollback()
            worker.join(LOCK_WAIT_TIMEOUT_S)
            second.close()
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TeamQuotaExceeded), outcome
    assert task_row(engine, ticket_and_reminder_capped)["status"] == "WAITING"
    assert tickets_titled(engine, "two") == 0  # the refused caller's own writes rolled back
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM background_tasks")).scalar_one() == 1


def test_a_committed_reminder_is_sent(engine: sa.Engine, world: World, celery_app: Celery) -> None:
    with running_cluster(celery_app):
        with engine.begin() as conn:
            task_id = ticket_and_reminder(conn, world, "Call the customer back")
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="the reminder")
    assert notifications(engine, task_id) == 1
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
