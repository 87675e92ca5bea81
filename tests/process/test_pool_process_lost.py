"""A pool process killed mid-export (the OOM killer's SIGKILL) while its worker lives on:
the worker's main process sees it die and writes the run's failed attempt at once, so the
same run is claimed again within seconds - not after Celery's 180 s re-send countdown or
the 120 s staleness rule, and never as a recovery. A run whose every attempt loses its
process ends FAILED after MAX_TASK_ATTEMPTS, saying why."""

from __future__ import annotations

import dataclasses
import os
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

pytestmark = pytest.mark.slow

GATE = "export.after_read"
# Far below what the run waited before (Celery's re-send: 180 s; the staleness rule: 120
# s), far above what it takes (about 2 s: the backoff, then the dispatcher's publish).
CLAIMED_AGAIN_WITHIN_S = 30.0


def audit_trail(engine: sa.Engine, task_id: uuid.UUID) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT event, execution_id::text FROM task_audit WHERE task_id = :id ORDER BY id"
            ),
            {"id": task_id},
        ).all()
    return [(event, execution) for event, execution in rows]


def start_cluster(procs: list[Proc], settings: Settings, tmp_path: Path) -> tuple[Proc, Proc]:
    gated = settings_env(
        settings,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES=GATE,
        TEAMDESK_TEST_GATE_TIMEOUT_S="300",
    )
    worker = Proc("w1", worker_argv("w1", concurrency=1), gated, tmp_path).start()
    beat = Proc("beat", celery_argv("beat"), settings_env(settings), tmp_path).start()
    procs += [worker, beat]
    worker.wait_event("worker.started")
    return worker, beat


def test_a_killed_pool_process_is_a_failed_attempt_claimed_again_in_seconds(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = settings  # the defaults: MAX_TASK_ATTEMPTS=3, RETRY_BASE_DELAY_S=2, STALE_AFTER_S=120
    assert (s.max_task_attempts, s.retry_base_delay_s, s.stale_after_s) == (3, 2.0, 120.0)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    gate = RemoteGate(redis_client, s.queue_prefix, GATE)
    with cluster(tmp_path) as procs:
        worker, beat = start_cluster(procs, s, tmp_path)
        first = gate.wait_reached(timeout=60)
        assert first["task_id"] == str(task_id) and first["pid"] != worker.pid
        os.kill(first["pid"], signal.SIGKILL)  # the pool process, not the worker
        killed = time.monotonic()
        lost = worker.wait_event("task.process_lost")
        seen_s = time.monotonic() - killed
        second = gate.wait_reached(timeout=120)  # the same run, claimed again
        claimed_again_s = time.monotonic() - killed
        parked = task_row(engine, task_id)
        gate.release(times=10)  # one per batch of the export
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="completion")
    print(
        f"lost process reported {seen_s:.2f} s, claimed again {claimed_again_s:.2f} s "
        "after the kill"
    )
    assert claimed_again_s < CLAIMED_AGAIN_WITHIN_S
    # The second attempt of the same run, in a new pool process of the same worker.
    assert (second["task_id"], second["run"]) == (str(task_id), 0)
    assert second["pid"] not in (first["pid"], worker.pid)
    assert (parked["status"], parked["attempts"], parked["recoveries"]) == ("RUNNING", 2, 0)
    assert parked["last_error"] == (
        f"The worker process running the task was lost (pid {first['pid']}, "
        "signal 9 (SIGKILL)); the task will be retried."
    )
    done = task_row(engine, task_id)
    assert (done["attempts"], done["recoveries"], done["last_error"]) == (2, 0, None)
    assert done["result_summary"] == "1200 rows"
    assert audit_trail(engine, task_id) == [
        ("CLAIM", first["execution_id"]),
        ("WAIT", first["execution_id"]),
        ("CLAIM", second["execution_id"]),
        ("COMPLETE", second["execution_id"]),
    ]
    assert lost["task_id"] == str(task_id) and lost["pool_pid"] == first["pid"]
    assert (lost["outcome"], lost["attempt"], lost["exit"]) == (
        "retry",
        1,
        "signal 9 (SIGKILL)",
    )
    assert lost["execution"] == first["execution_id"][:8]
    assert beat.events("task.stalled") == []  # never the staleness rule
    assert worker.events("task.failed") == []  # the queue's failure callback stays quiet


