"""A broker reconnect never runs a live export twice (issue 22, finding 3).

When a worker's broker connections are cut, kombu restores the worker's unacknowledged
message to its queue and another worker receives it - the same message, with the same
stamp - while the first worker's execution goes on. The claim must skip that delivery
(and acknowledge it): the row's holder is alive and the row is not stale. Only Celery's
re-send after a lost pool process may take a RUNNING row over.

Two real ``celery -A tasks worker`` subprocesses (``-c 1`` each) on a private
``redis-server`` as the broker, so that ``CLIENT KILL`` cuts every broker connection of
the cluster (normal and pubsub ones, as a failover does) and no one else's; heartbeats,
results and the gate stay on the shared Redis (``REDIS_URL``), which nothing here faults.
W1 claims the export and parks after its first batch (a steady gate). W1's consumer for
``exports`` is cancelled first (``celery control cancel_consumer``): after the reconnect W1
would otherwise be as free as W2 to take the restored message back, and which of the two
received it would be a race.

On the code before issue 22 W2's delivery took the running row over (a second CLAIM) and
ran the export again; W1's completion then lost its lease.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.csv_reference import expected_csv
from harness.factories import World, add_tickets, audit_trail, task_row
from harness.processes import Proc, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from tasks.celery_app import create_app
from teamdesk.config import Settings
from tests.support import steady_gates
from tests.support.celery_tools import consumer
from tests.support.operator_commands import node_of
from tests.support.queues import publish_stamped, queue_key
from tests.support.redis_server import dedicated_redis

pytestmark = pytest.mark.slow

GATE = "export.after_read"
GATE_TIMEOUT_S = 60.0
TICKETS = 5
BATCH = 2  # batches after rows 2, 4 and 5: the gate is passed three times
QUEUE = "exports"


def delivered(broker: redis.Redis, prefix: str) -> list[str]:
    """Message ids in kombu's unacked hash: taken by a worker, not yet acknowledged."""
    return [json.loads(entry)[0]["headers"]["id"] for entry in broker.hvals(f"{prefix}:unacked")]


def of_task(worker: Proc, event: str, task_id: uuid.UUID) -> list[dict[str, Any]]:
    return [e for e in worker.events(event) if e.get("task_id") == str(task_id)]


def test_a_message_restored_by_a_reconnect_is_skipped_while_its_execution_lives(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, TICKETS)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    message = f"{task_id}-0"
    with dedicated_redis() as server:
        s = settings.with_overrides(broker_url=server.url, export_batch_size=BATCH)
        broker = server.client()
        app = create_app(s)
        gate = RemoteGate(redis_client, s.queue_prefix, GATE)
        gated = settings_env(s, **steady_gates.worker_env(GATE, s.redis_url, GATE_TIMEOUT_S))
        try:
            with cluster(tmp_path) as procs:
                w1 = Proc("w1", worker_argv("w1", concurrency=1), gated, tmp_path).start()
                procs.append(w1)
                node_1, member_1 = node_of(w1), w1.events("worker.started")[0]["member"]
                publish_stamped(engine, app, task_id, 0)  # as the dispatcher publishes it
                try:
                    parked = gate.wait_reached()  # W1 holds the run, after its first batch
                    assert parked["done"] == BATCH
                    w2 = Proc("w2", worker_argv("w2", concurrency=1), settings_env(s), tmp_path)
                    procs.append(w2.start())
                    w2.wait_event("worker.started", timeout=60)
                    consumer(s, node_1, "cancel_consumer", QUEUE)
                    assert delivered(broker, s.queue_prefix) == [message]  # W1's, unacked

                    # Every broker connection but the test's. W1's only process is busy,
                    # so W1 has no read outstanding on its normal connections: the loss of
                    # its pubsub one (remote control) is what it notices at once.
                    cut = broker.client_kill_filter(_type="normal", skipme=True)
                    cut += broker.client_kill_filter(_type="pubsub", skipme=True)
                    assert cut >= 4  # W1's and W2's, two kinds each, at least

                    wait_for(
                        lambda: (
                            of_task(w2, "task.skipped", task_id)
                            or of_task(w2, "task.started", task_id)
                        ),
                        timeout=30,
                        interval=0.05,
                        what="W2 to receive the message restored from W1",
                    )
                    row = task_row(engine, task_id)
                    assert (row["status"], str(row["execution_id"]), row["lease_holder"]) == (
                        "RUNNING",
                        parked["execution_id"],
                        member_1,
                    )
                finally:
                    gate.release(times=3)
                w1.wait_event("task.completed", timeout=30)
                wait_for(
                    lambda: (
                        broker.llen(queue_key(s.queue_prefix, QUEUE)) == 0
                        and delivered(broker, s.queue_prefix) == []
                    ),
                    timeout=10,
                    what="the broker to hold nothing (W2's delivery acknowledged)",
                )
        finally:
            app.close()
            broker.close()

    skipped = of_task(w2, "task.skipped", task_id)
    assert len(skipped) == 1 and "held by a live execution" in skipped[0]["reason"], skipped
    assert of_task(w2, "task.started", task_id) == []
    assert len(of_task(w1, "task.started", task_id)) == 1
    assert len(of_task(w1, "task.completed", task_id)) == 1
    assert w1.events("task.lease_lost") == w2.events("task.lease_lost") == []
    execution = parked["execution_id"]
    assert audit_trail(engine, task_id) == [("CLAIM", execution), ("COMPLETE", execution)]
    row = task_row(engine, task_id)
    assert (row["status"], row["run"], row["attempts"], row["recoveries"]) == (
        "COMPLETED",
        0,
        1,
        0,
    )
    assert row["result_summary"] == f"{TICKETS} rows"
    assert row["result_csv"] == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
