"""An export's progress events (for Flower) are best effort: a broker that goes away in the
middle of an export must not fail the attempt, since the ledger, written first, has the
progress. Found by the soak: a long export lost two of its three attempts to a Redis
restart (kombu's OperationalError from ``task.send_event``) and to database faults, and
ended FAILED.

A real ``celery worker`` subprocess whose broker is a dedicated ``redis-server``; the
export parks at its first batch (the gate lives on the shared Redis, which is never
stopped), the broker is stopped, the gate is let go: the export completes in the ledger
in its first attempt.

The second test keeps the broker down for longer than a heartbeat TTL: the worker's
heartbeat (on the shared Redis) goes on being renewed while Celery's consumer retries the
broker. Found by the soak: the renewal ran on Celery's event loop, which stands still
between kombu's reconnection attempts, so after a Redis failover a worker still
reconnecting looked dead and the dispatcher took back its live export."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, audit_events, task_row
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from teamdesk.heartbeat import holders_key, live_members
from tests.support.gated_worker import gated_export_worker
from tests.support.redis_server import dedicated_redis, stop

pytestmark = pytest.mark.slow

GATE = "export.after_read"
CONNECTION_LOST = "consumer: Connection to broker lost"  # Celery's warning


def assert_completed_in_its_first_attempt(engine: sa.Engine, task_id: uuid.UUID) -> None:
    """The 5-ticket export COMPLETED as run 0, attempt 1: its CSV, and CLAIM, COMPLETE."""
    row = task_row(engine, task_id)
    assert (row["status"], row["run"], row["attempts"], row["progress"]) == (
        "COMPLETED",
        0,
        1,
        100,
    )
    assert (row["result_summary"], row["last_error"]) == ("5 rows", None)
    assert str(row["result_csv"]).count("\n") == 6  # the header and 5 rows
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]


def test_a_broker_outage_during_an_export_costs_progress_events_not_the_attempt(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 5)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with dedicated_redis() as server:
        # Batches of 2 rows: progress (ledger, then a Flower event) after rows 2 and 4.
        s = settings.with_overrides(
            redis_url=server.url, broker_url=server.url, export_batch_size=2
        )
        with gated_export_worker(s, settings.redis_url, GATE, 120, task_id, tmp_path) as run:
            gate, w1 = run.gate, run.worker
            assert gate.wait_reached()["done"] == 2
            try:
                stop(server.process)  # the broker goes away
                gate.release(times=3)  # rows 2 and 4, then the last batch
                wait_for(
                    lambda: task_row(engine, task_id)["status"] != "RUNNING",
                    timeout=60,
                    what="the export to end its attempt",
                )
            finally:
                gate.release(times=3)
                server.restart()
            w1.wait_event("task.completed")
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0

    assert_completed_in_its_first_attempt(engine, task_id)
    assert w1.events("task.attempt_failed") == []
    assert "progress event not sent" in w1.output()


def redis_time(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


def test_the_heartbeat_goes_on_while_the_consumer_reconnects_to_the_broker(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    tmp_path: Path,
) -> None:
    ttl = 2.0
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 5)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with dedicated_redis() as broker:
        # The broker alone is faulted: heartbeats stay on the shared Redis (REDIS_URL).
        s = settings.with_overrides(broker_url=broker.url, heartbeat_ttl_s=ttl, export_batch_size=2)
        with gated_export_worker(s, settings.redis_url, GATE, 120, task_id, tmp_path) as run:
            gate, w1 = run.gate, run.worker
            try:
                assert gate.wait_reached()["done"] == 2
                stopped_at = redis_time(redis_client)  # Redis's clock, as the scores are
                stop(broker.process)
                # A renewal later than one TTL after the stop: the member never lapsed
                # while the consumer retried (kombu pauses 2 s, then 4 s, ...).
                wait_for(
                    lambda: (
                        (redis_client.zscore(holders_key(queue_prefix), run.member) or 0)
                        > stopped_at + 2 * ttl
                    ),
                    timeout=30,
                    what="a heartbeat renewal one TTL after the broker stopped",
                )
                assert CONNECTION_LOST in w1.output()
                assert "Connected to redis" not in w1.output().split(CONNECTION_LOST)[-1]
                assert run.member in live_members(redis_client, queue_prefix)
                gate.release(times=3)
                wait_for(
                    lambda: task_row(engine, task_id)["status"] == "COMPLETED",
                    timeout=60,
                    what="the export to complete",
                )
            finally:
                gate.release(times=3)
                broker.restart()
            w1.wait_event("task.completed")
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0

    assert_completed_in_its_first_attempt(engine, task_id)
    # The broker's outage is the only failure: the heartbeat itself never failed.
    assert w1.events("heartbeat.failed") == []
    assert w1.events("worker.consuming_paused") == []
