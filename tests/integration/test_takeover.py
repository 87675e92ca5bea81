"""Takeovers at the code's gate points: an old execution A, paused by a gate, cannot
commit after a new execution B (or the dispatcher, or a failure) took the run over.

Both executions are real deliveries of the same message id to a real in-process worker
(threads pool, two slots); B is a duplicate delivered once A's row is silent past
STALE_AFTER_S by the database's clock (the staleness rule: the one way a delivery takes a
RUNNING row over). Gates order everything; each test ends by delivering the message once more to
show a completed task gains nothing. A plain duplicate while A runs takes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from celery import Celery

from harness.factories import World, add_ticket, add_tickets, age_task, audit_events, task_row
from harness.waiting import wait_for
from ledger import dispatch, lease, service
from ledger.errors import PermissionLost
from tasks import queueing
from tasks.names import EXPORT_TASK, PROGRESS_EVENT, QUEUE_OF
from teamdesk import hooks
from tests.support.dispatching import running_cluster
from tests.support.gates import Gate
from tests.support.queues import publish_stamped, resend_stamped, send_message
from tests.support.scenario import event_records, outcomes, side_effects
from tests.support.workers import EventLog, running_worker


def nth_claim(n: int) -> tuple[list[uuid.UUID], Callable[..., bool]]:
    """Records every claim's execution id; the predicate is true for the n-th claim."""
    seen: list[uuid.UUID] = []

    def predicate(claim: object, **_: object) -> bool:
        seen.append(claim.lease.execution_id)  # type: ignore[attr-defined]
        return len(seen) == n

    return seen, predicate


def export_task(engine: sa.Engine, world: World, rows: int = 1200) -> uuid.UUID:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, rows)
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def rename_first_ticket(engine: sa.Engine, world: World, title: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE tickets SET title = :t WHERE team_id = :team AND title = 'Ticket 1'"),
            {"t": title, "team": world.team_id},
        )


def deliver_again_and_check_nothing_changes(
    engine: sa.Engine,
    app: Celery,
    events: EventLog,
    task_id: uuid.UUID,
    kind: str,
    delivered: int = 2,
) -> None:
    """``delivered``: how many deliveries of the message ran before this one."""
    before = task_row(engine, task_id)
    message = queueing.message_id(task_id, 0)
    wait_for(lambda: len(outcomes(events, message)) == delivered, what="earlier outcomes")
    ended = delivered
    send_message(app, task_id, 0, kind)
    wait_for(lambda: len(outcomes(events, message)) == ended + 1, what="redelivery to end")
    assert "'outcome': 'skipped'" in outcomes(events, message)[-1]
    assert task_row(engine, task_id) == before


@pytest.mark.parametrize("pause_at", ["export.after_read", "export.before_result_write"])
def test_export_takeover_old_execution_cannot_commit(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    pause_at: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    task_id = export_task(engine, world)
    message = queueing.message_id(task_id, 0)
    gate_a, gate_b = Gate("A paused"), Gate("B claimed")
    claims, second = nth_claim(2)
    with (
        EventLog(celery_app) as events,
        running_worker(celery_app),
        hooks.installed("task.claimed", gate_b.hook(when=second)),
        hooks.installed(pause_at, gate_a.hook()),
    ):
        try:
            send_message(celery_app, task_id, 0, "EXPORT")
            gate_a.wait_reached()
            # A parked before its first progress, or after all three batches (the last
            # batch's progress goes to the ledger only).
            a_progress = 0 if pause_at == "export.after_read" else 2
            wait_for(
                lambda: len(events.of_type(PROGRESS_EVENT, message)) == a_progress,
                what="A's progress events",
            )
            age_task(engine, task_id, 3600)  # A is silent past STALE_AFTER_S
            send_message(celery_app, task_id, 0, "EXPORT")
            gate_b.wait_reached()
            snapshot = task_row(engine, task_id)
            assert snapshot["status"] == "RUNNING" and snapshot["execution_id"] == claims[1]
            assert claims[0] != claims[1]
            rename_first_ticket(engine, world, "Renamed before B read")
            gate_a.release()
            wait_for(lambda: outcomes(events, message), what="A to return")
            assert "'outcome': 'lease_lost'" in outcomes(events, message)[0]
            assert task_row(engine, task_id) == snapshot
            assert len(events.of_type(PROGRESS_EVENT, message)) == a_progress
        finally:
            gate_a.release()
            gate_b.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="B to finish")
        row = task_row(engine, task_id)
        assert (row["progress"], row["attempts"], row["execution_id"]) == (100, 1, None)
        assert "Renamed before B read" in row["result_csv"]
        assert ',"Ticket 1",' not in row["result_csv"]
        assert row["result_summary"] == "1200 rows"
        b_progress = [e["percent"] for e in events.of_type(PROGRESS_EVENT, message)]
        assert 100 not in b_progress
        assert b_progress[a_progress:] == [41, 83]
        assert len(event_records(caplog, "task.lease_lost", task_id)) == 1
        deliver_again_and_check_nothing_changes(engine, celery_app, events, task_id, "EXPORT")


