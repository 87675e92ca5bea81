"""The dispatcher scan (SPEC §7) against real PostgreSQL and the real Redis broker.

No worker consumes in these tests, so every message a scan publishes stays in its queue's
Redis list, where the test reads it back by id. Concurrency is ordered by a barrier
inside the ledger call, never by sleeping.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from dispatcher import beat_tasks, scan
from dispatcher.heartbeat import Heartbeat
from dispatcher.monitor import FailureLog
from dispatcher.scan import ScanCounts, run_once
from ledger import dispatch, lease
from tasks import queueing
from teamdesk import config, db
from teamdesk.config import Settings
from tests.support.factories import World, age_task, insert_task, task_row
from tests.support.queues import all_task_messages, closed_port, markers, message_ids

LONG_UP = 3600.0  # an injected Redis uptime well past HEARTBEAT_TTL_S


def long_up(_client: redis.Redis) -> float:
    return LONG_UP


def waiting_rows(
    engine: sa.Engine, world: World, count: int, kind: str = "EXPORT"
) -> list[uuid.UUID]:
    with engine.begin() as conn:
        return [insert_task(conn, world, kind=kind) for _ in range(count)]


def running_row(
    engine: sa.Engine,
    world: World,
    holder: str | None = None,
    recoveries: int = 0,
    kind: str = "EXPORT",
) -> uuid.UUID:
    """A row claimed by a real claim (lease and holder set), then given ``recoveries``."""
    with engine.begin() as conn:
        task_id = insert_task(conn, world, kind=kind)
        assert lease.claim(conn, task_id, 0, 1, holder) is not None
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET recoveries = :r, dispatched_at = now() WHERE id = :id"
            ),
            {"r": recoveries, "id": task_id},
        )
    return task_id


def set_columns(engine: sa.Engine, task_id: uuid.UUID, **values: Any) -> None:
    assignments = ", ".join(f"{name} = :{name}" for name in values)
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE background_tasks SET {assignments} WHERE id = :id"),
            {"id": task_id, **values},
        )


def ids(task_ids: list[uuid.UUID], run: int = 0) -> list[str]:
    return message_ids((t, run) for t in task_ids)


def messages(redis_client: redis.Redis, prefix: str) -> dict[str, list[str]]:
    return {q: sorted(v) for q, v in all_task_messages(redis_client, prefix).items()}


def records(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def fields(record: logging.LogRecord, *names: str) -> tuple[Any, ...]:
    """The JSON fields a log_event call put on ``record``."""
    return tuple(getattr(record, name) for name in names)


def scan_now() -> datetime:
    return datetime.now(UTC)


# --- step 3: dispatch ---------------------------------------------------------------------


def test_dispatch_publishes_each_due_row_once_with_its_run_message_id(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    exports = waiting_rows(engine, world, 2)
    reminders = waiting_rows(engine, world, 1, kind="REMINDER")
    later_one = waiting_rows(engine, world, 1, kind="REMINDER")[0]
    set_columns(engine, later_one, run_at=datetime.now(UTC) + timedelta(hours=1))
    retried = waiting_rows(engine, world, 1)[0]
    set_columns(engine, retried, run=1)
    done = running_row(engine, world)
    set_columns(engine, done, status="COMPLETED", execution_id=None, dispatched_at=None)
    now = scan_now()

    counts = run_once(celery_app, now=now, uptime=long_up)

    assert counts == ScanCounts(dispatched=4, heartbeat_rule=True)
    assert messages(redis_client, queue_prefix) == {
        "exports": sorted([*ids(exports), f"{retried}-1"]),
        "reminders": ids(reminders),
    }
    assert markers(redis_client, queue_prefix) == set(ids(exports + reminders)) | {f"{retried}-1"}
    for task_id in [*exports, *reminders, retried]:
        row = task_row(engine, task_id)
        assert (row["status"], row["dispatched_at"]) == ("WAITING", now)
    assert task_row(engine, later_one)["dispatched_at"] is None
    assert task_row(engine, done)["dispatched_at"] is None

    again = run_once(celery_app, now=now + timedelta(seconds=3), uptime=long_up)

    assert again == ScanCounts(heartbeat_rule=True)
    assert messages(redis_client, queue_prefix) == {
        "exports": sorted([*ids(exports), f"{retried}-1"]),
        "reminders": ids(reminders),
    }


@pytest.mark.parametrize("step", ["dispatch", "redispatch"])
def test_overlapping_scans_split_the_rows_and_publish_each_exactly_once(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
) -> None:
    rows = waiting_rows(engine, world, 30)
    now = scan_now()
    if step == "redispatch":  # published long ago, messages lost (no markers, empty queue)
        for task_id in rows:
            set_columns(engine, task_id, dispatched_at=now - timedelta(hours=1))
    name = "lock_due" if step == "dispatch" else "lock_published_before"
    both_inside = threading.Barrier(2, timeout=20)
    locked: list[int] = []
    real = getattr(dispatch, name)

    def lock_then_wait(*args: Any, **kwargs: Any) -> list[dispatch.RunRef]:
        refs: list[dispatch.RunRef] = real(*args, **kwargs)
        locked.append(len(refs))
        both_inside.wait()  # both scans now hold their row locks at the same time
        return refs

    monkeypatch.setattr(dispatch, name, lock_then_wait)
    results: list[ScanCounts] = []
    errors: list[BaseException] = []

    def one_scan() -> None:
        try:
            results.append(run_once(celery_app, now=now, batch=20, uptime=long_up))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one_scan) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(results) == 2

    assert sorted(locked) == [10, 20]  # SKIP LOCKED: the second scan took the rest
    field = "dispatched" if step == "dispatch" else "redispatched"
    assert sorted(getattr(c, field) for c in results) == [10, 20]
    assert all(c.publish_failed == 0 and c.redis_error is None for c in results)
    assert messages(redis_client, queue_prefix) == {"exports": ids(rows), "reminders": []}
    assert markers(redis_client, queue_prefix) == set(ids(rows))
    assert {task_row(engine, t)["dispatched_at"] for t in rows} == {now}

    monkeypatch.setattr(dispatch, name, real)
    again = run_once(celery_app, now=now + timedelta(seconds=3), uptime=long_up)
    assert (again.dispatched, again.redispatched) == (0, 0)
    assert messages(redis_client, queue_prefix) == {"exports": ids(rows), "reminders": []}


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_publish_failure_clears_dispatched_at_and_the_next_scan_publishes(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    broker: str,
) -> None:
    rows = waiting_rows(engine, world, 3)
    port = closed_port()
    # A broker nobody listens on: with Redis the marker SET fails first, with AMQP the
    # marker is set and the send itself fails (publish() then removes the marker).
    url = f"redis://127.0.0.1:{port}/0" if broker == "redis" else f"amqp://127.0.0.1:{port}//"
    down = make_app(broker_url=url)
    down.conf.broker_connection_timeout = 1
    down.conf.broker_connection_max_retries = 1
    now = scan_now()

    counts = run_once(down, now=now, uptime=long_up)

    assert (counts.dispatched, counts.publish_failed) == (0, 3)
    assert counts.redis_error == ("ConnectionError" if broker == "redis" else "OperationalError")
    for task_id in rows:
        row = task_row(engine, task_id)
        assert (row["status"], row["dispatched_at"]) == ("WAITING", None)
    assert markers(redis_client, queue_prefix) == set()
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}

    up = make_app(broker_url=settings.redis_url)
    retry = run_once(up, now=now + timedelta(seconds=3), uptime=long_up)

    assert (retry.dispatched, retry.publish_failed, retry.redis_error) == (3, 0, None)
    assert messages(redis_client, queue_prefix) == {"exports": ids(rows), "reminders": []}
    assert {task_row(engine, t)["dispatched_at"] for t in rows} == {now + timedelta(seconds=3)}


# --- step 2: reconcile --------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_waiting_run_whose_message_ended_failure_is_failed_not_published(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    failed, retrying, fresh = waiting_rows(engine, world, 3)
    backend = celery_app.backend
    backend.mark_as_failure(queueing.message_id(failed, 0), RuntimeError("worker lost"))
    backend.mark_as_retry(queueing.message_id(retrying, 0), RuntimeError("transient"))
    # The FAILURE of an older run says nothing about the current one.
    backend.mark_as_failure(queueing.message_id(fresh, 0), RuntimeError("old run"))
    set_columns(engine, fresh, run=1)
    now = scan_now()

    with caplog.at_level(logging.INFO):
        counts = run_once(celery_app, now=now, uptime=long_up)

    assert (counts.reconciled, counts.dispatched) == (1, 2)
    row = task_row(engine, failed)
    assert (row["status"], row["last_error"], row["dispatched_at"]) == (
        "FAILED",
        "The task's queue message failed.",
        None,
    )
    assert task_row(engine, retrying)["dispatched_at"] == now
    assert messages(redis_client, queue_prefix) == {
        "exports": sorted([f"{retrying}-0", f"{fresh}-1"]),
        "reminders": [],
    }
    assert markers(redis_client, queue_prefix) == {f"{retrying}-0", f"{fresh}-1"}
    [record] = records(caplog, "task.failed")
    assert fields(record, "task_id", "run", "exhausted") == (str(failed), 0, True)


# --- step 4: re-dispatch lost messages ----------------------------------------------------


def test_redispatch_only_when_the_queued_marker_is_gone(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
) -> None:
    backlog, lost, recent = waiting_rows(engine, world, 3)
    first = scan_now()
    assert run_once(celery_app, now=first, uptime=long_up).dispatched == 3
    # The broker lost two messages (say Redis restarted without persistence): their
    # markers went with them. ``backlog`` still waits behind a slow queue, marker intact.
    redis_client.delete(f"{queue_prefix}:exports")
    redis_client.delete(queueing.marker_key(lost, 0), queueing.marker_key(recent, 0))
    stale = first + timedelta(seconds=settings.stale_after_s + 1)
    set_columns(engine, recent, dispatched_at=stale - timedelta(seconds=1))

    counts = run_once(celery_app, now=stale, uptime=long_up)

    assert (counts.redispatched, counts.dispatched) == (1, 0)
    assert messages(redis_client, queue_prefix) == {"exports": [f"{lost}-0"], "reminders": []}
    assert markers(redis_client, queue_prefix) == {f"{backlog}-0", f"{lost}-0"}
    assert task_row(engine, lost)["dispatched_at"] == stale
    assert task_row(engine, backlog)["dispatched_at"] == first  # not published again
    assert task_row(engine, recent)["dispatched_at"] == stale - timedelta(seconds=1)

    again = run_once(celery_app, now=stale + timedelta(seconds=3), uptime=long_up)
    assert again.redispatched == 0
    assert messages(redis_client, queue_prefix) == {"exports": [f"{lost}-0"], "reminders": []}


# --- step 1: recover ----------------------------------------------------------------------


def test_stale_running_run_goes_back_to_waiting_and_is_published_again(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stale = running_row(engine, world, holder=None, kind="REMINDER")
    busy = running_row(engine, world, holder=None)
    age_task(engine, stale, settings.stale_after_s + 5)
    busy_before = task_row(engine, busy)
    now = scan_now()

    with caplog.at_level(logging.INFO):
        counts = run_once(celery_app, now=now, uptime=long_up)

    assert (counts.recovered, counts.failed_recoveries, counts.dispatched) == (1, 0, 1)
    row = task_row(engine, stale)
    assert (row["status"], row["recoveries"], row["execution_id"], row["lease_holder"]) == (
        "WAITING",
        1,
        None,
        None,
    )
    assert row["dispatched_at"] == now  # recovered, then dispatched by the same scan
    assert task_row(engine, busy) == busy_before
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": [f"{stale}-0"]}
    [record] = records(caplog, "task.stalled")
    assert fields(record, "task_id", "run", "outcome") == (str(stale), 0, "WAITING")


def test_run_past_max_recoveries_fails_with_the_fixed_message(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
) -> None:
    task_id = running_row(engine, world, recoveries=settings.max_recoveries)
    age_task(engine, task_id, settings.stale_after_s + 5)

    counts = run_once(celery_app, now=scan_now(), uptime=long_up)

    assert (counts.recovered, counts.failed_recoveries, counts.dispatched) == (0, 1, 0)
    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"], row["recoveries"]) == (
        "FAILED",
        "The task stopped responding too many times.",
        settings.max_recoveries,
    )
    assert (row["execution_id"], row["lease_holder"], row["dispatched_at"]) == (None, None, None)
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}


@pytest.fixture
def live_worker(
    redis_client: redis.Redis, queue_prefix: str, settings: Settings
) -> Iterator[Heartbeat]:
    beat = Heartbeat(redis_client, queue_prefix, "test-host", settings.heartbeat_ttl_s)
    assert beat.renew()
    yield beat
    beat.remove()


def test_dead_holder_is_recovered_before_the_stale_rule_when_heartbeats_are_trusted(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    live_worker: Heartbeat,
) -> None:
    dead = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    alive = running_row(engine, world, holder=live_worker.member)
    unregistered = running_row(engine, world, holder=None)  # only the 2-minute rule applies
    alive_before, unregistered_before = task_row(engine, alive), task_row(engine, unregistered)
    now = scan_now()

    counts = run_once(celery_app, now=now, uptime=long_up)

    assert (counts.heartbeat_rule, counts.recovered, counts.dispatched) == (True, 1, 1)
    row = task_row(engine, dead)
    assert (row["status"], row["recoveries"], row["lease_holder"], row["execution_id"]) == (
        "WAITING",
        1,
        None,
        None,
    )
    assert task_row(engine, alive) == alive_before
    assert task_row(engine, unregistered) == unregistered_before
    assert messages(redis_client, queue_prefix) == {"exports": [f"{dead}-0"], "reminders": []}


@pytest.mark.parametrize("why", ["redis restarted less than one TTL ago", "heartbeat read failed"])
def test_dead_holder_is_not_recovered_early_when_heartbeats_cannot_be_trusted(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    why: str,
) -> None:
    dead = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    stale = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    age_task(engine, stale, settings.stale_after_s + 5)
    dead_before = task_row(engine, dead)
    if why == "heartbeat read failed":
        unreachable = redis.Redis(port=closed_port(), retry=Retry(NoBackoff(), 1))
        counts = run_once(celery_app, now=scan_now(), redis_client=unreachable, uptime=long_up)
        # The same REDIS_URL client reads the result states, so dispatch waits too.
        assert (counts.redis_error, counts.dispatched) == ("ConnectionError", 0)
        expected_messages: list[str] = []
    else:
        just_started = settings.heartbeat_ttl_s - 1
        counts = run_once(celery_app, now=scan_now(), uptime=lambda _c: just_started)
        assert (counts.redis_error, counts.dispatched) == (None, 1)
        expected_messages = [f"{stale}-0"]

    assert (counts.heartbeat_rule, counts.recovered) == (False, 1)
    assert task_row(engine, dead) == dead_before  # cannot tell is never dead
    assert task_row(engine, stale)["status"] == "WAITING"  # the 2-minute rule still holds
    assert messages(redis_client, queue_prefix) == {"exports": expected_messages, "reminders": []}


def test_holder_that_registered_and_claimed_after_the_heartbeat_read_is_not_taken_for_dead(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    """A process starts between the scan's heartbeat read and its recovery statement:
    it registers and claims; its member is missing from what the scan read."""
    task_id = waiting_rows(engine, world, 1)[0]
    newcomer = Heartbeat(redis_client, queue_prefix, "test-host", 20.0)
    claimed: list[lease.Claim | None] = []

    def uptime_then_newcomer_claims(client: redis.Redis) -> float:
        # Runs inside the scan, after it read the live members (the gate point).
        assert newcomer.renew()
        with engine.begin() as conn:
            claimed.append(lease.claim(conn, task_id, 0, 1, newcomer.member))
        return LONG_UP

    try:
        counts = run_once(celery_app, now=scan_now(), uptime=uptime_then_newcomer_claims)
    finally:
        newcomer.remove()

    assert claimed and claimed[0] is not None
    assert (counts.heartbeat_rule, counts.recovered) == (True, 0)
    row = task_row(engine, task_id)
    assert (row["status"], row["lease_holder"], row["recoveries"]) == (
        "RUNNING",
        newcomer.member,
        0,
    )
    assert row["execution_id"] == claimed[0].lease.execution_id
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}


# --- step 5: purge ------------------------------------------------------------------------


def test_purge_clears_only_expired_csvs(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    expired, kept = running_row(engine, world), running_row(engine, world)
    now = scan_now()
    for task_id, expires in (
        (expired, now - timedelta(minutes=1)),
        (kept, now + timedelta(hours=1)),
    ):
        set_columns(
            engine,
            task_id,
            status="COMPLETED",
            execution_id=None,
            lease_holder=None,
            result_csv="id,title\n",
            result_summary="1 rows",
            expires_at=expires,
        )
    kept_before = task_row(engine, kept)

    counts = run_once(celery_app, now=now, uptime=long_up)

    assert counts == ScanCounts(purged=1, heartbeat_rule=True)
    row = task_row(engine, expired)
    assert (row["status"], row["result_csv"], row["result_summary"]) == (
        "COMPLETED",
        None,
        "1 rows",
    )
    assert task_row(engine, kept) == kept_before
    assert scan.purge_once(now=now) == 0


# --- the statements' plans on a large table -----------------------------------------------


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def fill_100k(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("""
            INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status,
                                          progress, run_at, created_at, updated_at,
                                          result_csv, expires_at)
            SELECT 'EXPORT', :team, :owner, 'TEAM', '{}'::jsonb, 'COMPLETED', 100,
                   now() - g * interval '1 minute', now() - g * interval '1 minute',
                   now() - g * interval '1 minute',
                   CASE WHEN g <= 500 THEN 'id\n' END,
                   CASE WHEN g <= 500 THEN now() + interval '1 day' - g * interval '1 minute'
                   END
              FROM generate_series(1, 100000) AS g"""),
            {"team": world.team_id, "owner": world.staff_id},
        )
        conn.execute(
            sa.text("""
            INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status,
                                          dispatched_at, execution_id, lease_holder)
            SELECT 'EXPORT', :team, :owner, 'TEAM', '{}'::jsonb,
                   CASE g % 3 WHEN 0 THEN 'RUNNING' ELSE 'WAITING' END,
                   CASE g % 3 WHEN 1 THEN now() END,
                   CASE g % 3 WHEN 0 THEN gen_random_uuid() END,
                   CASE g % 3 WHEN 0 THEN 'host/' || g END
              FROM generate_series(1, 150) AS g"""),
            {"team": world.team_id, "owner": world.staff_id},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE background_tasks"))


BY_ID = {"pk_background_tasks", "ix_background_tasks_due", "ix_background_tasks_dispatched"}


def test_every_scan_statement_walks_its_partial_index_on_100k_rows(
    engine: sa.Engine, world: World
) -> None:
    fill_100k(engine, world)
    now = datetime.now(UTC)
    some = {"task_id": uuid.uuid4(), "run": 0, "now": now}
    cases = [
        (
            dispatch.RECOVER_STALE,
            {"ix_background_tasks_running"},
            {
                "stale_before": now,
                "use_heartbeats": True,
                "live_members": ["host/1"],
                "holders_seen_at": now,
                "max_recoveries": 2,
                "batch": 200,
                "too_many": "x",
            },
        ),
        (dispatch.LOCK_DUE, {"ix_background_tasks_due"}, {"now": now, "batch": 200}),
        (
            dispatch.LOCK_PUBLISHED_BEFORE,
            {"ix_background_tasks_dispatched"},
            {"before": now, "batch": 200},
        ),
        (dispatch.PURGE_EXPIRED, {"ix_background_tasks_expiring"}, {"now": now, "batch": 200}),
        # One row by id: the primary key, or a partial index just as narrow.
        (dispatch.RECONCILE_FAILED, BY_ID, {**some, "message": "x"}),
        (
            dispatch.MARK_MANY_DISPATCHED,
            BY_ID,
            {"ids": [str(some["task_id"])], "keys": [f"{some['task_id']}/0"], "now": now},
        ),
        (dispatch.CLEAR_DISPATCHED, BY_ID, {**some, "stamp": now}),
        (dispatch.MARK_REDISPATCHED, BY_ID, {**some, "before": now}),
    ]
    with engine.connect() as conn:
        for statement, indexes, params in cases:
            explain = sa.text("EXPLAIN (FORMAT JSON) " + statement.text)
            [plan] = conn.execute(explain, params).scalar_one()
            nodes = list(plan_nodes(plan["Plan"]))
            scans = [
                (n["Node Type"], n.get("Index Name"))
                for n in nodes
                if n.get("Relation Name") == "background_tasks"
            ]
            assert scans, statement.text
            assert all(kind != "Seq Scan" for kind, _ in scans), (statement.text, scans)
            assert indexes & {name for _, name in scans}, (statement.text, scans)
        conn.rollback()


# --- failures: the throttled log ------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failure_log_throttles_failed_and_logs_recovered_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    failures = FailureLog(logging.getLogger("test.dispatcher"), clock=clock)
    with caplog.at_level(logging.INFO):
        assert failures.succeeded() is False  # nothing to recover from
        assert failures.failed("PostgreSQL", "OperationalError") is True
        for step in (1.0, 10.0, 29.0):
            clock.now = 1000.0 + step
            assert failures.failed("PostgreSQL", "OperationalError") is False
        clock.now = 1030.0
        assert failures.failed("Redis", "ConnectionError") is True
        clock.now = 1042.5
        assert failures.succeeded() is True
        assert failures.succeeded() is False
        assert failures.failed("Redis", "TimeoutError") is True  # a new outage logs at once

    failed = records(caplog, "dispatcher.failed")
    assert [fields(r, "service", "error", "failed_scans", "suppressed") for r in failed] == [
        ("PostgreSQL", "OperationalError", 1, 0),
        ("Redis", "ConnectionError", 5, 3),
        ("Redis", "TimeoutError", 1, 0),
    ]
    [recovered] = records(caplog, "dispatcher.recovered")
    assert fields(recovered, "failed_scans", "down_s") == (5, 42.5)


def test_scan_task_logs_database_down_throttled_then_recovered_once(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = waiting_rows(engine, world, 1)
    clock = FakeClock()
    monitor = FailureLog(logging.getLogger("test.dispatcher"), clock=clock)
    port = closed_port()
    config.set_settings(
        settings.with_overrides(
            database_url=f"postgresql://postgres:hunter2@127.0.0.1:{port}/teamdesk"
        )
    )
    db.reset_engine()
    with caplog.at_level(logging.INFO):
        assert beat_tasks.scan_and_report(celery_app, monitor) is None
        clock.now += 5
        assert beat_tasks.scan_and_report(celery_app, monitor) is None
        config.set_settings(settings)
        db.reset_engine()
        clock.now += 5
        first = beat_tasks.scan_and_report(celery_app, monitor)
        second = beat_tasks.scan_and_report(celery_app, monitor)

    assert first is not None and first.dispatched == 1
    assert second is not None and second.dispatched == 0
    [failed] = records(caplog, "dispatcher.failed")
    assert fields(failed, "service", "error") == ("PostgreSQL", "OperationalError")
    logged = " ".join(f"{k}={v}" for k, v in vars(failed).items())
    assert "hunter2" not in logged and str(port) not in logged
    [recovered] = records(caplog, "dispatcher.recovered")
    assert fields(recovered, "failed_scans", "down_s") == (2, 10.0)
    assert messages(redis_client, queue_prefix) == {"exports": ids(rows), "reminders": []}


# --- the command line -----------------------------------------------------------------------


def cli(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "DATABASE_URL": settings.database_url,
        "REDIS_URL": settings.redis_url,
        "QUEUE_PREFIX": settings.queue_prefix,
        "LOG_LEVEL": "error",
        **env,
    }
    environment.pop("BROKER_URL", None)
    command = [str(Path(sys.executable).parent / "teamdesk-tasks"), *args]
    return subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=60, check=False
    )


def test_scan_command_runs_one_scan_and_prints_what_it_did(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    rows = waiting_rows(engine, world, 2)

    plain = cli(settings, "scan")
    as_json = cli(settings, "scan", "--json")

    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.count("\n") == 1 and "dispatched 2" in plain.stdout
    assert as_json.returncode == 0, as_json.stderr
    printed = json.loads(as_json.stdout)
    assert printed.keys() == ScanCounts().as_dict().keys()
    assert (printed["dispatched"], printed["redis_error"]) == (0, None)  # the first scan did it
    assert messages(redis_client, queue_prefix) == {"exports": ids(rows), "reminders": []}
    assert "scan" in cli(settings, "--help").stdout
    assert "--json" in cli(settings, "scan", "--help").stdout


@pytest.mark.parametrize("down", ["DATABASE_URL", "REDIS_URL"])
def test_scan_command_exits_1_with_a_clear_message_when_a_service_is_down(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    down: str,
) -> None:
    rows = waiting_rows(engine, world, 1)
    port = closed_port()
    url = (
        f"postgresql://postgres:hunter2@127.0.0.1:{port}/teamdesk"
        if down == "DATABASE_URL"
        else f"redis://:hunter2@127.0.0.1:{port}/0"
    )

    result = cli(settings, "scan", **{down: url})

    assert result.returncode == 1
    service = "PostgreSQL" if down == "DATABASE_URL" else "Redis"
    assert f"cannot reach {service}" in result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    assert str(port) not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert task_row(engine, rows[0])["dispatched_at"] is None
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}
