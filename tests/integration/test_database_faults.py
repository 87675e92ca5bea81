"""PostgreSQL faults a platform has: a window in which new connections are refused (a
restart, ``max_connections``), and a process frozen inside a reminder's transaction.
Real PostgreSQL, worker and dispatcher; the refusal is this test database's own
``ALLOW_CONNECTIONS false`` plus ending its sessions (the shared server keeps running)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.engine import make_url

from dispatcher import scan as scan_module
from harness.databases import admin_engine
from harness.factories import (
    World,
    add_ticket,
    add_tickets,
    audit_events,
    make_world,
    task_row,
)
from harness.waiting import wait_for
from ledger import service
from tasks import queueing
from tasks import reminder as reminder_module
from teamdesk import hooks
from tests.support.dispatching import running_cluster
from tests.support.gates import Gate
from tests.support.scenario import event_records, side_effects
from tests.support.workers import EventLog


@contextmanager
def connections_refused(database_url: str) -> Iterator[Callable[[], None]]:
    """Refuse new connections to the test database and end every session it has; the
    yielded function lets them in again (so does leaving the block)."""
    name = make_url(database_url).database
    admin = admin_engine()
    allowed = False

    def allow() -> None:
        nonlocal allowed
        if not allowed:
            with admin.connect() as conn:
                conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            allowed = True

    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
        yield allow
    finally:
        allow()
        admin.dispose()


def test_a_delivery_that_cannot_connect_never_strands_the_run(
    engine: sa.Engine,
    world: World,
    database_url: str,
    make_app: Callable[..., Celery],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The dispatcher stamps the run and stops before sending; PostgreSQL then refuses
    new connections and ends every session. The message goes out and its delivery cannot
    even open a connection: it ends as a failed claim and leaves the broker, so once
    PostgreSQL lets connections in again the dispatcher finds the message missing,
    publishes the run again and it completes - not FAILED."""
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    app = make_app(scan_interval_s=0.3)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    message = queueing.message_id(task_id, 0)
    stamped = Gate("the run stamped, its message not sent")
    with (
        EventLog(app) as events,
        hooks.installed("dispatcher.before_publish", stamped.hook()),
        running_cluster(app),
    ):
        try:
            stamped.wait_reached()
            with connections_refused(database_url) as allow:
                stamped.release()
                wait_for(lambda: events.of_type("task-retried", message), what="the claim to fail")
                allow()
            engine.dispose()  # its pooled connections were ended too
            wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
        finally:
            stamped.release()
    row = task_row(engine, task_id)
    assert (row["run"], row["attempts"], row["result_summary"]) == (0, 1, "3 rows")
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    [failed_claim] = event_records(caplog, "task.attempt_failed", task_id)
    assert failed_claim.stage == "claim"  # type: ignore[attr-defined]
    assert event_records(caplog, "task.failed", task_id) == []


def reminder(engine: sa.Engine, world: World) -> tuple[uuid.UUID, uuid.UUID]:
    with engine.begin() as conn:
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Call back", assignee_id=world.staff2_id
        )
        return service.create_reminder(conn, world.team_id, world.staff_id, ticket), ticket


def test_a_reminder_frozen_in_its_transaction_holds_its_team_back_only_briefly(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reminder A stops inside its transaction, holding its team's lock (a frozen
    process). The server ends A's session after the transaction's budget, so reminder B
    of the same team waits for the lock at most that long (and retries at most once),
    reminder C of another team is not held at all, and A itself runs again on a new
    connection: every reminder is sent exactly once."""
    monkeypatch.setattr(reminder_module, "TX_BUDGET_S", 1.0)
    app = make_app(retry_base_delay_s=0.2, max_task_attempts=3)
    other = make_world(engine)
    a_id, a_ticket = reminder(engine, world)
    frozen = Gate("A inside its transaction")
    with (
        hooks.installed(
            "reminder.after_lease_read",
            frozen.hook(when=lambda claim, **_: claim.lease.task_id == a_id),
        ),
        running_cluster(app, concurrency=3),
    ):
        try:
            frozen.wait_reached()
            b_id, b_ticket = reminder(engine, world)
            c_id, c_ticket = reminder(engine, other)
            wait_for(lambda: task_row(engine, c_id)["status"] == "COMPLETED", what="C")
            wait_for(lambda: task_row(engine, b_id)["status"] == "COMPLETED", what="B")
            assert task_row(engine, a_id)["status"] == "RUNNING"  # still frozen
        finally:
            frozen.release()
        wait_for(lambda: task_row(engine, a_id)["status"] == "COMPLETED", what="A")
    rows = {name: task_row(engine, t) for name, t in (("A", a_id), ("B", b_id), ("C", c_id))}
    assert rows["A"]["attempts"] == 2  # its session was ended under it: one failed attempt
    assert rows["B"]["attempts"] <= 2
    assert rows["C"]["attempts"] == 1
    for ticket in (a_ticket, b_ticket, c_ticket):
        sent = side_effects(engine, ticket)
        assert (sent.notifications, sent.events) == (1, 1)


def test_a_reminder_waiting_for_its_teams_lock_is_never_taken_for_stalled(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
) -> None:
    """Reminder A stops inside its transaction, holding its team's lock; reminder B of the
    same team waits for the lock and writes nothing to its row meanwhile. With
    ``STALE_AFTER_S`` shorter than the transaction's 15 s budget, B used to stay silent
    past it and the dispatcher revoked B's live lease (RECOVER; found by the soak). The
    budget is at most half of ``STALE_AFTER_S``: B gives up first (a failed attempt) and
    is never recovered; A, frozen, may be."""
    app = make_app(stale_after_s=2.0, retry_base_delay_s=0.2, max_task_attempts=5)
    a_id, a_ticket = reminder(engine, world)
    frozen = Gate("A inside its transaction")
    with (
        hooks.installed(
            "reminder.after_lease_read",
            frozen.hook(when=lambda claim, **_: claim.lease.task_id == a_id),
        ),
        running_cluster(app, concurrency=3),
    ):
        try:
            frozen.wait_reached()
            b_id, b_ticket = reminder(engine, world)
            wait_for(lambda: task_row(engine, b_id)["status"] == "COMPLETED", what="B")
        finally:
            frozen.release()
        wait_for(lambda: task_row(engine, a_id)["status"] == "COMPLETED", what="A")
    b = task_row(engine, b_id)
    assert (b["recoveries"], b["attempts"] <= 2) == (0, True), b
    assert "RECOVER" not in audit_events(engine, b_id)
    assert audit_events(engine, b_id)[-1] == "COMPLETE"
    for ticket in (a_ticket, b_ticket):
        sent = side_effects(engine, ticket)
        assert (sent.notifications, sent.events) == (1, 1)