@pytest.mark.parametrize(
    "late_error", [PermissionLost("late rejection"), ConnectionError("network went away")]
)
def test_late_error_of_old_execution_changes_nothing(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    late_error: Exception,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(retry_base_delay_s=0.05)
    task_id = export_task(engine, world)
    message = queueing.message_id(task_id, 0)
    gate_a, gate_b = Gate("A paused"), Gate("B claimed")
    claims, second = nth_claim(2)

    def fail_late(**_: object) -> None:
        raise late_error

    with (
        EventLog(app) as events,
        running_worker(app),
        hooks.installed("task.claimed", gate_b.hook(when=second)),
        hooks.installed("export.after_read", gate_a.hook(then=fail_late)),
    ):
        try:
            send_message(app, task_id, 0, "EXPORT")
            gate_a.wait_reached()
            age_task(engine, task_id, 3600)  # A is silent past STALE_AFTER_S
            send_message(app, task_id, 0, "EXPORT")
            gate_b.wait_reached()
            snapshot = task_row(engine, task_id)
            gate_a.release()
            wait_for(lambda: outcomes(events, message), what="A to return")
            assert "'outcome': 'lease_lost'" in outcomes(events, message)[0]
            assert task_row(engine, task_id) == snapshot
            assert events.of_type("task-retried", message) == []
            assert events.of_type("task-failed", message) == []
        finally:
            gate_a.release()
            gate_b.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="B to finish")
        row = task_row(engine, task_id)
        assert (row["attempts"], row["last_error"], row["execution_id"]) == (1, None, None)
        assert row["execution_id"] is None and claims[1] != claims[0]
        assert event_records(caplog, "task.failed", task_id) == []
        assert event_records(caplog, "task.attempt_failed", task_id) == []
        deliver_again_and_check_nothing_changes(engine, app, events, task_id, "EXPORT")


def reminder_task(engine: sa.Engine, world: World) -> tuple[uuid.UUID, uuid.UUID]:
    with engine.begin() as conn:
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Printer on fire", assignee_id=world.staff2_id
        )
        task_id = service.create_reminder(conn, world.team_id, world.staff_id, ticket)
    return task_id, ticket


def test_reminder_takeover_by_new_claim_rolls_old_transaction_back(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    task_id, ticket = reminder_task(engine, world)
    message = queueing.message_id(task_id, 0)
    before = side_effects(engine, ticket)
    gate_a, gate_b = Gate("A read its lease"), Gate("B claimed")
    _, second = nth_claim(2)
    with (
        EventLog(celery_app) as events,
        running_worker(celery_app),
        hooks.installed("task.claimed", gate_b.hook(when=second)),
        hooks.installed("reminder.after_lease_read", gate_a.hook()),
    ):
        try:
            send_message(celery_app, task_id, 0, "REMINDER")
            gate_a.wait_reached()
            age_task(engine, task_id, 3600)  # A is silent past STALE_AFTER_S
            send_message(celery_app, task_id, 0, "REMINDER")
            gate_b.wait_reached()
            snapshot = task_row(engine, task_id)
            gate_a.release()
            wait_for(lambda: outcomes(events, message), what="A to return")
            assert "'outcome': 'lease_lost'" in outcomes(events, message)[0]
            assert side_effects(engine, ticket) == before
            assert task_row(engine, task_id) == snapshot
        finally:
            gate_a.release()
            gate_b.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="B to finish")
        after = side_effects(engine, ticket)
        assert (after.notifications, after.events, after.version) == (1, 1, before.version + 1)
        row = task_row(engine, task_id)
        assert row["result_summary"] == f"reminder sent to {world.staff2_id}"
        assert (row["progress"], row["execution_id"]) == (100, None)
        deliver_again_and_check_nothing_changes(engine, celery_app, events, task_id, "REMINDER")
    assert side_effects(engine, ticket) == after


