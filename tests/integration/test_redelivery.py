"""A message handed to another consumer while its execution runs claims nothing
(docs/design.md, "Lease"): kombu restores a delivered, unacknowledged message once its
delivery time is older than the broker's visibility timeout, whatever the execution is
doing, and nothing renews that time. The lease makes the redelivery harmless: the run is
RUNNING under a live execution, so the second delivery is skipped and the run completes
once. Real Redis, kombu's own restore, an in-process worker with two slots."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from harness.factories import World, add_tickets, audit_events, task_row
from harness.waiting import wait_for
from ledger import service
from teamdesk import hooks
from tests.support.gates import Gate
from tests.support.queues import held_ids, queued_ids, send_message
from tests.support.scenario import event_records
from tests.support.workers import running_worker

VISIBILITY_TIMEOUT_S = 1  # the restoring consumer's: a delivery older than this returns


def restore_visible(app: Celery) -> None:
    """One sweep of kombu's restore, as any consumer of the broker runs it."""
    with app.connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=10, interval=1)


def test_a_message_restored_while_its_execution_runs_is_skipped_and_the_run_completes_once(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app()
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
    }
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    message = f"{task_id}-0"
    running = Gate("the first execution, after its read")
    with hooks.installed("export.after_read", running.hook()), running_worker(app, concurrency=2):
        try:
            send_message(app, task_id, 0)
            running.wait_reached()
            first = task_row(engine, task_id)["execution_id"]
            assert queued_ids(redis_client, queue_prefix, "exports") == []

            def restored() -> bool:
                restore_visible(app)
                return bool(event_records(caplog, "task.skipped", task_id))

            wait_for(restored, timeout=30, interval=0.2, what="the restored message's delivery")
            held = task_row(engine, task_id)
            assert (held["status"], held["execution_id"]) == ("RUNNING", first)
        finally:
            running.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
        wait_for(lambda: message not in held_ids(redis_client, queue_prefix), what="the acks")
    row = task_row(engine, task_id)
    assert (row["run"], row["attempts"], row["result_summary"]) == (0, 1, "3 rows")
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    assert len(event_records(caplog, "task.started", task_id)) == 1
    (skipped,) = event_records(caplog, "task.skipped", task_id)
    assert skipped.reason == "the run is held by a live execution"  # type: ignore[attr-defined]
    assert event_records(caplog, "task.lease_lost", task_id) == []
    assert held_ids(redis_client, queue_prefix) == set()
