"""``celery control cancel_consumer`` / ``add_consumer`` keep their Celery meaning and the
dispatch window follows them (issue 22): a worker whose consumer for a queue is cancelled
is not counted in that queue's window from its next heartbeat renewal on, and
``add_consumer`` counts it again. The window is read the way the dispatcher reads it
(``teamdesk.heartbeat.slots_by_queue``: live workers' pool processes per queue they
consume).

Real ``celery -A tasks worker`` and ``beat`` subprocesses, the real ``celery control`` CLI.
On the code before issue 22 a worker's offer was fixed at its start: the window kept
counting a cancelled consumer's processes.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, audit_events, task_row
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from teamdesk.heartbeat import live_members, slots_by_queue
from tests.support.celery_tools import consumer
from tests.support.operator_commands import node_of

pytestmark = pytest.mark.slow

FAST = {"scan_interval_s": 0.5, "heartbeat_ttl_s": 3.0}  # a renewal every 0.75 s
RENEWAL_TIMEOUT_S = 10.0  # detects a renewal that never carries the change
QUEUE = "exports"


def create_exports(engine: sa.Engine, world: World, n: int) -> list[uuid.UUID]:
    with engine.begin() as conn:
        return [
            service.create_export(conn, world.team_id, world.staff_id, "TEAM", {}) for _ in range(n)
        ]


def completed(engine: sa.Engine, ids: list[uuid.UUID]) -> bool:
    return all(task_row(engine, task_id)["status"] == "COMPLETED" for task_id in ids)


def started_on(worker: Proc, ids: list[uuid.UUID]) -> list[str]:
    """The task ids of ``ids`` this worker started, once per task.started line."""
    mine = {str(task_id) for task_id in ids}
    return [e["task_id"] for e in worker.events("task.started") if e["task_id"] in mine]


def test_a_cancelled_consumer_leaves_the_window_and_add_consumer_brings_it_back(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = settings.with_overrides(**FAST)
    env = settings_env(s)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)

    def window() -> dict[str, int]:
        return slots_by_queue(redis_client, s.queue_prefix)

    def window_becomes(expected: dict[str, int], what: str) -> None:
        wait_for(lambda: window() == expected, timeout=RENEWAL_TIMEOUT_S, interval=0.1, what=what)

    with cluster(tmp_path) as procs:
        wa = Proc("wa", worker_argv("wa", concurrency=2), env, tmp_path).start()
        wb = Proc("wb", worker_argv("wb", concurrency=1), env, tmp_path).start()
        beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
        procs += [wa, wb, beat]
        node_a, node_b = node_of(wa), node_of(wb)
        member_a = wa.events("worker.started")[0]["member"]
        beat.wait_event("dispatcher.leader", timeout=60)
        window_becomes({QUEUE: 3, "reminders": 3}, "both workers in the windows")

        consumer(s, node_a, "cancel_consumer", QUEUE)
        window_becomes({QUEUE: 1, "reminders": 3}, "wa's two processes out of the exports window")
        assert member_a in live_members(redis_client, s.queue_prefix)  # still a live worker
        first = create_exports(engine, world, 3)
        wait_for(lambda: completed(engine, first), timeout=30, what="exports run by wb")
        assert window() == {QUEUE: 1, "reminders": 3}  # no later renewal put wa back

        consumer(s, node_a, "add_consumer", QUEUE)
        window_becomes({QUEUE: 3, "reminders": 3}, "wa's processes back in the exports window")
        # wa consumes exports again: with wb's consumer cancelled, only wa can run them.
        consumer(s, node_b, "cancel_consumer", QUEUE)
        window_becomes({QUEUE: 2, "reminders": 3}, "wb's process out of the exports window")
        second = create_exports(engine, world, 2)
        wait_for(lambda: completed(engine, second), timeout=30, what="exports run by wa")

    assert sorted(started_on(wb, first)) == sorted(map(str, first))
    assert started_on(wa, first) == []
    assert sorted(started_on(wa, second)) == sorted(map(str, second))
    assert started_on(wb, second) == []
    for task_id in first + second:
        row = task_row(engine, task_id)
        assert (row["status"], row["attempts"], row["result_summary"]) == ("COMPLETED", 1, "3 rows")
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    assert wa.events("task.lease_lost") == wb.events("task.lease_lost") == []
