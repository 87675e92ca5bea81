"""A Redis that refuses writes (``maxmemory`` reached with ``noeviction``) must not stop a
worker: it keeps running and takes work again once Redis accepts writes.

A real ``celery worker`` subprocess whose broker, result backend and heartbeats are a
dedicated ``redis-server``. An export is parked at a gate (kept on the shared Redis, which
is never squeezed), Redis is made to refuse every write, the gate is released: the run
completes in the ledger, then storing its result and acknowledging its message are refused.
Before ``broker_channel_error_retry`` Celery took the refused acknowledgement for an
unrecoverable error and the worker exited 1 (found by the soak's memory squeeze).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import sqlalchemy as sa

from harness.factories import World, add_tickets, audit_events, task_row
from harness.processes import Proc
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from tests.support.gated_worker import gated_export_worker
from tests.support.queues import send_message
from tests.support.redis_server import dedicated_redis

pytestmark = pytest.mark.slow

GATE = "export.after_read"


def refused_write_logged(w1: Proc) -> bool:
    """The worker met the refused acknowledgement (kombu removes the message from its
    ``unacked_index``): its consumer reconnects, or (before the fix) the worker stops."""
    out = w1.output()
    return "Trying to reconnect" in out or "ZREM" in out or not alive(w1)


def alive(proc: Proc) -> bool:
    return proc.popen is not None and proc.popen.poll() is None


def test_a_worker_outlives_a_redis_that_refuses_writes(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 5)
        first = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        second = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with dedicated_redis() as server:
        s = settings.with_overrides(redis_url=server.url, broker_url=server.url)
        client = server.client()
        with gated_export_worker(s, settings.redis_url, GATE, 120, first, tmp_path) as run:
            gate, w1 = run.gate, run.worker
            gate.wait_reached()
            try:
                client.config_set("maxmemory", 1)  # noeviction: every write is refused
                gate.release()
                w1.wait_event("task.completed")
                wait_for(lambda: refused_write_logged(w1), what="the refused acknowledgement")
            finally:
                client.config_set("maxmemory", 0)
                gate.release(times=5)

            assert alive(w1), w1.output()[-4000:]
            assert "Unrecoverable error" not in w1.output()
            send_message(run.app, second, 0, "EXPORT")
            gate.wait_reached()
            gate.release()
            wait_for(lambda: task_row(engine, second)["status"] == "COMPLETED", timeout=60)

            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0

    for task_id in (first, second):
        row = task_row(engine, task_id)
        assert (row["status"], row["attempts"], row["result_summary"]) == (
            "COMPLETED",
            1,
            "5 rows",
        )
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    assert [e["task_id"] for e in w1.events("task.completed")] == [str(first), str(second)]
    assert w1.events("worker.stopped")[-1]["exit_code"] == 0
