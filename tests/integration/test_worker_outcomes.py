"""Outcomes through a real in-process worker: retry with backoff, rejection, exhaustion,
manual retry, cancel while running, the CSV contract, reminders that have nothing to do."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from dispatcher import scan as scan_module
from harness.csv_reference import expected_csv
from harness.factories import (
    World,
    add_ticket,
    add_tickets,
    audit_events,
    insert_task,
    set_role,
    task_row,
)
from harness.waiting import wait_for
from ledger import lease, permissions, prepared, service
from ledger.filters import MSG_DATE, MSG_STATUS
from tasks import queueing
from teamdesk import config, db, hooks
from tests.support.dispatching import running_cluster
from tests.support.gates import Gate
from tests.support.queues import broker_holds, send_message
from tests.support.scenario import event_records, field, outcomes, side_effects
from tests.support.workers import EventLog


def run_to_end(engine: sa.Engine, task_id: uuid.UUID) -> dict[str, object]:
    """Wait for the running cluster (worker + dispatcher) to finish the task's run."""
    wait_for(
        lambda: task_row(engine, task_id)["status"] in ("COMPLETED", "FAILED"),
        what="the task to end",
    )
    return task_row(engine, task_id)


def create_export(
    engine: sa.Engine,
    world: World,
    filters: dict[str, object] | None = None,
    scope: str = "TEAM",
    owner: uuid.UUID | None = None,
) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(
            conn, world.team_id, owner or world.staff_id, scope, filters or {}
        )


def test_transient_error_retries_once_after_backoff(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = 0.5
    app = make_app(retry_base_delay_s=base)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 30)
    task_id = create_export(engine, world)
    failed_at: list[float] = []
    claimed_at: list[float] = []

    def fail_first_read(**_: object) -> None:
        if not failed_at:
            failed_at.append(time.monotonic())
            raise ConnectionError("database connection reset")

    with (
        EventLog(app) as events,
        hooks.installed("export.after_read", fail_first_read),
        hooks.installed("task.claimed", lambda **_: claimed_at.append(time.monotonic())),
        running_cluster(app),  # after the hooks: its first scan publishes the export
    ):
        row = run_to_end(engine, task_id)
        message = queueing.message_id(task_id, 0)
        wait_for(lambda: events.of_type("task-succeeded", message), what="task-succeeded")
        retried = events.of_type("task-retried", message)
    assert (row["status"], row["attempts"], row["last_error"], row["progress"]) == (
        "COMPLETED",
        2,
        None,
        100,
    )
    assert row["result_summary"] == "30 rows"
    assert len(claimed_at) == 2 and len(retried) == 1
    assert claimed_at[1] - failed_at[0] >= base
    # Neither the retry nor the success is stored: the backend keeps failures only, so no
    # stale RETRY outlives the attempt that succeeded.
    assert AsyncResult(message, app=app).state == "PENDING"
    (attempt_failed,) = event_records(caplog, "task.attempt_failed", task_id)
    assert (field(attempt_failed, "attempt"), field(attempt_failed, "exhausted")) == (1, False)
    assert field(attempt_failed, "error") == "ConnectionError"
    assert "database connection reset" not in caplog.text
    assert len(event_records(caplog, "task.completed", task_id)) == 1
    settings = config.get_settings()
    assert not broker_holds(redis_client, settings.queue_prefix, task_id, 0)


@pytest.mark.parametrize(
    ("filters", "reason"),
    [
        ({"status": ["SOLVED"]}, MSG_STATUS),
        ({"created_to": "9999-12-31"}, MSG_DATE.format(key="created_to")),  # was OverflowError
    ],
)
def test_permanent_rejection_fails_at_once(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    caplog: pytest.LogCaptureFixture,
    filters: dict[str, object],
    reason: str,
) -> None:
    with engine.begin() as conn:  # bypasses create-time validation, as an old row would
        task_id = insert_task(conn, world, filters=filters)
    with EventLog(celery_app) as events, running_cluster(celery_app):
        row = run_to_end(engine, task_id)
        message = queueing.message_id(task_id, 0)
        wait_for(lambda: events.of_type("task-failed", message), what="task-failed")
        assert events.of_type("task-retried", message) == []
    assert (row["status"], row["attempts"], row["last_error"]) == ("FAILED", 1, reason)
    assert row["execution_id"] is None and row["result_csv"] is None
    assert AsyncResult(message, app=celery_app).state == "FAILURE"
    (failed,) = event_records(caplog, "task.failed", task_id)
    assert field(failed, "exhausted") is True and field(failed, "attempt") == 1


