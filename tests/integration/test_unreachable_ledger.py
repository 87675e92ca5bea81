"""An execution whose database went away ends as what it is (found by the full soak's
PostgreSQL restarts): a failed attempt ends as a retry even though its own connection is
dead, and a rejection ends as the rejection even when the ledger cannot record it. Before,
closing the dead connection raised ``OperationalError`` over the retry, and a rejection's
report had no guard at all: Celery logged "raised unexpected" with a traceback and stored
a FAILURE the ledger did not say."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.engine import make_url

from harness.databases import admin_engine
from harness.factories import World, add_tickets, audit_events, task_row
from harness.waiting import wait_for
from ledger import lease, service
from ledger.errors import PermissionLost
from tasks import execution, queueing
from tasks.names import EXPORT_TASK
from teamdesk import hooks
from tests.support.gates import Gate
from tests.support.queues import closed_port, send_message
from tests.support.scenario import event_records
from tests.support.workers import EventLog, running_worker


def test_an_attempt_whose_connection_died_ends_as_a_retry(
    engine: sa.Engine,
    world: World,
    database_url: str,
    make_app: Callable[..., Celery],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every session of the database is ended (``pg_terminate_backend``, as a restart or
    a failover does) while the export is parked at its second batch, its first progress
    written: the next progress write fails, the attempt reports its failure on a new
    connection and ends as a retry - while its own connection, dead in the middle of its
    COPY transaction, is closed. This guards the outcome; the failure the full soak saw
    (closing such a connection raised ``OperationalError`` over the retry, after
    ``pg_ctl stop -m fast``) does not reproduce with ``pg_terminate_backend`` here."""
    app = make_app(retry_base_delay_s=600, export_batch_size=500)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    message = queueing.message_id(task_id, 0)
    read = Gate("second batch")
    batches: list[int] = []

    def second(**_: object) -> bool:
        batches.append(1)
        return len(batches) == 2

    with (
        EventLog(app) as events,
        running_worker(app, concurrency=1),
        hooks.installed("export.after_read", read.hook(when=second)),
    ):
        try:
            send_message(app, task_id, 0, "EXPORT")
            read.wait_reached()
            end_sessions(database_url)
            read.release()
            wait_for(lambda: events.of_type("task-retried", message), what="the retry")
        finally:
            read.release()
    assert events.of_type("task-failed", message) == []
    row = task_row(engine, task_id)
    assert (row["status"], row["attempts"], row["execution_id"]) == ("WAITING", 1, None)
    assert row["last_error"] == execution.MSG_RETRYING
    assert audit_events(engine, task_id) == ["CLAIM", "WAIT"]
    [failed] = event_records(caplog, "task.attempt_failed", task_id)
    assert not hasattr(failed, "report_error")
    assert not [r for r in caplog.records if "raised unexpected" in r.getMessage()]


def end_sessions(database_url: str) -> None:
    """End every session of the test database (it goes on taking new ones)."""
    admin = admin_engine()
    try:
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": make_url(database_url).database},
            )
    finally:
        admin.dispose()


def test_a_rejection_the_ledger_cannot_record_still_ends_as_the_rejection(
    make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(
        database_url=f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere",
        stale_after_s=1.0,  # the report is tried again for half of it
    )
    held = lease.Lease(uuid.uuid4(), 0, uuid.uuid4(), 1)
    rejection = PermissionLost("The export's owner is no longer staff.")
    with caplog.at_level(logging.WARNING), pytest.raises(PermissionLost):
        execution._rejected(
            app.tasks[EXPORT_TASK],
            None,  # type: ignore[arg-type]  # the report fails first: never used
            held,
            rejection,
            {"task_id": "t"},
        )
    [failed] = [r for r in caplog.records if getattr(r, "event", None) == "task.failed"]
    assert failed.report_error == "OperationalError"  # type: ignore[attr-defined]
    assert failed.reason == rejection.message  # type: ignore[attr-defined]