def test_a_run_that_loses_its_process_every_attempt_ends_failed_with_the_reason(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = dataclasses.replace(settings, retry_base_delay_s=0.1)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 600)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    gate = RemoteGate(redis_client, s.queue_prefix, GATE)
    pids = []
    with cluster(tmp_path) as procs:
        worker, beat = start_cluster(procs, s, tmp_path)
        for _ in range(s.max_task_attempts):
            reached = gate.wait_reached(timeout=60)
            pids.append(reached["pid"])
            os.kill(reached["pid"], signal.SIGKILL)
        wait_for(lambda: task_row(engine, task_id)["status"] == "FAILED", what="the run FAILED")
        lost = worker.wait_event("task.process_lost", count=s.max_task_attempts)
        assert len(worker.events("task.process_lost")) == s.max_task_attempts
    row = task_row(engine, task_id)
    assert (row["attempts"], row["recoveries"], row["result_csv"]) == (3, 0, None)
    assert row["last_error"] == (
        "The task failed after 3 attempts; the worker process running the last one was lost "
        f"(pid {pids[-1]}, signal 9 (SIGKILL))."
    )
    outcomes = [e["outcome"] for e in worker.events("task.process_lost")]
    assert outcomes == ["retry", "retry", "failed"] and lost["attempt"] == 3
    assert [event for event, _ in audit_trail(engine, task_id)] == [
        "CLAIM",
        "WAIT",
        "CLAIM",
        "WAIT",
        "CLAIM",
        "FAIL",
    ]
    assert beat.events("task.stalled") == []
    assert len(set(pids)) == 3


def test_a_pool_process_lost_before_its_claim_leaves_the_run_to_be_published_again(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The process died after it took the message and before its claim committed: its
    execution holds no lease, so nothing is written (``not_held``); the dispatcher sees
    that the broker no longer holds the run's message, publishes it again, and the run
    completes as its first attempt."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 10)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    gate = RemoteGate(redis_client, settings.queue_prefix, "task.before_claim")
    env = settings_env(
        settings,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES="task.before_claim",
        TEAMDESK_TEST_GATE_TIMEOUT_S="300",
    )
    with cluster(tmp_path) as procs:
        worker = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
        beat = Proc("beat", celery_argv("beat"), settings_env(settings), tmp_path).start()
        procs += [worker, beat]
        worker.wait_event("worker.started")
        first = gate.wait_reached(timeout=60)
        before = task_row(engine, task_id)
        os.kill(first["pid"], signal.SIGKILL)
        lost = worker.wait_event("task.process_lost")
        gate.release()  # the next delivery's claim goes through
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="completion")
    assert (before["status"], before["attempts"]) == ("WAITING", 0)
    assert (lost["outcome"], lost["pool_pid"], lost["task_id"]) == (
        "not_held",
        first["pid"],
        str(task_id),
    )
    done = task_row(engine, task_id)
    assert (done["attempts"], done["recoveries"], done["result_summary"]) == (1, 0, "10 rows")
    assert [event for event, _ in audit_trail(engine, task_id)] == ["CLAIM", "COMPLETE"]
    assert beat.events("task.stalled") == []


def test_a_sigterm_to_the_whole_process_group_fails_no_attempt(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """systemd's default stop (``KillMode=control-group``) or ``kill -TERM -<pgid>`` ends
    the pool's processes along with the worker's warm stop. Their runs are interrupted by
    the stop, not lost: no ``task.process_lost``, no attempt counted; the heartbeat's
    expiry hands the run to the dispatcher."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    gate = RemoteGate(redis_client, settings.queue_prefix, GATE)
    with cluster(tmp_path) as procs:
        worker, _beat = start_cluster(procs, settings, tmp_path)
        gate.wait_reached(timeout=60)
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=60)
        stopped = worker.wait_event("worker.stopped")
    row = task_row(engine, task_id)
    assert worker.events("task.process_lost") == []
    assert stopped["exit_code"] in (0, 1)
    assert (row["status"], row["attempts"], row["recoveries"]) == ("RUNNING", 1, 0)
    assert row["last_error"] is None
    assert [event for event, _ in audit_trail(engine, task_id)] == ["CLAIM"]
