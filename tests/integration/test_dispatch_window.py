"""The dispatcher's scan filling the window (docs/design.md, "Dispatch") against real
PostgreSQL and the real Redis broker, with no worker consuming: every message a scan
publishes stays in its queue's Redis list, where the test reads it back by id.

Each ready run is published once, its message carrying its stamp; the window holds two
runs per live worker process (or DISPATCH_WINDOW) and skips a queue nobody consumes; a
refused publish makes the runs ready again; and a published run whose message is gone,
or is another publish's, is published again, but not one published moments ago. Worker
window comes from heartbeat members the test registers itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, timedelta
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher import scan as scan_module
from dispatcher.scan import run_once
from harness.factories import World, task_row
from ledger import lease
from tasks import broker_view
from tasks.names import EXPORTS_QUEUE, REMINDERS_QUEUE
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat
from tests.support.dispatch_scan import (
    dispatcher,
    ids,
    long_up,
    messages,
    running_row,
    waiting_rows,
)
from tests.support.queues import closed_port, resend_stamped


def set_columns(engine: sa.Engine, task_id: uuid.UUID, **values: Any) -> None:
    assignments = ", ".join(f"{name} = :{name}" for name in values)
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE background_tasks SET {assignments} WHERE id = :id"),
            {"id": task_id, **values},
        )


def shift(engine: sa.Engine, task_id: uuid.UUID, column: str, seconds: float) -> None:
    """Move a timestamp into the past by the database's clock (no waiting)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE background_tasks SET {column} = {column} - make_interval(secs => :s) "
                "WHERE id = :id"
            ),
            {"s": seconds, "id": task_id},
        )


def stamp_of(engine: sa.Engine, task_id: uuid.UUID) -> str:
    stamp = task_row(engine, task_id)["dispatched_at"]
    assert stamp is not None
    return str(stamp.astimezone(UTC).isoformat())


def held_stamps(app: Celery, client: redis.Redis, prefix: str) -> dict[str, str]:
    """Each message the broker holds in the task queues: its id and the stamp it carries."""
    views = broker_view.look(app, client, prefix, [EXPORTS_QUEUE, REMINDERS_QUEUE])
    return {i: stamp for view in views.values() if view and view.listed for i, stamp in view.listed}


# --- fill: publish ready runs into the window ----------------------------------------------


def test_scan_publishes_each_ready_run_once_with_its_message_id_and_its_stamp(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    offer()
    exports = waiting_rows(engine, world, 2)
    reminders = waiting_rows(engine, world, 1, kind="REMINDER")
    later_one = waiting_rows(engine, world, 1, kind="REMINDER")[0]
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE background_tasks SET run_at = now() + interval '1 hour' WHERE id = :i"),
            {"i": later_one},
        )
    retried = waiting_rows(engine, world, 1, run=1)[0]
    done = running_row(engine, world)
    set_columns(engine, done, status="COMPLETED", execution_id=None, dispatched_at=None)

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.dispatched, counts.redispatched, counts.publish_failed) == (4, 0, 0)
    assert counts.next_due_s is not None and 3500 < counts.next_due_s <= 3600
    assert messages(redis_client, queue_prefix) == {
        "exports": sorted([*ids(exports), f"{retried}-1"]),
        "reminders": ids(reminders),
    }
    held = held_stamps(celery_app, redis_client, queue_prefix)
    published = [*exports, *reminders, retried]
    for task_id in published:
        row = task_row(engine, task_id)
        assert row["status"] == "WAITING" and row["dispatched_at"] is not None
        assert held[f"{task_id}-{row['run']}"] == stamp_of(engine, task_id)
    assert task_row(engine, later_one)["dispatched_at"] is None
    assert task_row(engine, done)["dispatched_at"] is None

    again = run_once(celery_app, uptime=long_up)

    assert (again.dispatched, again.redispatched) == (0, 0)
    assert messages(redis_client, queue_prefix) == {
        "exports": sorted([*ids(exports), f"{retried}-1"]),
        "reminders": ids(reminders),
    }


