"""BROKER_URL may point at RabbitMQ; Redis stays for results and markers."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from ledger import service
from tasks import queueing
from teamdesk import config
from tests.support.csv_reference import expected_csv
from tests.support.dispatching import running_cluster
from tests.support.factories import World, add_tickets, task_row
from tests.support.queues import marker_present
from tests.support.waiting import wait_for
from tests.support.workers import EventLog


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def rabbit_vhost() -> Iterator[str]:
    """A throwaway vhost: this test's queues and exchanges vanish with it."""
    vhost = f"tdt-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield vhost
    finally:
        rabbitmqctl("delete_vhost", vhost)


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
        progress = [e["result"] for e in events.of_type("task-progress", message)]
    row = task_row(engine, task_id)
    assert row["result_csv"] == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
    assert (row["attempts"], row["progress"], row["result_summary"]) == (1, 100, "250 rows")
    assert progress == ["40% (100/250 rows)", "80% (200/250 rows)"]
    assert AsyncResult(message, app=app).state == "SUCCESS"
    assert row["dispatched_at"] is not None  # the dispatcher published it
    assert not marker_present(redis_client, config.get_settings().queue_prefix, task_id, 0)