def test_reminder_lease_cleared_by_dispatcher_rolls_old_transaction_back(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    task_id, ticket = reminder_task(engine, world)
    message = queueing.message_id(task_id, 0)
    before = side_effects(engine, ticket)
    gate_a = Gate("A read its lease")
    with (
        EventLog(celery_app) as events,
        running_worker(celery_app),
        hooks.installed("reminder.after_lease_read", gate_a.hook()),
    ):
        try:
            send_message(celery_app, task_id, 0, "REMINDER")
            gate_a.wait_reached()
            age_task(engine, task_id, 3600)
            with engine.begin() as conn:
                recovered = lease.recover_stale(
                    conn,
                    stale_after_s=120,
                    live_members=[],
                    use_heartbeats=False,
                    holders_seen_at=dispatch.database_now(conn),
                    max_recoveries=2,
                    batch=10,
                )
            assert [(r.task_id, r.status) for r in recovered] == [(task_id, "WAITING")]
            snapshot = task_row(engine, task_id)
            assert (snapshot["execution_id"], snapshot["recoveries"]) == (None, 1)
            gate_a.release()
            wait_for(lambda: outcomes(events, message), what="A to return")
            assert "'outcome': 'lease_lost'" in outcomes(events, message)[0]
            assert side_effects(engine, ticket) == before
            assert task_row(engine, task_id) == snapshot
        finally:
            gate_a.release()
        send_message(celery_app, task_id, 0, "REMINDER")
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="redelivery")
        after = side_effects(engine, ticket)
        assert (after.notifications, after.events, after.version) == (1, 1, before.version + 1)
        deliver_again_and_check_nothing_changes(engine, celery_app, events, task_id, "REMINDER")
    assert side_effects(engine, ticket) == after


def test_reminder_failure_after_event_insert_rolls_back_and_second_attempt_is_the_only_result(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    app = make_app(retry_base_delay_s=0.1)
    task_id, ticket = reminder_task(engine, world)
    before = side_effects(engine, ticket)
    failures: list[int] = []

    def fail_once(**_: object) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("connection reset after INSERT")

    gate_retry = Gate("second attempt claimed")
    _, second = nth_claim(2)
    with (
        EventLog(app) as events,
        hooks.installed("reminder.after_event_insert", fail_once),
        hooks.installed("task.claimed", gate_retry.hook(when=second)),
        running_cluster(app),  # after the hooks: its first scan publishes the reminder
    ):
        try:
            gate_retry.wait_reached()
            assert side_effects(engine, ticket) == before
            row = task_row(engine, task_id)
            assert (row["status"], row["attempts"]) == ("RUNNING", 2)
            assert row["last_error"] == "The task hit a temporary error and will be retried."
        finally:
            gate_retry.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="attempt 2")
        after = side_effects(engine, ticket)
        assert (after.notifications, after.events, after.version) == (1, 1, before.version + 1)
        row = task_row(engine, task_id)
        assert (row["attempts"], row["last_error"], row["progress"]) == (2, None, 100)
        deliver_again_and_check_nothing_changes(
            engine, app, events, task_id, "REMINDER", delivered=1
        )
    assert side_effects(engine, ticket) == after


def test_an_old_message_of_a_recovered_run_cannot_take_over_its_replacement(
    engine: sa.Engine, world: World, celery_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """A's execution goes silent and the dispatcher takes the run back and publishes it
    again (a new stamp); B claims that publish. A's original message is then delivered
    once more (kombu restoring it, say): it claims nothing, B is never interrupted, and
    B's result is the only one."""
    task_id = export_task(engine, world)
    message = queueing.message_id(task_id, 0)
    gate_a, gate_b = Gate("A paused"), Gate("B claimed")
    claims, second = nth_claim(2)
    with (
        EventLog(celery_app) as events,
        running_worker(celery_app, concurrency=3),
        hooks.installed("task.claimed", gate_b.hook(when=second)),
        hooks.installed("export.after_read", gate_a.hook()),
    ):
        try:
            first = publish_stamped(engine, celery_app, task_id, 0)
            gate_a.wait_reached()
            age_task(engine, task_id, 3600)
            with engine.begin() as conn:
                recovered = lease.recover_stale(
                    conn,
                    stale_after_s=120,
                    live_members=[],
                    use_heartbeats=False,
                    holders_seen_at=dispatch.database_now(conn),
                    max_recoveries=2,
                    batch=10,
                )
            assert [(r.task_id, r.status) for r in recovered] == [(task_id, "WAITING")]
            replacement = publish_stamped(engine, celery_app, task_id, 0)
            assert replacement > first
            gate_b.wait_reached()
            resend_stamped(celery_app, task_id, 0, first)
            wait_for(lambda: outcomes(events, message), what="the old message to end")
            assert "'outcome': 'skipped'" in outcomes(events, message)[0]
            snapshot = task_row(engine, task_id)
            assert (snapshot["status"], snapshot["execution_id"]) == ("RUNNING", claims[1])
            gate_a.release()
            wait_for(lambda: len(outcomes(events, message)) == 2, what="A to return")
            assert "'outcome': 'lease_lost'" in outcomes(events, message)[1]
        finally:
            gate_a.release()
            gate_b.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="B to finish")
    row = task_row(engine, task_id)
    assert (row["result_summary"], row["attempts"], row["recoveries"]) == ("1200 rows", 1, 1)
    with engine.connect() as conn:
        trail = conn.execute(
            sa.text("SELECT event, execution_id FROM task_audit WHERE task_id = :t ORDER BY id"),
            {"t": task_id},
        ).all()
    assert [(e, x) for e, x in trail] == [
        ("CLAIM", claims[0]),
        ("RECOVER", claims[0]),
        ("CLAIM", claims[1]),
        ("COMPLETE", claims[1]),
    ]
    assert len(claims) == 2  # the old message claimed nothing
    assert len(event_records(caplog, "task.skipped", task_id)) == 1


