"""Beat: the schedule, the maintenance tasks on a real worker, and exactly one active beat
among two real ``celery beat`` processes (celery-redbeat's lock).

Beat processes run against the real Redis under this test's throwaway QUEUE_PREFIX. No
worker consumes the ``maintenance`` queue in the beat test, so every scan a beat sends
stays in that queue's Redis list, and each message's ``origin`` header names the
process that sent it. The test orders itself on the beats' log lines (read over their
stderr pipes) and on that list, never on sleeps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

import beat_schedule
from dispatcher.beat_tasks import MAINTENANCE_QUEUE, PURGE_TASK, SCAN_TASK
from tasks.celery_app import EXPORTS_QUEUE
from teamdesk.config import Settings
from tests.support.beat_processes import BeatProcess
from tests.support.factories import World, insert_task, task_row
from tests.support.queues import queued, queued_ids
from tests.support.waiting import wait_for
from tests.support.workers import EventLog, running_worker

SCAN_INTERVAL_S = 0.5  # shortened through the SPEC §12 variable, as a deployment would


def test_schedule_holds_the_scan_and_the_purge_on_the_maintenance_queue(settings: Settings) -> None:
    schedule = beat_schedule.build_schedule(settings)

    assert schedule == {
        "dispatcher-scan": {
            "task": SCAN_TASK,
            "schedule": timedelta(seconds=settings.scan_interval_s),
            "options": {"queue": MAINTENANCE_QUEUE, "expires": 30.0},
        },
        "purge-expired-csv": {
            "task": PURGE_TASK,
            "schedule": timedelta(seconds=beat_schedule.PURGE_INTERVAL_S),
            "options": {"queue": MAINTENANCE_QUEUE, "expires": beat_schedule.PURGE_INTERVAL_S},
        },
    }
    # Heartbeat renewal is a worker bootstep, never a beat entry.
    assert not any(
        "heartbeat" in name or "heartbeat" in entry["task"] for name, entry in schedule.items()
    )


def test_beat_config_follows_scan_interval_and_keeps_the_lock_under_the_prefix(
    settings: Settings,
) -> None:
    default = beat_schedule.beat_config(settings)
    fast = beat_schedule.beat_config(settings.with_overrides(scan_interval_s=SCAN_INTERVAL_S))
    slow = beat_schedule.beat_config(settings.with_overrides(scan_interval_s=60.0))

    assert default["beat_scheduler"] == "redbeat.RedBeatScheduler"
    assert (default["beat_max_loop_interval"], default["redbeat_lock_timeout"]) == (3.0, 15)
    assert (fast["beat_max_loop_interval"], fast["redbeat_lock_timeout"]) == (0.5, 3)
    assert (slow["beat_max_loop_interval"], slow["redbeat_lock_timeout"]) == (5.0, 25)
    expires = [
        c["beat_schedule"]["dispatcher-scan"]["options"]["expires"] for c in (default, fast, slow)
    ]
    assert expires == [30.0, 30.0, 600.0]  # skew-tolerant floor, else ten intervals
    prefix = settings.queue_prefix
    assert default["redbeat_lock_key"] == f"{prefix}:redbeat::lock"
    assert default["redbeat_key_prefix"] == f"{prefix}:redbeat:"
    assert default["redbeat_redis_url"] == settings.redis_url


def test_install_registers_the_maintenance_tasks_and_is_idempotent(
    celery_app: Celery, settings: Settings
) -> None:
    beat_schedule.install(celery_app, settings)
    beat_schedule.install(celery_app, settings)

    for name in (SCAN_TASK, PURGE_TASK):
        task = celery_app.tasks[name]
        assert (task.ignore_result, task.acks_late) == (True, False)
        assert celery_app.amqp.router.route({}, name)["queue"].name == MAINTENANCE_QUEUE
    names = [q.name for q in celery_app.conf.task_queues]
    assert names.count(MAINTENANCE_QUEUE) == 1
    assert celery_app.conf.beat_schedule == beat_schedule.build_schedule(settings)


def test_scan_task_runs_on_a_worker_of_the_maintenance_queue_and_expired_scans_are_dropped(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    beat_schedule.install(celery_app, settings)
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    with (
        EventLog(celery_app) as events,
        running_worker(celery_app, queues=(MAINTENANCE_QUEUE,), concurrency=1),
    ):
        old = celery_app.send_task(
            SCAN_TASK, queue=MAINTENANCE_QUEUE, expires=datetime.now(UTC) - timedelta(seconds=1)
        )
        fresh = celery_app.send_task(SCAN_TASK, queue=MAINTENANCE_QUEUE)
        wait_for(lambda: events.of_type("task-succeeded", fresh.id), what="the scan to run")
        wait_for(lambda: events.of_type("task-revoked", old.id), what="the old scan dropped")

    [revoked] = events.of_type("task-revoked", old.id)
    assert revoked["expired"] is True
    assert events.of_type("task-started", old.id) == []
    row = task_row(engine, task_id)
    assert (row["status"], row["dispatched_at"] is not None) == ("WAITING", True)
    assert queued_ids(redis_client, queue_prefix, EXPORTS_QUEUE) == [f"{task_id}-0"]
    assert queued(redis_client, queue_prefix, MAINTENANCE_QUEUE) == []
    assert not redis_client.exists(f"{queue_prefix}:celery-task-meta-{fresh.id}")


@pytest.fixture
def beats(settings: Settings) -> Iterator[Callable[[], BeatProcess]]:
    env = {
        **os.environ,
        "DATABASE_URL": settings.database_url,
        "REDIS_URL": settings.redis_url,
        "BROKER_URL": settings.redis_url,
        "QUEUE_PREFIX": settings.queue_prefix,
        "SCAN_INTERVAL_S": str(SCAN_INTERVAL_S),
        "LOG_LEVEL": "info",
    }
    started: list[BeatProcess] = []

    def start() -> BeatProcess:
        started.append(BeatProcess(env))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def scan_origins(client: redis.Redis, prefix: str) -> list[str]:
    return [
        m["headers"]["origin"]
        for m in queued(client, prefix, MAINTENANCE_QUEUE)
        if m["headers"]["task"] == SCAN_TASK
    ]


def test_second_beat_stands_by_and_takes_over_when_the_first_dies(
    beats: Callable[[], BeatProcess],
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    fast = settings.with_overrides(scan_interval_s=SCAN_INTERVAL_S)
    lock_key, lock_timeout_s = beat_schedule.lock_key(fast), beat_schedule.beat_lock_timeout_s(fast)

    first = beats()
    first.wait_logged("beat: Acquired lock")
    second = beats()
    second.wait_logged("beat: Starting...")  # next: it blocks on the lock
    seen = len(scan_origins(redis_client, queue_prefix))
    # Long enough for the lock to have expired twice had the first beat not extended it,
    # and for the second to have asked for it a dozen times.
    wanted = seen + 2 * int(lock_timeout_s / SCAN_INTERVAL_S)
    wait_for(
        lambda: len(scan_origins(redis_client, queue_prefix)) >= wanted,
        timeout=30,
        what="the first beat to keep sending scans",
    )

    assert second.process.poll() is None and not second.logged("Acquired lock")
    origins = scan_origins(redis_client, queue_prefix)
    assert all(o.startswith(first.origin) for o in origins), set(origins)
    assert 0 < redis_client.pttl(lock_key) <= lock_timeout_s * 1000

    sent_by_first = len(origins)
    first.kill()  # SIGKILL: no chance to release the lock
    killed_at = time.monotonic()
    second.wait_logged("beat: Acquired lock", timeout=lock_timeout_s + 10)
    takeover_s = time.monotonic() - killed_at
    wait_for(
        lambda: any(o.startswith(second.origin) for o in scan_origins(redis_client, queue_prefix)),
        what="the second beat to send scans",
    )

    assert takeover_s <= lock_timeout_s + 3, takeover_s
    origins = scan_origins(redis_client, queue_prefix)
    handover = next(i for i, o in enumerate(origins) if o.startswith(second.origin))
    assert handover >= sent_by_first
    assert all(o.startswith(first.origin) for o in origins[:handover])
    assert all(o.startswith(second.origin) for o in origins[handover:]), origins[handover:]

    assert second.terminate() == 0
    assert second.logged("beat: Releasing lock")
    assert not redis_client.exists(lock_key)  # released on a clean stop: no wait next time
