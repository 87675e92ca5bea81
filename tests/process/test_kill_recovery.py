"""A worker SIGKILLed mid-export, with default timings: its heartbeat member expires, the
scan that beat schedules takes the run back, and another worker completes it in under
HEARTBEAT_TTL_S + 2 x SCAN_INTERVAL_S - instead of the 120 s staleness rule or the broker's
visibility timeout."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, task_row
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from teamdesk.heartbeat import live_members

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # its bound: TTL + 2 scans


def test_sigkilled_worker_is_taken_over_fast(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = settings  # the defaults: HEARTBEAT_TTL_S=20, SCAN_INTERVAL_S=3, STALE_AFTER_S=120
    assert (s.heartbeat_ttl_s, s.scan_interval_s, s.stale_after_s) == (20.0, 3.0, 120.0)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")
    gated = settings_env(
        s,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES="export.after_read",
        TEAMDESK_TEST_GATE_TIMEOUT_S="600",
    )
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=1), gated, tmp_path).start()
        beat = Proc("beat", celery_argv("beat"), settings_env(s), tmp_path).start()
        procs += [w1, beat]
        m1 = w1.wait_event("worker.started")["member"]
        parked = gate.wait_reached(timeout=60)  # beat's scan dispatched it; w1 holds it
        row = task_row(engine, task_id)
        assert (row["status"], row["lease_holder"]) == ("RUNNING", m1)
        w2 = Proc("w2", worker_argv("w2", concurrency=1), settings_env(s), tmp_path).start()
        procs.append(w2)
        w2.wait_event("worker.started")

        w1.send(signal.SIGKILL)
        killed = time.monotonic()
        w1.wait(timeout=10)
        wait_for(
            lambda: task_row(engine, task_id)["status"] == "COMPLETED",
            timeout=60,
            interval=0.1,
            what="another worker to complete the run",
        )
        recovered_in = time.monotonic() - killed
        wait_for(lambda: m1 not in live_members(redis_client, s.queue_prefix), what="expiry")
    done = task_row(engine, task_id)
    assert (done["recoveries"], done["attempts"], done["result_summary"]) == (1, 1, "1200 rows")
    taken = [e for e in w2.events("task.started") if e["task_id"] == str(task_id)]
    assert len(taken) == 1 and taken[0]["execution"] != parked["execution_id"][:8]
    stalled = [e for e in beat.events("task.stalled") if e["task_id"] == str(task_id)]
    assert len(stalled) == 1
    assert uuid.UUID(parked["execution_id"])
    print(f"recovered {recovered_in:.1f} s after SIGKILL")
    assert recovered_in < s.heartbeat_ttl_s + 2 * s.scan_interval_s