def test_a_duplicate_delivery_while_the_execution_runs_takes_nothing(
    engine: sa.Engine, world: World, celery_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """kombu restores a worker's unacknowledged message after a broker reconnect while the
    worker goes on running it: the second delivery of the same publish is skipped and
    acknowledged, and A - never interrupted - completes the run as its only execution."""
    task_id = export_task(engine, world)
    message = queueing.message_id(task_id, 0)
    gate_a = Gate("A paused")
    with (
        EventLog(celery_app) as events,
        running_worker(celery_app),
        hooks.installed("export.after_read", gate_a.hook()),
    ):
        try:
            send_message(celery_app, task_id, 0, "EXPORT")
            gate_a.wait_reached()
            snapshot = task_row(engine, task_id)
            send_message(celery_app, task_id, 0, "EXPORT")
            wait_for(lambda: outcomes(events, message), what="the duplicate to end")
            assert "'outcome': 'skipped'" in outcomes(events, message)[0]
            assert "held by a live execution" in outcomes(events, message)[0]
            assert task_row(engine, task_id) == snapshot
        finally:
            gate_a.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="A to finish")
    row = task_row(engine, task_id)
    assert (row["attempts"], row["result_summary"]) == (1, "1200 rows")
    assert row["execution_id"] is None
    with engine.connect() as conn:
        claims = conn.execute(
            sa.text("SELECT count(*) FROM task_audit WHERE task_id = :t AND event = 'CLAIM'"),
            {"t": task_id},
        ).scalar_one()
    assert claims == 1
    assert not event_records(caplog, "task.lease_lost", task_id)
    skipped = event_records(caplog, "task.skipped", task_id)
    assert [r.reason for r in skipped] == ["the run is held by a live execution"]  # type: ignore[attr-defined]


def test_a_message_shaped_like_celerys_resend_takes_nothing_from_a_live_execution(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    """A message with ``retries`` 1 that kombu did not flag redelivered is what Celery's
    re-send after a lost pool process looked like, and the claim took the row over on that
    alone; a Sentinel failover can lose the flag on a mere redelivery of a live
    execution's message. Now only the staleness rule takes a RUNNING row over: the
    message is skipped and A completes."""
    task_id = export_task(engine, world)
    message = queueing.message_id(task_id, 0)
    gate_a = Gate("A paused")
    with (
        EventLog(celery_app) as events,
        running_worker(celery_app),
        hooks.installed("export.after_read", gate_a.hook()),
    ):
        try:
            send_message(celery_app, task_id, 0, "EXPORT")
            gate_a.wait_reached()
            held = task_row(engine, task_id)
            stamp = held["dispatched_at"]
            args = [str(task_id), 0, stamp.isoformat()]
            resend = celery_app.amqp.create_task_message(
                message, EXPORT_TASK, args, {}, retries=1, create_sent_event=False
            )
            with celery_app.producer_or_acquire() as producer:
                celery_app.amqp.send_task_message(
                    producer, EXPORT_TASK, resend, queue=QUEUE_OF[EXPORT_TASK]
                )
            wait_for(lambda: outcomes(events, message), what="the re-send to end")
            assert "'outcome': 'skipped'" in outcomes(events, message)[0]
            assert task_row(engine, task_id) == held
        finally:
            gate_a.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="A to finish")
    row = task_row(engine, task_id)
    assert (row["attempts"], row["result_summary"]) == (1, "1200 rows")
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
