"""P4: a worker SIGKILLed mid-export, with the default timings, and a real beat.
P5: SIGTERM to an idle worker: until its heartbeat member is gone, and until it exited.

P4 follows tests/process/test_kill_recovery.py: worker 1 parks the export at the remote
gate ``export.after_read`` (holding the lease), worker 2 is already running, beat runs the
scan every SCAN_INTERVAL_S. The clock starts at the SIGKILL and stops when the ledger row
is COMPLETED; the row's status is polled every 20 ms, so the moments it went back to
WAITING (recovered by a scan) and RUNNING (claimed by worker 2) are reported too.
"""

from __future__ import annotations

import signal
import statistics
import time
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from bench.env import BenchEnv, stop, wait_until
from harness.factories import add_tickets, make_world
from harness.remote_gates import RemoteGate
from ledger import service
from teamdesk.heartbeat import active_key

GATE = "export.after_read"
RECOVERY_TIMEOUT_S = 180
P5_REPEATS = 3


def _row(engine: sa.Engine, task_id: Any) -> tuple[str, str | None, int]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, lease_holder, recoveries FROM background_tasks WHERE id = :id"),
            {"id": task_id},
        ).one()
    return str(row[0]), row[1], int(row[2])


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def run_p4(env: BenchEnv) -> dict[str, Any]:
    part = env.part("p4")  # the defaults: TTL 20 s, scan 3 s, stale 120 s
    s = part.settings
    world = make_world(part.engine)
    with part.engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    gate = RemoteGate(env.redis, s.queue_prefix, GATE)
    w1 = env.worker(
        part,
        "p4-w1",
        concurrency=1,
        hooks="harness.remote_gates",
        TEAMDESK_TEST_GATES=GATE,
        TEAMDESK_TEST_GATE_TIMEOUT_S="600",
    )
    beat = env.beat(part)
    w1.wait_event("worker.started", timeout=120)
    gate.wait_reached(timeout=120)  # beat dispatched it; worker 1 holds the lease
    w2 = env.worker(part, "p4-w2", concurrency=1, hooks=None)
    w2.wait_event("worker.started", timeout=120)
    first_holder = _row(part.engine, task_id)[1]

    w1.send(signal.SIGKILL)
    killed = time.monotonic()
    w1.wait(timeout=10)
    seen: dict[str, float] = {}
    deadline = killed + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        status, holder, _ = _row(part.engine, task_id)
        now = time.monotonic() - killed
        if status == "WAITING":
            seen.setdefault("waiting_s", now)
        if status == "RUNNING" and holder != first_holder:
            seen.setdefault("claimed_by_w2_s", now)
        if status == "COMPLETED":
            seen["completed_s"] = now
            break
        time.sleep(0.02)
    status, _, recoveries = _row(part.engine, task_id)
    stop(w2)
    stop(beat)
    if "completed_s" not in seen:
        raise RuntimeError(
            f"bench: P4 export not completed after {RECOVERY_TIMEOUT_S} s ({status})"
        )
    return {
        "p4_recovery_s": round(seen["completed_s"], 2),
        "p4_detail": {
            "timings": "defaults: HEARTBEAT_TTL_S=20, SCAN_INTERVAL_S=3, STALE_AFTER_S=120",
            # None: the state lasted less than one 20 ms poll (the scan that recovers a run
            # also publishes it, and worker 2 claims it at once).
            "recovered_to_waiting_s": _rounded(seen.get("waiting_s")),
            "claimed_by_second_worker_s": _rounded(seen.get("claimed_by_w2_s")),
            "recoveries": recoveries,
            "export_rows": 1200,
        },
    }


def _log_offset(worker: Any, event: str, since_wall: float) -> float | None:
    """Seconds from ``since_wall`` to the worker's first ``event`` log line."""
    found = worker.events(event)
    if not found:
        return None
    stamp = datetime.fromisoformat(found[0]["time"].replace("Z", "+00:00")).timestamp()
    return round(stamp - since_wall, 3)


def one_idle_stop(env: BenchEnv, part: Any, name: str) -> tuple[float, float, int, Any]:
    worker = env.worker(part, name, concurrency=2, hooks=None)
    member = worker.wait_event("worker.started", timeout=120)["member"]
    key = active_key(part.prefix)
    wait_until(lambda: env.redis.zscore(key, member) is not None, 30, 0.01, "heartbeat")
    time.sleep(0.5)  # idle: nothing queued, the consumer is waiting on the broker
    sent_wall = time.time()
    worker.send(signal.SIGTERM)
    sent = time.monotonic()
    while env.redis.zscore(key, member) is not None:
        if time.monotonic() - sent > 30:
            break
        time.sleep(0.002)
    gone = time.monotonic() - sent
    code = worker.wait(timeout=60)
    exited = time.monotonic() - sent
    logged = {e: _log_offset(worker, e, sent_wall) for e in ("worker.stopping", "worker.stopped")}
    return gone, exited, code, logged


def run_p5(env: BenchEnv) -> dict[str, Any]:
    part = env.part("p5")
    samples = [one_idle_stop(env, part, f"p5-w{i}") for i in range(P5_REPEATS)]
    gone = [g for g, _, _, _ in samples]
    exited = [e for _, e, _, _ in samples]
    return {
        "p5_heartbeat_gone_s": round(statistics.median(gone), 3),
        "p5_idle_exit_s": round(statistics.median(exited), 3),
        "p5_detail": {
            "heartbeat_gone_s_all": [round(g, 3) for g in gone],
            "idle_exit_s_all": [round(e, 3) for e in exited],
            "exit_codes": [c for _, _, c, _ in samples],
            "log_lines_s_after_sigterm": [logged for _, _, _, logged in samples],
            "worker": "-c 2 prefork, idle",
        },
    }