def test_permission_lost_before_run_is_a_rejection(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    task_id = create_export(engine, world)
    with engine.begin() as conn:
        set_role(conn, world.team_id, world.staff_id, "CUSTOMER")
    with running_cluster(celery_app):
        row = run_to_end(engine, task_id)
    assert (row["status"], row["attempts"]) == ("FAILED", 1)
    assert row["last_error"] == permissions.MSG_CREATOR_NOT_STAFF


def test_exhausted_attempts_then_manual_retry_opens_run_1(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(retry_base_delay_s=0.05)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    task_id = create_export(engine, world)

    failing = [True]

    def always_fail(**_: object) -> None:
        if failing:
            raise TimeoutError("upstream timed out")

    with (
        EventLog(app) as events,
        hooks.installed("export.after_read", always_fail),
        running_cluster(app),  # after the hook: its first scan publishes the export
    ):
        row = run_to_end(engine, task_id)
        failing.clear()
        old = queueing.message_id(task_id, 0)
        wait_for(lambda: events.of_type("task-failed", old), what="run 0 to end failed")
        assert (row["status"], row["attempts"]) == ("FAILED", 3)
        assert row["last_error"] == "The task failed after 3 attempts."
        assert AsyncResult(old, app=app).state == "FAILURE"
        assert len(events.of_type("task-retried", old)) == 2
        exhausted = [field(r, "exhausted") for r in event_records(caplog, "task.failed", task_id)]
        assert exhausted == [True]

        send_message(app, task_id, 0, "EXPORT")  # a late message of the failed run
        wait_for(lambda: len(outcomes(events, old)) == 1, what="old message to be skipped")
        assert "'outcome': 'skipped'" in outcomes(events, old)[0]
        assert task_row(engine, task_id) == row

        with engine.begin() as conn:
            assert service.retry(conn, task_id, world.staff_id) == 1
        send_message(app, task_id, 0, "EXPORT")  # another, after the retry opened run 1
        wait_for(lambda: len(outcomes(events, old)) == 2, what="old message to be skipped")
        assert "'outcome': 'skipped'" in outcomes(events, old)[1]
        row = run_to_end(engine, task_id)
    assert (row["status"], row["run"], row["attempts"], row["last_error"]) == (
        "COMPLETED",
        1,
        1,
        None,
    )
    assert row["result_csv"] == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
    assert AsyncResult(queueing.message_id(task_id, 1), app=app).state == "PENDING"  # not stored


def test_cancel_while_running_stops_at_next_write_and_reads_as_cancelled(
    engine: sa.Engine, world: World, celery_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """The execution stops at its next write, and an operator sees a cancel, not a fault:
    ``task.cancelled`` (never ``task.lease_lost``, whose counter pages someone), REVOKED
    in Flower's view (a task-revoked event, no task-succeeded) and in the result backend.
    Before, Flower showed SUCCESS ``{'outcome': 'lease_lost'}`` and the log and metric
    said lease_lost."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 20)
    task_id = create_export(engine, world)
    gate = Gate("after read")
    message = queueing.message_id(task_id, 0)
    with (
        EventLog(celery_app) as events,
        hooks.installed("export.after_read", gate.hook()),
        running_cluster(celery_app),
    ):
        try:
            gate.wait_reached()
            with engine.begin() as conn:
                service.cancel(conn, task_id, world.staff_id)
            cancelled = task_row(engine, task_id)
        finally:
            gate.release()
        wait_for(lambda: events.of_type("task-revoked", message), what="the execution to stop")
        flower_view = events.state.tasks[message].state
    assert flower_view == "REVOKED"
    assert outcomes(events, message) == []  # no task-succeeded
    assert AsyncResult(message, app=celery_app).state == "REVOKED"
    assert [field(r, "task_id") for r in event_records(caplog, "task.cancelled")] == [str(task_id)]
    assert event_records(caplog, "task.lease_lost") == []
    assert task_row(engine, task_id) == cancelled
    assert (cancelled["status"], cancelled["result_csv"], cancelled["progress"]) == (
        "CANCELLED",
        None,
        0,
    )
    assert audit_events(engine, task_id) == ["CLAIM", "CANCEL"]


TRICKY_TITLES = [
    ("Plain", '"Plain"'),
    ("Comma, inside", '"Comma, inside"'),
    ('Quote "here"', '"Quote ""here"""'),
    ("Line\nbreak", '"Line\nbreak"'),
    ("Carriage\rreturn", '"Carriage\rreturn"'),
    ("Ünïcödé ✓ 日本語", '"Ünïcödé ✓ 日本語"'),
    ("=SUM(A1:A9)", '"\'=SUM(A1:A9)"'),
    ("+1, call me", '"\'+1, call me"'),
    ("-2", '"\'-2"'),
    ("@admin", '"\'@admin"'),
    ('\t=HYPERLINK("http://x")', '"\'\t=HYPERLINK(""http://x"")"'),
    ("\r=cmd|' /C calc'!A0", "\"'\r=cmd|' /C calc'!A0\""),
    ("\tindented", '"\'\tindented"'),
    ("", '""'),
]


def test_csv_body_is_exact(engine: sa.Engine, world: World, celery_app: Celery) -> None:
    base = datetime(2026, 3, 1, 12, 0, 0, 987654, tzinfo=UTC)
    ids = []
    with engine.begin() as conn:
        for i, (title, _) in enumerate(TRICKY_TITLES):
            created = base.replace(minute=i)
            ids.append(
                add_ticket(
                    conn,
                    world.team_id,
                    world.customer_id,
                    title,
                    status="PENDING",
                    priority="HIGH",
                    assignee_id=world.staff_id if i % 2 else None,
                    created_at=created,
                    due_at=datetime(2026, 4, 1, 23, 59, 59, tzinfo=UTC) if i == 0 else None,
                )
            )
    task_id = create_export(engine, world)
    with running_cluster(celery_app):
        row = run_to_end(engine, task_id)
    lines = ["id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at"]
    for i, (_, cell) in enumerate(TRICKY_TITLES):
        assignee = f'"{world.staff_id}"' if i % 2 else ""  # NULL: empty, unquoted
        due = '"2026-04-01T23:59:59Z"' if i == 0 else ""
        stamp = f'"2026-03-01T12:{i:02d}:00Z"'
        lines.append(
            f'"{ids[i]}",{cell},"PENDING","HIGH","{world.customer_id}",{assignee},{due},'
            f"{stamp},{stamp}"
        )
    assert row["result_csv"] == "\n".join(lines) + "\n"
    assert row["result_csv"] == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
    assert row["result_summary"] == f"{len(TRICKY_TITLES)} rows"


def test_rows_with_equal_created_at_are_ordered_by_id(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    app = make_app(export_batch_size=2)
    same = datetime(2026, 2, 2, 8, 0, tzinfo=UTC)
    with engine.begin() as conn:
        ids = [
            add_ticket(conn, world.team_id, world.customer_id, f"same {i}", created_at=same)
            for i in range(5)
        ]
    task_id = create_export(engine, world)
    with running_cluster(app):
        row = run_to_end(engine, task_id)
    got = [line.split(",")[0].strip('"') for line in str(row["result_csv"]).splitlines()[1:]]
    assert got == [str(i) for i in sorted(ids)]


@pytest.mark.parametrize(
    ("scope", "filters"),
    [
        ("TEAM", {"status": ["OPEN", "PENDING"]}),
        ("TEAM", {"priority": ["URGENT"], "q": "DISK"}),
        ("TEAM", {"created_from": "2026-01-05", "created_to": "2026-01-05"}),
        ("MINE", {}),
        ("TEAM", {"assignee_id": "00000000-0000-0000-0000-000000000000"}),
    ],
)
def test_filters_match_the_reference(
    engine: sa.Engine, world: World, celery_app: Celery, scope: str, filters: dict[str, object]
) -> None:
    statuses = ["OPEN", "PENDING", "RESOLVED", "CLOSED"]
    with engine.begin() as conn:
        for i in range(40):
            add_ticket(
                conn,
                world.team_id,
                world.customer_id if i % 3 else world.staff_id,
                f"{'Disk full' if i % 4 == 0 else 'Mail'} #{i}",
                status=statuses[i % 4],
                priority="URGENT" if i % 5 == 0 else "LOW",
                assignee_id=world.staff_id if i % 7 == 0 else None,
                created_at=datetime(2026, 1, 3 + i % 5, 23, 30, tzinfo=UTC),
            )
    task_id = create_export(engine, world, filters, scope)
    with running_cluster(celery_app):
        row = run_to_end(engine, task_id)
    expected = expected_csv(engine, world.team_id, world.staff_id, scope, filters)
    assert row["status"] == "COMPLETED" and row["result_csv"] == expected
    assert row["result_summary"] == f"{len(expected.splitlines()) - 1} rows"


def test_filters_matching_nothing_give_a_header_only_csv(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 5)
    task_id = create_export(engine, world, {"q": "no such title"})
    with running_cluster(celery_app):
        row = run_to_end(engine, task_id)
    assert (row["status"], row["result_summary"], row["progress"]) == ("COMPLETED", "0 rows", 100)
    assert row["result_csv"] == (
        "id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at\n"
    )


def test_over_the_row_limit_fails_with_the_fixed_message(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    app = make_app(export_max_rows=5)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 6)
    task_id = create_export(engine, world)
    with running_cluster(app):
        row = run_to_end(engine, task_id)
    assert (row["status"], row["attempts"], row["result_csv"]) == ("FAILED", 1, None)
    assert row["last_error"] == "The export matches more than 5 tickets; narrow the filters."


@pytest.mark.parametrize(
    ("case", "summary"),
    [
        ("resolved", "skipped: the ticket is resolved"),
        ("closed", "skipped: the ticket is closed"),
        ("unassigned", "skipped: the ticket has no assignee"),
        ("assignee_left", "skipped: the assignee left the team"),
    ],
)
def test_reminder_with_nothing_to_do_completes_without_side_effects(
    engine: sa.Engine, world: World, celery_app: Celery, case: str, summary: str
) -> None:
    status = {"resolved": "RESOLVED", "closed": "CLOSED"}.get(case, "OPEN")
    assignee = None if case == "unassigned" else world.staff2_id
    with engine.begin() as conn:
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Invoice", status=status, assignee_id=assignee
        )
        task_id = service.create_reminder(conn, world.team_id, world.staff_id, ticket)
        if case == "assignee_left":
            set_role(conn, world.team_id, world.staff2_id, None)
    before = side_effects(engine, ticket)
    with running_cluster(celery_app):
        row = run_to_end(engine, task_id)
    assert (row["status"], row["result_summary"], row["progress"]) == ("COMPLETED", summary, 100)
    assert side_effects(engine, ticket) == before
    with engine.connect() as conn:
        view = service.get_task(conn, task_id, world.staff_id).as_dict()
    assert (view["status"], view["skipped"]) == ("COMPLETED", True)  # visible as skipped


def test_a_claim_that_fails_never_strands_the_run(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The database drops while a message is being claimed: nothing is written, the message
    ends (RETRY) and leaves the broker, so the dispatcher's scan finds the published run's
    message missing and publishes it again."""
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    app = make_app(scan_interval_s=0.3)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    task_id = create_export(engine, world)
    message = queueing.message_id(task_id, 0)
    failures: list[int] = []

    def drop_once(**_: object) -> None:
        if not failures:
            failures.append(1)
            raise ConnectionError("server closed the connection unexpectedly")

    with (
        EventLog(app) as events,
        hooks.installed("task.before_claim", drop_once),
        running_cluster(app) as loop,
    ):
        row = run_to_end(engine, task_id)
        wait_for(lambda: events.of_type("task-succeeded", message), what="task-succeeded")
        assert len(events.of_type("task-retried", message)) == 1
        redispatched = loop.last_scan
    assert failures == [1]
    assert (row["status"], row["run"], row["attempts"], row["result_summary"]) == (
        "COMPLETED",
        0,
        1,
        "3 rows",
    )
    assert redispatched is not None
    with engine.connect() as conn:
        events_of_task = (
            conn.execute(
                sa.text("SELECT event FROM task_audit WHERE task_id = :t ORDER BY id"),
                {"t": task_id},
            )
            .scalars()
            .all()
        )
    assert events_of_task == ["CLAIM", "COMPLETE"]
    (attempt_failed,) = event_records(caplog, "task.attempt_failed", task_id)
    assert (field(attempt_failed, "stage"), field(attempt_failed, "error")) == (
        "claim",
        "ConnectionError",
    )
    settings = config.get_settings()
    assert not broker_holds(redis_client, settings.queue_prefix, task_id, 0)


def test_a_claim_failing_for_a_lasting_cause_fails_its_attempt_and_the_run_recovers(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A claim whose prepared statement is missing on its session (SQLSTATE 26000) is not
    "the database is unreachable": it would fail the same way at every delivery, forever.
    It fails the attempt with the cause named, and the connection forgets its prepared
    set, so the next attempt prepares again and completes."""
    app = make_app(retry_base_delay_s=0.05, scan_interval_s=0.3)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    task_id = create_export(engine, world)
    message = queueing.message_id(task_id, 0)
    # The executions' pool holds one idle connection whose set says the claim is prepared
    # on its session, which never saw it: what a pooler in transaction mode leaves when it
    # hands the next transaction another server session.
    with db.get_execution_engine().connect() as conn:
        conn.exec_driver_sql("SELECT 1")
        stale = conn.connection.info.setdefault(db.PREPARED_KEY, set())
        stale.add(prepared.statement_name(lease.CLAIM))
    with EventLog(app) as events, running_cluster(app):
        row = run_to_end(engine, task_id)
        wait_for(lambda: events.of_type("task-succeeded", message), what="task-succeeded")
        assert len(events.of_type("task-retried", message)) == 1
    assert (row["status"], row["attempts"], row["result_summary"]) == ("COMPLETED", 2, "3 rows")
    assert audit_events(engine, task_id) == ["WAIT", "CLAIM", "COMPLETE"]
    (refused,) = event_records(caplog, "task.attempt_failed", task_id)
    assert (field(refused, "stage"), field(refused, "error"), field(refused, "attempt")) == (
        "claim",
        "InvalidSqlStatementName",
        1,
    )
    assert str(field(refused, "reason")).startswith('prepared statement "td_prep_')
    assert event_records(caplog, "task.failed", task_id) == []


def test_a_claim_that_fails_the_same_way_every_time_ends_the_run_failed(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DATABASE_PREPARED_STATEMENTS=on where every transaction may land on another server
    session: every claim misses its prepared statement. Before, each delivery ended as
    "the ledger was unreachable" and the run was published again, forever; now each is a
    failed attempt and the run ends FAILED after MAX_TASK_ATTEMPTS, saying why."""
    app = make_app(retry_base_delay_s=0.05, scan_interval_s=0.3)
    task_id = create_export(engine, world)
    message = queueing.message_id(task_id, 0)
    claim_name = prepared.statement_name(lease.CLAIM)

    def another_session(
        _dbapi: object, record: sa.pool.ConnectionPoolEntry, _proxy: object
    ) -> None:
        record.info.setdefault(db.PREPARED_KEY, set()).add(claim_name)

    executions = db.get_execution_engine()
    sa.event.listen(executions, "checkout", another_session)
    try:
        with EventLog(app) as events, running_cluster(app):
            row = run_to_end(engine, task_id)
            wait_for(lambda: events.of_type("task-failed", message), what="task-failed")
            assert len(events.of_type("task-retried", message)) == 2
    finally:
        sa.event.remove(executions, "checkout", another_session)
    assert (row["status"], row["attempts"], row["execution_id"]) == ("FAILED", 3, None)
    assert row["last_error"] == (
        f'The task could not be started after 3 attempts: prepared statement "{claim_name}" '
        "does not exist."
    )
    assert audit_events(engine, task_id) == ["WAIT", "WAIT", "FAIL"]
    assert [field(e, "attempt") for e in event_records(caplog, "task.attempt_failed", task_id)] == [
        1,
        2,
    ]
    (failed,) = event_records(caplog, "task.failed", task_id)
    assert (field(failed, "stage"), field(failed, "exhausted")) == ("claim", True)
    stored = AsyncResult(message, app=app)
    assert stored.state == "FAILURE" and "after 3 attempts" in str(stored.result)
