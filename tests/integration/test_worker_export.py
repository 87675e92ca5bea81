"""An export through a real in-process Celery worker: CSV, ledger, queue state and progress
events as Flower receives them."""

from __future__ import annotations

import csv
import io

import redis
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from harness.factories import World, add_tickets, task_row
from harness.waiting import wait_for
from ledger import service
from tasks import queueing
from tasks.names import PROGRESS_EVENT
from teamdesk import config
from tests.support.dispatching import running_cluster
from tests.support.queues import broker_holds
from tests.support.workers import EventLog


def test_export_completes_and_progress_reaches_flower(
    engine: sa.Engine, world: World, celery_app: Celery, redis_client: redis.Redis
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with EventLog(celery_app) as events, running_cluster(celery_app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
        message = queueing.message_id(task_id, 0)
        wait_for(lambda: events.of_type("task-succeeded", message), what="task-succeeded")
        progress = events.of_type(PROGRESS_EVENT, message)
    row = task_row(engine, task_id)
    assert (row["status"], row["progress"], row["attempts"], row["run"]) == ("COMPLETED", 100, 1, 0)
    assert row["result_summary"] == "1200 rows" and row["execution_id"] is None
    body = list(csv.reader(io.StringIO(row["result_csv"])))
    assert body[0] == [
        "id",
        "title",
        "status",
        "priority",
        "requester_id",
        "assignee_id",
        "due_at",
        "created_at",
        "updated_at",
    ]
    assert [r[1] for r in body[1:]] == [f"Ticket {i}" for i in range(1, 1201)]
    # After the last batch nothing is reported: the queue's next event is the success.
    assert [e["result"] for e in progress] == ["41% (500/1200 rows)", "83% (1000/1200 rows)"]
    assert [e["percent"] for e in progress] == [41, 83]
    # Flower's SUCCESS and result come from the event; the result backend keeps failures only.
    (succeeded,) = events.of_type("task-succeeded", message)
    assert succeeded["result"] == repr(
        {"task_id": str(task_id), "run": 0, "outcome": "completed", "summary": "1200 rows"}
    )
    assert AsyncResult(message, app=celery_app).state == "PENDING"  # nothing stored
    assert row["dispatched_at"] is not None  # the dispatcher published it
    assert not broker_holds(redis_client, config.get_settings().queue_prefix, task_id, 0)