def test_the_window_holds_two_runs_per_worker_process_and_refills_as_they_are_claimed(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    worker = offer(concurrency=2, queues=("exports",))  # window: 4 exports waiting
    rows = waiting_rows(engine, world, 10)

    first = run_once(celery_app, uptime=long_up)

    assert first.dispatched == 4
    published = [t for t in rows if task_row(engine, t)["dispatched_at"] is not None]
    assert len(published) == 4
    assert messages(redis_client, queue_prefix)["exports"] == ids(sorted(published, key=str))
    assert run_once(celery_app, uptime=long_up).dispatched == 0  # full
    with engine.begin() as conn:  # two are claimed: they left the window
        held = [lease.claim(conn, t, 0, worker.member) for t in published[:2]]
    assert all(held)
    assert run_once(celery_app, uptime=long_up).dispatched == 2
    assert sum(task_row(engine, t)["dispatched_at"] is not None for t in rows) == 6
    assert len(messages(redis_client, queue_prefix)["exports"]) == 6  # no worker took any


def test_dispatch_window_setting_overrides_the_heartbeat_sizing(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    app = make_app(dispatch_window=3)
    waiting_rows(engine, world, 5)
    waiting_rows(engine, world, 5, kind="REMINDER")

    counts = run_once(app, uptime=long_up)  # no worker registered at all

    assert counts.dispatched == 6
    got = messages(redis_client, queue_prefix)
    assert (len(got["exports"]), len(got["reminders"])) == (3, 3)
    assert counts.no_consumers == ["exports", "reminders"]


def test_a_queue_no_live_worker_consumes_gets_no_messages_and_the_scan_says_so(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    offer(concurrency=2, queues=("exports",))
    exports = waiting_rows(engine, world, 1)
    reminders = waiting_rows(engine, world, 1, kind="REMINDER")

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.dispatched, counts.no_consumers) == (1, ["reminders"])
    assert messages(redis_client, queue_prefix) == {"exports": ids(exports), "reminders": []}
    assert task_row(engine, reminders[0])["dispatched_at"] is None
    assert "no live worker consumes reminders" in counts.summary()


# --- publish refused, and old failures -------------------------------------------------------


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_publish_refused_makes_the_runs_ready_again_and_the_next_scan_publishes(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
    broker: str,
) -> None:
    offer()
    rows = waiting_rows(engine, world, 3)
    port = closed_port()
    url = f"redis://127.0.0.1:{port}/0" if broker == "redis" else f"amqp://127.0.0.1:{port}//"
    down = make_app(broker_url=url)
    down.conf.broker_connection_timeout = 1
    down.conf.broker_connection_max_retries = 1

    counts = run_once(down, uptime=long_up)

    assert (counts.dispatched, counts.publish_failed) == (0, 3)
    assert counts.redis_error is not None
    for task_id in rows:
        row = task_row(engine, task_id)
        assert (row["status"], row["dispatched_at"]) == ("WAITING", None)
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}

    up = make_app(broker_url=settings.redis_url)
    retry = run_once(up, uptime=long_up)

    assert (retry.dispatched, retry.publish_failed, retry.redis_error) == (3, 0, None)
    assert messages(redis_client, queue_prefix) == {"exports": ids(rows), "reminders": []}


def test_an_old_failure_of_the_same_message_does_not_keep_the_run_from_running(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    """An earlier message of this run ended FAILURE (say its claim could not reach the
    database); the run was recovered since. The queue's record says nothing about the
    run now: only the ledger decides, and the run is published."""
    offer()
    task_id = waiting_rows(engine, world, 1)[0]
    celery_app.backend.mark_as_failure(f"{task_id}-0", RuntimeError("claim failed earlier"))
    set_columns(engine, task_id, recoveries=1)

    counts = run_once(celery_app, uptime=long_up)

    assert counts.dispatched == 1
    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"]) == ("WAITING", None)
    assert messages(redis_client, queue_prefix) == {"exports": [f"{task_id}-0"], "reminders": []}


# --- re-publish lost messages ----------------------------------------------------------------


def test_a_published_run_whose_message_is_gone_or_another_publishs_is_published_again(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker lost the window's messages (say Redis restarted without persistence);
    ``backlog``'s is back (a redelivery of its publish) and ``stale`` has only a message
    of an earlier publish, which its claim would refuse. Two looks a scan apart: ``lost``
    and ``stale`` are published again with new stamps, ``backlog`` is left alone."""
    offer()
    backlog, lost, stale = waiting_rows(engine, world, 3)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    with dispatcher(celery_app) as next_scan:
        assert next_scan().dispatched == 3
        before = {t: task_row(engine, t)["dispatched_at"] for t in (backlog, lost, stale)}
        redis_client.delete(f"{queue_prefix}:{EXPORTS_QUEUE}")
        resend_stamped(celery_app, backlog, 0, before[backlog])
        resend_stamped(celery_app, stale, 0, before[stale] - timedelta(minutes=5))

        first = next_scan()  # one look can miss a message in transit
        assert (first.redispatched, first.missing_from_broker) == (0, 0)
        counts = next_scan()
        assert (counts.redispatched, counts.missing_from_broker, counts.dispatched) == (2, 2, 0)
        for task_id in (lost, stale):
            assert task_row(engine, task_id)["dispatched_at"] > before[task_id]
        assert task_row(engine, backlog)["dispatched_at"] == before[backlog]
        held = held_stamps(celery_app, redis_client, queue_prefix)
        assert {t: held[f"{t}-0"] for t in (backlog, lost)} == {
            t: stamp_of(engine, t) for t in (backlog, lost)
        }
        assert next_scan().redispatched == next_scan().redispatched == 0


def test_a_run_published_moments_ago_is_not_judged_lost(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    """Its publish may still be under way (another dispatcher's, in an overlap)."""
    offer()
    recent = waiting_rows(engine, world, 1)[0]
    with dispatcher(celery_app) as next_scan:
        assert next_scan().dispatched == 1
        redis_client.delete(f"{queue_prefix}:{EXPORTS_QUEUE}")
        stamped = task_row(engine, recent)["dispatched_at"]

        assert next_scan().redispatched == next_scan().redispatched == 0
        assert task_row(engine, recent)["dispatched_at"] == stamped
        shift(engine, recent, "dispatched_at", scan_module.PUBLISH_GRACE_S + 1)
        assert next_scan().redispatched == 0  # the first look
        assert next_scan().redispatched == 1


def test_lost_messages_of_a_queue_nobody_consumes_wait_for_a_consumer(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = make_app(dispatch_window=2)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    waiting_rows(engine, world, 1, kind="REMINDER")
    with dispatcher(app) as next_scan:
        assert next_scan().dispatched == 1
        redis_client.delete(f"{queue_prefix}:{REMINDERS_QUEUE}")

        for _ in range(3):  # no consumer: its message may simply be waiting
            assert next_scan().redispatched == 0
        offer(concurrency=1, queues=("reminders",))
        assert next_scan().redispatched == 0  # the first look
        assert next_scan().redispatched == 1
