"""BROKER_URL may point at RabbitMQ; Redis stays for results, heartbeats and markers. The
virtual host is the cluster's own, named like QUEUE_PREFIX (teamdesk/config.py)."""

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
from teamdesk import config, hooks
from teamdesk.heartbeat import Heartbeat
from tests.support.celery_tools import rabbit_vhost as throwaway_vhost
from tests.support.dispatch_scan import long_up
from tests.support.dispatching import running_cluster
from tests.support.gates import Gate
from tests.support.queues import marker_present
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
    assert not marker_present(redis_client, config.get_settings().queue_prefix, task_id, 0)


def test_markers_lost_with_the_messages_kept_cost_one_republish_and_nothing_runs_twice(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    rabbit_vhost: str,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On RabbitMQ the queued markers live in Redis, another failure domain than the
    messages. Redis loses them (a restart, an eviction) while RabbitMQ keeps the window's
    message: the dispatcher publishes the run again, with a new stamp. Both messages are
    then delivered at once, to two slots: the old one claims nothing, and the new one's
    execution (parked at a gate meanwhile) is never interrupted: the task runs once."""
    app = make_app(broker_url=f"amqp://guest:guest@127.0.0.1:5672/{rabbit_vhost}")
    offer(concurrency=1)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    assert run_once(app, uptime=long_up).dispatched == 1
    for key in redis_client.scan_iter(match=f"{queue_prefix}:queued:*"):
        redis_client.delete(key)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    again = run_once(app, uptime=long_up)
    assert (again.redispatched, again.dispatched) == (1, 0)
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
