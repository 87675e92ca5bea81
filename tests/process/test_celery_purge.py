"""``celery -A tasks purge`` is a loss the cluster recovers from in seconds (issue 22,
finding 1): the dispatcher observes what the broker holds.

Real processes with the default timings (``STALE_AFTER_S`` 120: LOST_AFTER is 600 s): a
``celery -A tasks worker`` and ``celery -A tasks beat``. The worker's consumer for
``exports`` is cancelled with ``celery control cancel_consumer``; six exports are created
and published; ``celery purge -f -Q exports`` empties the queue;
``celery control add_consumer`` resumes the worker. Every export must complete within the
goal (SCAN_INTERVAL_S + a few seconds; the timeout here only detects a miss), each with one
claim and one execution, and the queue ends empty.

``DISPATCH_WINDOW`` is set to the six exports: the computed window follows what workers
consume (issue 22: a cancelled consumer leaves its queue's window), so with the default
window nothing would be published while the consumer is cancelled, and the purge would
find nothing to remove. A fixed window is published whoever consumes.

A recovery that waited for LOST_AFTER would take 10 minutes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, audit_events, task_row
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from tests.support.celery_tools import consumer, purge, rabbit_queue_counts, rabbit_vhost
from tests.support.operator_commands import node_of
from tests.support.queues import queue_key, queued_ids

pytestmark = pytest.mark.slow

EXPORTS = 6
TICKETS = 3
GOAL_S = 25.0  # detects a miss; the goal is SCAN_INTERVAL_S + a few seconds (printed)
QUEUE = "exports"


@dataclass(frozen=True)
class BrokerQueue:
    """What the broker's ``exports`` queue holds, read from the broker itself."""

    holds: Callable[[list[str]], bool]  # exactly these messages wait there, unconsumed
    empty: Callable[[], bool]  # nothing waits there and nothing is delivered unacknowledged


def redis_queue(client: redis.Redis, prefix: str) -> BrokerQueue:
    def delivered() -> list[str]:
        """Message ids in kombu's unacked hash (``[message, exchange, routing key]``)."""
        entries = client.hvals(f"{prefix}:unacked")
        return [json.loads(entry)[0]["headers"]["id"] for entry in entries]

    return BrokerQueue(
        holds=lambda ids: (
            sorted(queued_ids(client, prefix, QUEUE)) == sorted(ids) and delivered() == []
        ),
        empty=lambda: client.llen(queue_key(prefix, QUEUE)) == 0 and delivered() == [],
    )


def rabbit_queue(vhost: str) -> BrokerQueue:
    def empty() -> bool:
        counts = rabbit_queue_counts(vhost, QUEUE)
        return (counts["ready"], counts["unacked"]) == (0, 0)

    return BrokerQueue(
        # ... and nobody consumes it: the cancelled consumer is gone from RabbitMQ too.
        holds=lambda ids: (
            rabbit_queue_counts(vhost, QUEUE) == {"ready": len(ids), "unacked": 0, "consumers": 0}
        ),
        empty=empty,
    )


def create_exports(engine: sa.Engine, world: World, n: int) -> list[uuid.UUID]:
    with engine.begin() as conn:
        return [
            service.create_export(conn, world.team_id, world.staff_id, "TEAM", {}) for _ in range(n)
        ]


def statuses(engine: sa.Engine, ids: list[uuid.UUID]) -> set[str]:
    return {str(task_row(engine, task_id)["status"]) for task_id in ids}


