"""Messages sent by hand (issue 22): ``celery -A tasks call teamdesk.reminder|export
--args ...`` on a live ``celery worker`` subprocess changes nothing unless it is the
run's current publish, due, and its execution is not alive.

- no stamp (``["<id>", 0]``) for a reminder scheduled an hour ahead: refused, one warning;
- the stamp of an older publish: skipped;
- a run whose ``run_at`` is an hour ahead, with a stamp that is not its publish's, or even
  with the row's own stamp: skipped;
- malformed args (a bad id, the wrong count, keyword arguments, a run or a stamp of the
  wrong type): one warning line each, no traceback, nothing written - while the well-formed
  message, sent last, runs the very same reminder;
- the current publish's stamp while the export it names runs (parked at a gate): skipped,
  the live execution keeps its lease and completes, one CLAIM.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.factories import (
    World,
    add_ticket,
    add_tickets,
    audit_events,
    notifications,
    task_row,
)
from harness.processes import Proc, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from tasks.celery_app import create_app
from teamdesk.config import Settings
from tests.support.operator_commands import (
    call,
    celery_lines,
    held_messages,
    node_of,
    not_json,
    records,
)
from tests.support.queues import held_ids, publish_stamped

pytestmark = pytest.mark.slow

REMINDER = "teamdesk.reminder"
EXPORT = "teamdesk.export"
HOUR_S = 3600
GATE = "export.after_read"


@contextmanager
def live_worker(s: Settings, tmp_path: Path, **env: object) -> Iterator[Proc]:
    """One worker subprocess (two pool processes), started and ready."""
    with cluster(tmp_path) as procs:
        worker = Proc("w1", worker_argv("w1", concurrency=2), settings_env(s, **env), tmp_path)
        procs.append(worker.start())
        node_of(worker)
        yield worker


def reminder(engine: sa.Engine, world: World, in_s: float = 0) -> uuid.UUID:
    """A reminder for a ticket assigned to a staff member, due ``in_s`` from now by the
    database's clock."""
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff2_id)
        run_at = conn.execute(
            sa.text("SELECT now() + make_interval(secs => :s)"), {"s": in_s}
        ).scalar_one()
        return service.create_reminder(conn, world.team_id, world.staff_id, ticket, run_at)


def stamp(engine: sa.Engine, task_id: uuid.UUID) -> datetime:
    """Publish the run in the ledger (``dispatched_at``, the database's clock) as the
    dispatcher would, without a message; returns the stamp."""
    with engine.begin() as conn:
        return conn.execute(
            sa.text(
                "UPDATE background_tasks SET dispatched_at = clock_timestamp() "
                "WHERE id = :id RETURNING dispatched_at"
            ),
            {"id": task_id},
        ).scalar_one()


