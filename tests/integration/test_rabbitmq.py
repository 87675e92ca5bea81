"""BROKER_URL may point at RabbitMQ; Redis stays for results and heartbeats. The virtual
host is the cluster's own, named like QUEUE_PREFIX (teamdesk/config.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from dispatcher import scan as scan_module
from dispatcher.scan import run_once
from harness.csv_reference import expected_csv
from harness.factories import World, add_tickets, task_row
from harness.waiting import wait_for
from ledger import service
from tasks import queueing
from tasks.names import PROGRESS_EVENT
from teamdesk import hooks
from teamdesk.heartbeat import Heartbeat
from tests.support.celery_tools import rabbit_queue_counts
from tests.support.celery_tools import rabbit_vhost as throwaway_vhost
from tests.support.dispatch_scan import dispatcher, long_up
from tests.support.dispatching import running_cluster
from tests.support.gates import Gate
from tests.support.scenario import event_records
from tests.support.workers import EventLog, running_worker


@pytest.fixture
def rabbit_vhost(queue_prefix: str) -> Iterator[str]:
    """A throwaway vhost named like the test's QUEUE_PREFIX: this test's queues and
    exchanges vanish with it."""
    with throwaway_vhost(queue_prefix) as vhost:
        yield vhost


def test_worker_on_rabbitmq_completes_an_export(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    rabbit_vhost: str,
    redis_client: redis.Redis,
) -> None:
    app = make_app(
        broker_url=f"amqp://guest:guest@127.0.0.1:5672/{rabbit_vhost}", export_batch_size=100
    )
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 250)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    message = queueing.message_id(task_id, 0)
    with EventLog(app) as events, running_cluster(app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
        wait_for(lambda: events.of_type("task-succeeded", message), what="task-succeeded")
        progress = [e["result"] for e in events.of_type(PROGRESS_EVENT, message)]
    row = task_row(engine, task_id)
    assert row["result_csv"] == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
    assert (row["attempts"], row["progress"], row["result_summary"]) == (1, 100, "250 rows")
    assert progress == ["40% (100/250 rows)", "80% (200/250 rows)"]
    assert AsyncResult(message, app=app).state == "PENDING"  # successes are not stored
    assert row["dispatched_at"] is not None  # the dispatcher published it
    counts = rabbit_queue_counts(rabbit_vhost, "exports")
    assert (counts["ready"], counts["unacked"]) == (0, 0)


def test_a_run_past_lost_after_in_a_queue_that_holds_messages_is_published_again_once(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    rabbit_vhost: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RabbitMQ counts the messages ready, it cannot say which: while the queue holds one,
    a published run is published again only once its stamp is past LOST_AFTER (here made
    0 s), with a new stamp. Both messages are then delivered at once, to two slots: the
    old one claims nothing, and the new one's execution (parked at a gate meanwhile) is
    never interrupted: the task runs once."""
    app = make_app(broker_url=f"amqp://guest:guest@127.0.0.1:5672/{rabbit_vhost}")
    offer(concurrency=1)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    assert run_once(app, uptime=long_up).dispatched == 1
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    first = task_row(engine, task_id)["dispatched_at"]
    with dispatcher(app) as next_scan:
        for _ in range(2):  # the queue holds a message: nothing is judged missing
            counts = next_scan()
            assert (counts.redispatched, counts.overdue) == (0, 0)
        assert task_row(engine, task_id)["dispatched_at"] == first
        monkeypatch.setattr(scan_module, "LOST_AFTER_MIN_S", 0.0)
        monkeypatch.setattr(scan_module, "LOST_AFTER_FACTOR", 0)
        again = next_scan()
    assert (again.redispatched, again.overdue, again.missing_from_broker) == (1, 1, 0)
    assert rabbit_queue_counts(rabbit_vhost, "exports")["ready"] == 2
    current = task_row(engine, task_id)["dispatched_at"]
    running = Gate("the claiming execution, after its read")
    claims: list[object] = []
    with (
        hooks.installed("task.claimed", lambda claim, **_: claims.append(claim)),
        hooks.installed("export.after_read", running.hook()),
        running_worker(app, concurrency=2),
    ):
        try:
            running.wait_reached()
            wait_for(
                lambda: len(event_records(caplog, "task.skipped", task_id)) == 1,
                what="the old message to claim nothing",
            )
            assert task_row(engine, task_id)["dispatched_at"] == current
        finally:
            running.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
    with engine.connect() as conn:
        trail = conn.execute(
            sa.text("SELECT event FROM task_audit WHERE task_id = :t ORDER BY id"),
            {"t": task_id},
        ).scalars()
        assert list(trail) == ["CLAIM", "COMPLETE"]
    assert len(claims) == 1