def stamps(engine: sa.Engine, ids: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
    return {task_id: task_row(engine, task_id)["dispatched_at"] for task_id in ids}


@dataclass
class Outcome:
    ids: list[uuid.UUID]
    worker: Proc
    beat: Proc
    took_s: float  # from add_consumer to the last completion


def purge_while_cancelled(
    engine: sa.Engine,
    world: World,
    s: Settings,
    queue: BrokerQueue,
    tmp_path: Path,
) -> Outcome:
    """The scenario, on whichever broker ``s`` names; returns what the assertions read."""
    assert (s.stale_after_s, s.scan_interval_s, s.heartbeat_ttl_s) == (120.0, 3.0, 20.0)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, TICKETS)
    env = settings_env(s, DISPATCH_WINDOW=EXPORTS)
    with cluster(tmp_path) as procs:
        worker = Proc("w1", worker_argv("w1"), env, tmp_path).start()
        beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
        procs += [worker, beat]
        node = node_of(worker)
        beat.wait_event("dispatcher.leader", timeout=60)
        consumer(s, node, "cancel_consumer", QUEUE)

        ids = create_exports(engine, world, EXPORTS)
        messages = [f"{task_id}-0" for task_id in ids]
        wait_for(
            lambda: None not in stamps(engine, ids).values() and queue.holds(messages),
            timeout=20,
            interval=0.1,
            what="the six exports published and waiting in the broker's queue",
        )
        published = stamps(engine, ids)
        assert statuses(engine, ids) == {"WAITING"}
        assert worker.events("task.started") == []

        assert f"Purged {EXPORTS} messages" in purge(s, QUEUE)
        assert queue.empty()  # the messages are gone; the ledger still says published
        assert stamps(engine, ids) == published

        consumer(s, node, "add_consumer", QUEUE)
        resumed = time.monotonic()
        wait_for(
            lambda: statuses(engine, ids) == {"COMPLETED"},
            timeout=GOAL_S,
            interval=0.1,
            what="every purged export to complete",
        )
        took_s = time.monotonic() - resumed
        wait_for(queue.empty, timeout=10, interval=0.2, what="the broker's queue to be empty")
    print(f"all {EXPORTS} purged exports completed {took_s:.1f} s after add_consumer")
    return Outcome(ids, worker, beat, took_s)


def assert_each_ran_once(engine: sa.Engine, outcome: Outcome) -> None:
    for task_id in outcome.ids:
        row = task_row(engine, task_id)
        assert (row["status"], row["run"], row["attempts"], row["recoveries"]) == (
            "COMPLETED",
            0,
            1,
            0,
        )
        assert (row["result_summary"], row["last_error"]) == (f"{TICKETS} rows", None)
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
        started = [e for e in outcome.worker.events("task.started") if e["task_id"] == str(task_id)]
        assert len(started) == 1, started
    assert outcome.worker.events("task.lease_lost") == []
    scans = outcome.beat.events("dispatcher.scan")
    # The dispatcher published each purged run once more, having looked at the broker.
    assert sum(e.get("redispatched", 0) for e in scans) == EXPORTS
    assert sum(e.get("missing_from_broker", 0) for e in scans) == EXPORTS
    assert outcome.took_s < GOAL_S


def test_a_purge_on_redis_is_published_again_and_every_run_completes_once(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    queue = redis_queue(redis_client, settings.queue_prefix)
    outcome = purge_while_cancelled(engine, world, settings, queue, tmp_path)
    assert_each_ran_once(engine, outcome)
    # The broker's list and unacked hash are read message by message: nothing that the
    # broker still held was published twice, so no delivery found its run taken.
    mine = {str(task_id) for task_id in outcome.ids}
    assert [e for e in outcome.worker.events("task.skipped") if e["task_id"] in mine] == []


def test_a_purge_on_rabbitmq_is_published_again_and_every_run_completes_once(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    queue_prefix: str,
    tmp_path: Path,
) -> None:
    """RabbitMQ only counts: the queue seen empty in two looks says every run lost its
    message."""
    with rabbit_vhost(queue_prefix) as vhost:
        s = settings.with_overrides(broker_url=f"amqp://guest:guest@127.0.0.1:5672/{vhost}")
        outcome = purge_while_cancelled(engine, world, s, rabbit_queue(vhost), tmp_path)
    assert_each_ran_once(engine, outcome)
