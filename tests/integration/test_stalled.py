"""Stalled executions with real workers: a stalled execution is taken over, a late
failure callback cannot erase the new lease (nor can an old FAILURE in the result
backend fail the recovered run), and a run that keeps stalling ends FAILED.

(The other two real-worker scenarios of that bullet, a transient failure retried once
after its backoff and a permanent rejection failing at once, are in
test_worker_outcomes.py.) Shortened timings come only from configuration variables.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from dispatcher.scan import run_once
from harness.csv_reference import expected_csv
from harness.factories import World, add_ticket, add_tickets, age_task, task_row
from harness.processes import Proc, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from tasks import queueing
from teamdesk import config, hooks
from tests.support.gates import Gate
from tests.support.queues import broker_holds, send_message
from tests.support.scenario import outcomes, side_effects
from tests.support.workers import EventLog, running_worker

PAUSE_AT = {"EXPORT": "export.after_read", "REMINDER": "reminder.after_lease_read"}


def create(engine: sa.Engine, world: World, kind: str) -> tuple[uuid.UUID, uuid.UUID | None]:
    with engine.begin() as conn:
        if kind == "EXPORT":
            add_tickets(conn, world.team_id, world.customer_id, 700)
            return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {}), None
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Call back", assignee_id=world.staff2_id
        )
        return service.create_reminder(conn, world.team_id, world.staff_id, ticket), ticket


def raise_late_read_error(**_: object) -> None:
    raise ConnectionError("read failed after a long pause")


def broker_state(client: redis.Redis, prefix: str, queue: str) -> tuple[int, int]:
    return int(client.hlen(f"{prefix}:unacked")), int(client.llen(f"{prefix}:{queue}"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["EXPORT", "REMINDER"])
def test_stalled_execution_is_taken_over_and_its_late_error_writes_nothing(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    tmp_path: Path,
    kind: str,
) -> None:
    """A stalls (parked at a gate) and its lease goes silent past STALE_AFTER_S; the
    dispatcher's scan takes the run back and publishes it again; worker B claims E2. A
    then resumes with a read error: its failure report matches no row."""
    app = make_app()
    settings = config.get_settings()
    prefix, queue = settings.queue_prefix, "exports" if kind == "EXPORT" else "reminders"
    task_id, ticket = create(engine, world, kind)
    message = queueing.message_id(task_id, 0)
    before = side_effects(engine, ticket) if ticket else None
    gate_a = Gate("A stalled")
    gate_b = RemoteGate(redis_client, prefix, "task.claimed")
    b_env = settings_env(
        settings,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES="task.claimed",
    )
    with (
        cluster(tmp_path) as procs,
        EventLog(app) as events,
        hooks.installed(PAUSE_AT[kind], gate_a.hook(then=raise_late_read_error)),
        running_worker(app, concurrency=1),
    ):
        try:
            assert run_once(app).dispatched == 1
            gate_a.wait_reached()
            e1 = gate_a.context["claim"].lease.execution_id
            worker_b = Proc("b", worker_argv("b", concurrency=1), b_env, tmp_path).start()
            procs.append(worker_b)
            worker_b.wait_event("worker.started", timeout=60)
            age_task(engine, task_id, 600)
            counts = run_once(app)
            assert (counts.recovered, counts.dispatched) == (1, 1)
            e2 = uuid.UUID(gate_b.wait_reached(timeout=60)["execution_id"])
            assert e2 != e1
            snapshot = task_row(engine, task_id)
            assert (snapshot["status"], snapshot["execution_id"]) == ("RUNNING", e2)
            assert snapshot["recoveries"] == 1
            assert broker_state(redis_client, prefix, queue) == (2, 0)  # A's and B's messages
            gate_a.release()
            wait_for(lambda: outcomes(events, message), what="A to return")
            assert "'outcome': 'lease_lost'" in outcomes(events, message)[0]
            assert task_row(engine, task_id) == snapshot
            if ticket:
                assert side_effects(engine, ticket) == before
        finally:
            gate_a.release()
            gate_b.release(times=3)
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="B to finish")
        done = task_row(engine, task_id)
        assert (done["attempts"], done["progress"], done["execution_id"]) == (1, 100, None)
        # B logs task.completed just after its completion committed: wait for the line.
        finished = wait_for(
            lambda: [e for e in worker_b.events("task.completed") if e["task_id"] == str(task_id)],
            what="B's task.completed",
        )
        assert [e["execution"] for e in finished] == [str(e2)[:8]]
        wait_for(
            lambda: broker_state(redis_client, prefix, queue) == (0, 0), what="both acknowledged"
        )
        assert AsyncResult(message, app=app).state == "PENDING"  # successes are not stored
        assert not broker_holds(redis_client, prefix, task_id, 0)
        if ticket:
            after = side_effects(engine, ticket)
            assert before is not None
            assert (after.notifications, after.events, after.version) == (1, 1, before.version + 1)
        else:
            assert done["result_csv"] == expected_csv(
                engine, world.team_id, world.staff_id, "TEAM", {}
            )
            assert done["result_summary"] == "700 rows" and done["expires_at"] is not None
        send_message(app, task_id, 0, kind)  # once more: a completed task gains nothing
        wait_for(
            lambda: any("'outcome': 'skipped'" in o for o in outcomes(events, message)),
            what="the extra delivery to be skipped",
        )
    assert task_row(engine, task_id) == done
    if ticket:
        assert side_effects(engine, ticket) == after


LEGACY_CALLBACK = sa.text("""
    UPDATE background_tasks SET status = 'FAILED', execution_id = NULL,
           last_error = 'failed in the queue'
     WHERE id = :id AND run = :run AND status IN ('RUNNING', 'WAITING')""")


@pytest.mark.parametrize(
    "callback_writes_ledger", [False, True], ids=["callback-only-logs", "legacy-callback-writes"]
)
def test_late_failure_callback_cannot_erase_the_new_lease(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery], callback_writes_ledger: bool
) -> None:
    """A's read fails on its only attempt and its failure report fails too, so the queue
    ends the message FAILURE while the row stays RUNNING/E1. The failure callback is
    parked. The dispatcher recovers the run - the message's FAILURE in the result backend
    does not fail it (the queue's states are never read back) - and B claims E2 from the
    same message id. Then the old callback runs. The second parameter replays what a
    callback that writes the ledger (by task id and run, with no lease) would do: it
    erases E2 - which is what this test detects."""
    app = make_app(max_task_attempts=1)
    task_id, _ = create(engine, world, "EXPORT")
    message = queueing.message_id(task_id, 0)
    failed_reads: list[int] = []

    def first_read_fails(**_: object) -> None:
        if not failed_reads:
            failed_reads.append(1)
            raise ConnectionError("read failed")

    report_failures: list[int] = []

    def failure_report_fails_once(**_: object) -> None:
        if not report_failures:
            report_failures.append(1)
            raise ConnectionError("ledger unreachable for a moment")

    def legacy_write(**_: object) -> None:
        with engine.begin() as conn:
            conn.execute(LEGACY_CALLBACK, {"id": task_id, "run": 0})

    callback = Gate("failure callback")
    gate_b = Gate("B claimed")
    claims: list[uuid.UUID] = []

    def second_claim(claim: object, **_: object) -> bool:
        claims.append(claim.lease.execution_id)  # type: ignore[attr-defined]
        return len(claims) == 2

    with (
        EventLog(app) as events,
        running_worker(app, concurrency=2),
        hooks.installed("export.after_read", first_read_fails),
        hooks.installed("task.before_failure_report", failure_report_fails_once),
        hooks.installed(
            "queue.failure_callback",
            callback.hook(then=legacy_write if callback_writes_ledger else None),
        ),
        hooks.installed("task.claimed", gate_b.hook(when=second_claim)),
    ):
        try:
            assert run_once(app).dispatched == 1
            callback.wait_reached()
            stuck = task_row(engine, task_id)
            assert (stuck["status"], stuck["execution_id"]) == ("RUNNING", claims[0])
            assert AsyncResult(message, app=app).state == "FAILURE"
            age_task(engine, task_id, 600)
            counts = run_once(app)
            assert (counts.recovered, counts.dispatched) == (1, 1)
            gate_b.wait_reached()
            taken = task_row(engine, task_id)
            assert (taken["status"], taken["execution_id"], taken["recoveries"]) == (
                "RUNNING",
                claims[1],
                1,
            )
            callback.release()
            wait_for(lambda: events.of_type("task-failed", message), what="the callback")
            after_callback = task_row(engine, task_id)
        finally:
            callback.release()
            gate_b.release()
        e2_survived = after_callback == taken
        if callback_writes_ledger:
            assert not e2_survived and after_callback["status"] == "FAILED"
            assert after_callback["execution_id"] is None
            wait_for(lambda: len(outcomes(events, message)) == 1, what="B to return")
            assert "'outcome': 'lease_lost'" in outcomes(events, message)[0]
            assert task_row(engine, task_id)["status"] == "FAILED"
            return
        assert e2_survived
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="B to finish")
    row = task_row(engine, task_id)
    assert (row["attempts"], row["recoveries"], row["result_summary"]) == (1, 1, "700 rows")


def test_run_that_keeps_stalling_ends_failed_through_two_scans(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    app = make_app(max_recoveries=1)
    task_id, _ = create(engine, world, "EXPORT")
    message = queueing.message_id(task_id, 0)
    reads: list[uuid.UUID] = []

    def nth_read(n: int) -> Callable[..., bool]:
        def predicate(claim: object, **_: object) -> bool:
            execution = claim.lease.execution_id  # type: ignore[attr-defined]
            if execution not in reads:
                reads.append(execution)
            return reads.index(execution) == n - 1

        return predicate

    gate_a, gate_b = Gate("A stalls"), Gate("B stalls")
    with (
        EventLog(app) as events,
        running_worker(app, concurrency=2),
        hooks.installed("export.after_read", gate_a.hook(when=nth_read(1))),
        hooks.installed("export.after_read", gate_b.hook(when=nth_read(2))),
    ):
        try:
            assert run_once(app).dispatched == 1
            gate_a.wait_reached()
            age_task(engine, task_id, 600)
            first = run_once(app)
            assert (first.recovered, first.failed_recoveries, first.dispatched) == (1, 0, 1)
            gate_b.wait_reached()
            assert task_row(engine, task_id)["recoveries"] == 1
            age_task(engine, task_id, 600)
            second = run_once(app)
            assert (second.recovered, second.failed_recoveries, second.dispatched) == (0, 1, 0)
            failed = task_row(engine, task_id)
            assert (failed["status"], failed["execution_id"], failed["recoveries"]) == (
                "FAILED",
                None,
                1,
            )
            assert failed["last_error"] == "The task stopped responding too many times."
        finally:
            gate_a.release()
            gate_b.release()
        wait_for(lambda: len(outcomes(events, message)) == 2, what="A and B to return")
        assert all("'outcome': 'lease_lost'" in o for o in outcomes(events, message))
        assert task_row(engine, task_id) == failed
        third = run_once(app)
        assert (third.recovered, third.dispatched, third.failed_recoveries) == (0, 0, 0)
    assert task_row(engine, task_id) == failed