def send(
    s: Settings, worker: Proc, task: str, args: list[Any], kwargs: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """``celery call`` one message and wait until the worker's task returned for it; the
    worker's lines written meanwhile."""
    since = len(records(worker))
    message = call(s, task, json.dumps(args), None if kwargs is None else json.dumps(kwargs))
    wait_for(lambda: ended(worker, task, message), timeout=20, what=f"the end of {message}")
    return records(worker, since)


def ended(worker: Proc, task: str, message: str) -> bool:
    """Celery has said how the message ended (succeeded, raised, retry, ...)."""
    said = celery_lines(worker, f"{task}[{message}]")
    return any(" received" not in str(line["message"]) for line in said)


def loud(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line["level"] in ("warn", "error", "fatal")]


def assert_acknowledged(client: redis.Redis, prefix: str) -> None:
    wait_for(
        lambda: held_messages(client, prefix) == 0,
        timeout=10,
        what="every message acknowledged",
    )


def test_a_message_without_a_stamp_is_refused_and_changes_nothing(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    task_id = reminder(engine, world, in_s=HOUR_S)
    before = task_row(engine, task_id)
    with live_worker(settings, tmp_path) as worker:
        lines = send(settings, worker, REMINDER, [str(task_id), 0])
        assert_acknowledged(redis_client, settings.queue_prefix)

    assert task_row(engine, task_id) == before
    assert audit_events(engine, task_id) == []
    assert notifications(engine, task_id) == 0
    assert held_ids(redis_client, settings.queue_prefix) == set()
    warned = loud(lines)
    assert [line["event"] for line in warned] == ["task.refused"]
    assert warned[0]["level"] == "warn" and warned[0]["reason"]
    assert worker.events("task.started") == []
    assert "Traceback" not in worker.output()
    assert not_json(worker) == []


def test_the_stamp_of_an_older_publish_is_skipped_and_changes_nothing(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    task_id = reminder(engine, world)  # due now
    older = stamp(engine, task_id)
    current = stamp(engine, task_id)  # published again (the first message judged lost)
    assert current > older
    before = task_row(engine, task_id)
    with live_worker(settings, tmp_path) as worker:
        lines = send(settings, worker, REMINDER, [str(task_id), 0, older.isoformat()])
        assert_acknowledged(redis_client, settings.queue_prefix)

    assert task_row(engine, task_id) == before
    assert audit_events(engine, task_id) == []
    assert notifications(engine, task_id) == 0
    skipped = [line for line in lines if line["event"] == "task.skipped"]
    assert len(skipped) == 1
    assert (skipped[0]["task_id"], skipped[0]["run"], skipped[0]["level"]) == (
        str(task_id),
        0,
        "info",
    )
    assert skipped[0]["reason"]
    assert loud(lines) == []
    assert worker.events("task.started") == []


def test_a_run_scheduled_an_hour_ahead_is_not_started_by_any_stamp(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    unpublished = reminder(engine, world, in_s=HOUR_S)
    # A row carrying a stamp while its run_at is an hour ahead: even a message with the
    # row's own stamp must not start it early (the claim's "run_at <= now()").
    early = reminder(engine, world, in_s=HOUR_S)
    early_stamp = stamp(engine, early)
    before = {t: task_row(engine, t) for t in (unpublished, early)}
    created = before[unpublished]["created_at"]
    with live_worker(settings, tmp_path) as worker:
        lines = send(settings, worker, REMINDER, [str(unpublished), 0, created.isoformat()])
        lines += send(settings, worker, REMINDER, [str(early), 0, early_stamp.isoformat()])
        assert_acknowledged(redis_client, settings.queue_prefix)

    for task_id, row in before.items():
        assert task_row(engine, task_id) == row
        assert audit_events(engine, task_id) == []
        assert notifications(engine, task_id) == 0
    skipped = [line["task_id"] for line in lines if line["event"] == "task.skipped"]
    assert skipped == [str(unpublished), str(early)]
    assert loud(lines) == []
    assert worker.events("task.started") == []


def test_malformed_args_are_refused_with_one_warning_each_and_nothing_written(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    task_id = reminder(engine, world)  # due now and published: a well-formed message runs it
    current = stamp(engine, task_id).isoformat()
    tid = str(task_id)
    malformed: list[tuple[list[Any], dict[str, Any] | None]] = [
        (["not-a-uuid"], None),
        ([tid, "x", "y", 1], None),
        (["not-a-uuid", 0, current], None),
        ([tid, 0, current], {"run": 0}),  # keyword arguments
        ([], {"task_id": tid, "run": 0, "stamp": current}),
        ([tid, "0", current], None),  # the run as text
        ([tid, 0, "yesterday"], None),  # the stamp not a timestamp
    ]
    before = task_row(engine, task_id)
    with live_worker(settings, tmp_path) as worker:
        for args, kwargs in malformed:
            lines = send(settings, worker, REMINDER, args, kwargs)
            warned = loud(lines)
            assert [line["event"] for line in warned] == ["task.refused"], (args, kwargs, lines)
            assert warned[0]["level"] == "warn" and warned[0]["reason"]
            assert task_row(engine, task_id) == before, (args, kwargs)
        assert_acknowledged(redis_client, settings.queue_prefix)
        assert audit_events(engine, task_id) == []
        assert notifications(engine, task_id) == 0
        assert held_ids(redis_client, settings.queue_prefix) == set()
        assert worker.events("task.started") == []
        assert "Traceback" not in worker.output()
        assert not_json(worker) == []

        # The same reminder, with its publish's own message: it runs (the refusals above
        # were of messages that could have changed something).
        lines = send(settings, worker, REMINDER, [tid, 0, current])
        assert loud(lines) == []

    row = task_row(engine, task_id)
    assert (row["status"], row["attempts"]) == ("COMPLETED", 1)
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    assert notifications(engine, task_id) == 1
    assert len(worker.events("task.refused")) == len(malformed)
    assert [line for line in records(worker) if line["level"] in ("error", "fatal")] == []
    assert "Traceback" not in worker.output()
    assert not_json(worker) == []


def test_the_current_stamp_never_takes_over_a_live_execution(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    s = settings.with_overrides(export_batch_size=2)  # parks after rows 2 and 3
    gates = {
        "TEAMDESK_TEST_HOOKS": "harness.remote_gates",
        "TEAMDESK_TEST_GATES": GATE,
        "TEAMDESK_TEST_GATE_TIMEOUT_S": 30,
    }
    app = create_app(s)
    # The client's reads may block as long as the gate waits (redis-py's default is 5 s).
    gate_client = redis.Redis.from_url(s.redis_url, socket_timeout=60)
    gate = RemoteGate(gate_client, s.queue_prefix, GATE)
    try:
        with live_worker(s, tmp_path, **gates) as worker:
            ready = len(records(worker))
            published = publish_stamped(engine, app, task_id, 0, "EXPORT")
            parked = gate.wait_reached(timeout=30)
            assert parked["task_id"] == str(task_id)
            held = task_row(engine, task_id)
            assert held["status"] == "RUNNING"

            since = len(records(worker))
            message = call(s, EXPORT, json.dumps([str(task_id), 0, published.isoformat()]))
            wait_for(
                lambda: ended(worker, EXPORT, message) or len(worker.events("task.started")) > 1,
                timeout=20,
                what="the message to end, or to start a second execution",
            )
            assert len(worker.events("task.started")) == 1
            lines = records(worker, since)
            skipped = [line for line in lines if line["event"] == "task.skipped"]
            assert [line["task_id"] for line in skipped] == [str(task_id)]
            assert skipped[0]["reason"]
            now = task_row(engine, task_id)
            assert (now["status"], now["execution_id"], now["attempts"]) == (
                "RUNNING",
                held["execution_id"],
                1,
            )

            gate.release(times=2)
            wait_for(
                lambda: task_row(engine, task_id)["status"] == "COMPLETED",
                timeout=20,
                what="the live execution to complete",
            )
            assert_acknowledged(redis_client, s.queue_prefix)
    finally:
        gate.release(times=4)
        gate_client.close()
        app.close()

    row = task_row(engine, task_id)
    assert (row["status"], row["attempts"], row["result_summary"]) == ("COMPLETED", 1, "3 rows")
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    assert len(worker.events("task.started")) == 1
    assert len(worker.events("task.completed")) == 1
    assert worker.events("task.lease_lost") == []
    assert loud(records(worker, ready)) == []
