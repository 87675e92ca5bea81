"""A draining worker keeps its leases for as long as its drain lasts (docs/design.md,
"Heartbeats" and "Shutdown"): a real ``celery worker`` subprocess, a real SIGTERM, and the
dispatcher's scan run by the test again and again throughout the drain.

Shortened timings, only through configuration: ``HEARTBEAT_TTL_S`` = 1 s (so every
heartbeat key lives 2 s unless renewed) and a drain of ``DRAIN_TTLS`` TTLs - production's
70 s drain against a 20 s TTL, compressed. The drain also survives a Redis restart (a
dedicated ``redis-server``) and a removal that Redis refused at SIGTERM.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher.scan import run_once
from harness.factories import World, add_tickets, audit_trail, task_row
from harness.processes import Proc
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from teamdesk.heartbeat import lease_holders_alive, live_members
from tests.support.gated_worker import gated_export_worker
from tests.support.redis_server import dedicated_redis

pytestmark = pytest.mark.slow

TTL_S = 1.0
DRAIN_TTLS = 6  # three times the 2 x TTL a heartbeat key lives unless renewed
MIN_SCANS = 8  # scans run back to back: many per TTL even on a busy machine
GATE = "export.after_read"
BATCHES = 3  # 1200 rows in batches of 500: the gate is reached once per batch


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1_000_000


def scan_through(
    app: Celery,
    s: Settings,
    clock: redis.Redis,
    engine: sa.Engine,
    task_id: uuid.UUID,
    execution: str,
    ttls: float,
) -> list[bool]:
    """Run the dispatcher's scan until Redis's clock moved ``ttls`` TTLs on; every scan must
    leave the draining run with its execution. Returns whether each scan trusted the
    heartbeats (so the test can tell the rule was really applied)."""
    until = redis_now(clock) + ttls * s.heartbeat_ttl_s
    trusted: list[bool] = []
    while redis_now(clock) < until:
        counts = run_once(app, settings=s)
        row = task_row(engine, task_id)
        assert (counts.recovered, counts.failed_recoveries) == (0, 0), counts.summary()
        assert (row["status"], str(row["execution_id"])) == ("RUNNING", execution)
        trusted.append(counts.heartbeat_rule)
    return trusted


@contextmanager
def draining_worker(
    engine: sa.Engine, world: World, s: Settings, gates: Settings, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    """w1 parks an export at its first batch (on a gate kept in ``gates.redis_url``, the
    shared Redis, whatever happens to ``s.redis_url``); the test sends SIGTERM. On the way
    out the gate is released and w1 must exit 0 having completed the run as the same
    execution."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with gated_export_worker(s, gates.redis_url, GATE, 600, task_id, tmp_path) as run:
        w1 = run.worker
        parked = run.gate.wait_reached()
        try:
            yield {
                "app": run.app,
                "w1": w1,
                "member": run.member,
                "task_id": task_id,
                "parked": parked,
            }
        finally:
            run.gate.release(times=BATCHES)
        assert w1.wait(timeout=30) == 0
    execution = parked["execution_id"]
    row = task_row(engine, task_id)
    assert (row["status"], row["attempts"], row["recoveries"]) == ("COMPLETED", 1, 0)
    assert row["result_summary"] == "1200 rows"
    assert audit_trail(engine, task_id) == [("CLAIM", execution), ("COMPLETE", execution)]
    started = [e["execution"] for e in w1.events("task.started")]
    completed = [e["execution"] for e in w1.events("task.completed")]
    assert started == completed == [execution[:8]]
    assert w1.events("task.lease_lost") == []
    assert w1.events("worker.stopped")[-1]["exit_code"] == 0


def sigterm(w1: Proc, member: str, client: redis.Redis, prefix: str) -> None:
    """Start the drain and wait until the member left the active sets (a state, observed)."""
    w1.send(signal.SIGTERM)
    w1.wait_event("worker.stopping")
    wait_for(lambda: member not in live_members(client, prefix), what="the member to leave")


def test_a_drain_many_ttls_long_keeps_its_lease_through_every_scan(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = settings.with_overrides(heartbeat_ttl_s=TTL_S)
    with draining_worker(engine, world, s, settings, tmp_path) as w:
        sigterm(w["w1"], w["member"], redis_client, s.queue_prefix)
        execution = w["parked"]["execution_id"]

        trusted = scan_through(
            w["app"], s, redis_client, engine, w["task_id"], execution, DRAIN_TTLS
        )

        assert len(trusted) >= MIN_SCANS and trusted[-1] is True, trusted
        assert w["member"] in lease_holders_alive(redis_client, s.queue_prefix)
        assert w["member"] not in live_members(redis_client, s.queue_prefix)
    assert w["member"] not in lease_holders_alive(redis_client, s.queue_prefix)


def test_a_drain_survives_a_redis_restart(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Everything in Redis is lost mid-drain: the drain registers its member again, and once
    the heartbeats can be trusted again the run is still the draining execution's."""
    with dedicated_redis() as server:
        s = settings.with_overrides(heartbeat_ttl_s=TTL_S, redis_url=server.url)
        client = server.client()
        with draining_worker(engine, world, s, settings, tmp_path) as w:
            sigterm(w["w1"], w["member"], client, s.queue_prefix)
            execution = w["parked"]["execution_id"]
            # One TTL: the drain is still within its first keys' 2 x TTL.
            scan_through(w["app"], s, redis_client, engine, w["task_id"], execution, 1)

            server.restart()
            trusted = scan_through(
                w["app"], s, redis_client, engine, w["task_id"], execution, DRAIN_TTLS
            )

            assert len(trusted) >= MIN_SCANS and trusted[-1] is True, trusted
            assert w["member"] in lease_holders_alive(client, s.queue_prefix)
        assert w["member"] not in lease_holders_alive(client, s.queue_prefix)


def test_a_drain_whose_removal_redis_refused_still_keeps_its_lease(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """At SIGTERM Redis refuses every write (out of memory, no eviction): the removal fails.
    Once Redis takes writes again the drain removes the member from the active sets and
    keeps it as a lease holder."""
    with dedicated_redis() as server:
        s = settings.with_overrides(heartbeat_ttl_s=TTL_S, redis_url=server.url)
        client = server.client()
        with draining_worker(engine, world, s, settings, tmp_path) as w:
            w1, member = w["w1"], w["member"]
            client.config_set("maxmemory", 1)  # noeviction: every write is refused
            try:
                w1.send(signal.SIGTERM)
                wait_for(
                    lambda: [
                        e for e in w1.events("heartbeat.failed") if e.get("stage") == "remove"
                    ],
                    what="the removal to fail",
                )
            finally:
                client.config_set("maxmemory", 0)
            execution = w["parked"]["execution_id"]

            trusted = scan_through(
                w["app"], s, redis_client, engine, w["task_id"], execution, DRAIN_TTLS
            )

            assert len(trusted) >= MIN_SCANS and trusted[-1] is True, trusted
            assert member in lease_holders_alive(client, s.queue_prefix)
            assert member not in live_members(client, s.queue_prefix)
        assert member not in lease_holders_alive(client, s.queue_prefix)
