"""Deploy-safe stop of real ``celery -A tasks worker`` processes with real OS signals
(docs/design.md, "Shutdown"). Remote gates park a task inside the worker; the log, Redis
and the ledger decide when the test moves on, never a sleep."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from dispatcher.scan import read_heartbeats, run_once
from harness.factories import World, add_tickets, task_row
from harness.processes import Proc, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import lease, service
from ledger.errors import LeaseLost
from tasks.celery_app import create_app
from teamdesk.config import Settings
from teamdesk.heartbeat import active_key, lease_holders_alive, live_members, tombstone_key
from tests.support.queues import send_message

pytestmark = pytest.mark.slow

GATED = {
    "TEAMDESK_TEST_HOOKS": "harness.remote_gates",
    "TEAMDESK_TEST_GATES": "export.after_read",
    "TEAMDESK_TEST_GATE_TIMEOUT_S": "600",
}


def short(settings: Settings, **overrides: Any) -> Settings:
    """Shortened timings, only through configuration variables."""
    values: dict[str, Any] = {
        "stale_after_s": 2.0,
        "heartbeat_ttl_s": 2.0,
        "export_batch_size": 500,
    }
    values.update(overrides)
    return settings.with_overrides(**values)


def export(engine: sa.Engine, world: World, rows: int = 1200) -> uuid.UUID:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, rows)
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def unacked_scores(client: redis.Redis, prefix: str) -> list[float]:
    pairs = client.zrange(f"{prefix}:unacked_index", 0, -1, withscores=True)
    return [float(pair[1]) for pair in pairs]


def queue_length(client: redis.Redis, prefix: str, queue: str = "exports") -> int:
    return int(client.llen(f"{prefix}:{queue}"))


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_sigterm_drains_in_flight_export_with_its_lease(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
    pool: str,
) -> None:
    # A fixed window: the draining worker no longer offers capacity, yet the scan below
    # must publish the later run to show the stopping worker does not take it.
    s = short(settings, dispatch_window=2)
    task_id, later_id = export(engine, world), export(engine, world, rows=0)
    gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")
    app = create_app(s)
    with cluster(tmp_path) as procs:
        w1 = Proc(
            "w1", worker_argv("w1", concurrency=1, pool=pool), settings_env(s, **GATED), tmp_path
        ).start()
        procs.append(w1)
        member = w1.wait_event("worker.started")["member"]
        assert member in live_members(redis_client, s.queue_prefix, s.worker_instance_id)
        # The scan below must apply the heartbeat rule: the record is one TTL old (the
        # scan itself runs with a long STALE_AFTER_S, so only that rule can take the run).
        wait_for(
            lambda: read_heartbeats(redis_client, s.queue_prefix, s.heartbeat_ttl_s).trusted,
            what="the heartbeat record to be trusted",
        )
        send_message(app, task_id, 0, "EXPORT")
        parked = gate.wait_reached()
        assert len(unacked_scores(redis_client, s.queue_prefix)) == 1  # delivered, unacked

        signalled = time.monotonic()
        w1.send(signal.SIGTERM)
        wait_for(
            lambda: member not in live_members(redis_client, s.queue_prefix),
            timeout=5,
            what="the heartbeat member to go",
        )
        gone_after = time.monotonic() - signalled
        assert not redis_client.zscore(active_key(s.queue_prefix), member)
        assert redis_client.exists(tombstone_key(s.queue_prefix, member))
        assert w1.events("worker.stopping") and task_row(engine, task_id)["status"] == "RUNNING"

        # Draining, its lease is still alive: a dispatcher scan now does not take the run
        # back (and it publishes the later run, which the stopping worker must not take).
        assert member in lease_holders_alive(redis_client, s.queue_prefix)
        counts = run_once(app, settings=s.with_overrides(stale_after_s=600.0))
        assert (counts.heartbeat_rule, counts.recovered, counts.dispatched) == (True, 0, 1)
        held = task_row(engine, task_id)
        assert (held["status"], str(held["execution_id"])) == ("RUNNING", parked["execution_id"])
        # The in-flight message stays unacknowledged until its task ends.
        assert len(unacked_scores(redis_client, s.queue_prefix)) == 1
        assert queue_length(redis_client, s.queue_prefix) == 1  # only the later run's message
        assert task_row(engine, later_id)["status"] == "WAITING"

        gate.release(times=3)
        assert w1.wait(timeout=30) == 0
        row = task_row(engine, task_id)
        assert (row["status"], row["attempts"], row["recoveries"]) == ("COMPLETED", 1, 0)
        assert row["result_summary"] == "1200 rows"
        started = [e for e in w1.events("task.started") if e["task_id"] == str(task_id)]
        completed = [e for e in w1.events("task.completed") if e["task_id"] == str(task_id)]
        assert len(started) == len(completed) == 1
        assert started[0]["execution"] == completed[0]["execution"] == parked["execution_id"][:8]
        assert w1.events("task.lease_lost") == []
        assert w1.events("worker.stopped")[-1]["exit_code"] == 0
        assert not [e for e in w1.events("task.started") if e["task_id"] == str(later_id)]
        assert member not in lease_holders_alive(redis_client, s.queue_prefix)

        w2 = Proc(
            "w2", worker_argv("w2", concurrency=1, pool=pool), settings_env(s), tmp_path
        ).start()
        procs.append(w2)
        wait_for(
            lambda: task_row(engine, later_id)["status"] == "COMPLETED",
            what="a fresh worker to complete the later run",
        )
        assert task_row(engine, task_id) == row
        w2.send(signal.SIGTERM)
        assert w2.wait(timeout=30) == 0
    app.close()
    assert gone_after < 2.0


def test_deadline_exceeded_exits_1_and_another_worker_takes_over(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = short(settings, shutdown_timeout_s=2.0)
    task_id = export(engine, world)
    gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")
    app = create_app(s)
    with cluster(tmp_path) as procs:
        w1 = Proc(
            "w1", worker_argv("w1", concurrency=1), settings_env(s, **GATED), tmp_path
        ).start()
        procs.append(w1)
        w1.wait_event("worker.started")
        send_message(app, task_id, 0, "EXPORT")
        parked = gate.wait_reached()
        e1 = uuid.UUID(parked["execution_id"])
        w1.send(signal.SIGTERM)
        assert w1.wait(timeout=30) == 1
        assert w1.events("worker.shutdown_timeout")
        assert w1.events("worker.stopped")[-1]["exit_code"] == 1
        row = task_row(engine, task_id)
        assert (row["status"], row["execution_id"], row["progress"]) == ("RUNNING", e1, 0)

        w2 = Proc("w2", worker_argv("w2", concurrency=1), settings_env(s), tmp_path).start()
        procs.append(w2)
        wait_for(
            lambda: task_row(engine, task_id)["status"] == "COMPLETED",
            what="the second worker to take over",
        )
        taken = [e for e in w2.events("task.started") if e["task_id"] == str(task_id)]
        assert len(taken) == 1 and taken[0]["execution"] != str(e1)[:8]
        done = task_row(engine, task_id)
        assert done["result_summary"] == "1200 rows" and done["progress"] == 100
        old = lease.Lease(task_id=task_id, run=0, execution_id=e1, attempt=1)
        with pytest.raises(LeaseLost), engine.begin() as conn:
            lease.report_progress(conn, old, 50, 30.0)
        with engine.begin() as conn:
            assert lease.report_failure(conn, old, final=True, message="late") is False
        assert task_row(engine, task_id) == done
        w2.send(signal.SIGTERM)
        assert w2.wait(timeout=30) == 0
    app.close()


def test_renewal_racing_shutdown_does_not_reregister(
    settings: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    s = short(settings, heartbeat_ttl_s=20.0)
    gate = RemoteGate(redis_client, s.queue_prefix, "heartbeat.before_renewal")
    gate.release()  # the start-up renewal passes; the next one parks
    env = settings_env(
        s,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES="heartbeat.before_renewal",
    )
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
        procs.append(w1)
        first = gate.wait_reached()
        member = w1.wait_event("worker.started")["member"]
        assert first["member"] == member
        parked = gate.wait_reached()  # a renewal checked "not stopping" and is in flight
        assert parked["member"] == member
        assert member in live_members(redis_client, s.queue_prefix, s.worker_instance_id)
        w1.send(signal.SIGTERM)
        w1.wait_event("worker.stopping")
        # Removed by the stop, well before the member's TTL could expire it: the stop does
        # not wait for the renewal in flight (before, the SIGTERM handler waited for the
        # renewal thread's lock until the member had expired).
        wait_for(
            lambda: member not in live_members(redis_client, s.queue_prefix),
            timeout=s.heartbeat_ttl_s / 2,
            what="removal",
        )
        gate.release()  # the late renewal now reaches Redis
        assert w1.wait(timeout=30) == 0
    assert member not in live_members(redis_client, s.queue_prefix)
    assert member not in live_members(redis_client, s.queue_prefix, s.worker_instance_id)
    assert redis_client.zscore(active_key(s.queue_prefix, s.worker_instance_id), member) is None


def test_two_processes_in_one_scope_and_a_frozen_one(
    settings: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    s = short(settings, heartbeat_ttl_s=1.5)
    scope_key = active_key(s.queue_prefix, s.worker_instance_id)
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=1), settings_env(s), tmp_path).start()
        w2 = Proc("w2", worker_argv("w2", concurrency=1), settings_env(s), tmp_path).start()
        procs += [w1, w2]
        m1 = w1.wait_event("worker.started")["member"]
        m2 = w2.wait_event("worker.started")["member"]
        assert m1 != m2 and m1.split("/")[0] == m2.split("/")[0] == s.worker_instance_id

        def live() -> set[str]:
            return live_members(redis_client, s.queue_prefix, s.worker_instance_id)

        wait_for(lambda: live() == {m1, m2}, what="both members live")
        w1.send(signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            wait_for(lambda: live() == {m2}, timeout=10, what="the frozen member to expire")
            assert time.monotonic() - frozen_at > s.heartbeat_ttl_s / 2
        finally:
            w1.send(signal.SIGCONT)
        wait_for(lambda: live() == {m1, m2}, what="the thawed process to renew again")

        w1.send(signal.SIGTERM)
        wait_for(lambda: live() == {m2}, timeout=5, what="w1's member to go")
        assert w1.wait(timeout=30) == 0
        assert redis_client.zscore(scope_key, m2) is not None
        assert live() == {m2}
        w2.send(signal.SIGTERM)
        assert w2.wait(timeout=30) == 0
    assert live_members(redis_client, s.queue_prefix, s.worker_instance_id) == set()


def test_idle_worker_exits_0_without_waiting_out_its_drain_budget(
    settings: Settings, tmp_path: Path
) -> None:
    """SIGTERM to an idle worker: it exits 0 at once, not after SHUTDOWN_TIMEOUT_S (75 s).
    How fast is a speed target, measured by make bench (P5 ``p5_idle_exit_s`` <= 3 s), not
    here: a slower machine must not fail this test."""
    assert settings.shutdown_timeout_s >= 60
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=2), settings_env(settings), tmp_path).start()
        procs.append(w1)
        w1.wait_event("worker.started")
        w1.send(signal.SIGTERM)
        assert w1.wait(timeout=30) == 0  # far under the drain budget
    assert w1.events("worker.stopped")[-1]["exit_code"] == 0
    assert w1.events("worker.shutdown_timeout") == []


@pytest.mark.parametrize("where", ["start", "stop"])
def test_unhandled_error_logs_fatal_and_exits_1(
    settings: Settings, tmp_path: Path, where: str
) -> None:
    """An error Celery only logs - unrecoverable at start, or a failure while stopping -
    still ends the process with exit code 1, never a final 0."""
    env = settings_env(
        settings, TEAMDESK_TEST_HOOKS="harness.remote_gates", TEAMDESK_TEST_CRASH=where
    )
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
        procs.append(w1)
        if where == "stop":
            w1.wait_event("worker.started")
            w1.send(signal.SIGTERM)
        assert w1.wait(timeout=30) == 1
    lines = w1.lines()
    levels = {line["level"] for line in lines if "injected" in str(line.get("message", ""))}
    assert levels == ({"fatal"} if where == "start" else {"error"})
    assert lines[-1]["event"] == "worker.stopped" and lines[-1]["exit_code"] == 1
    assert lines[-1]["level"] == "error"


def test_a_cold_shutdown_stops_renewing_and_stays_a_holder_until_it_expires(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """SIGQUIT (Celery's cold shutdown, the blueprint's ``terminate``): the worker leaves
    the active sets at once and no renewal puts it back; it stays a lease holder, which
    expires one TTL on (its pool's children are stopped after its liveness step)."""
    # The holder is read after the process is gone: a TTL well above a slow exit's length.
    s = settings.with_overrides(heartbeat_ttl_s=5.0)
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=2), settings_env(s), tmp_path).start()
        procs.append(w1)
        member = w1.wait_event("worker.started")["member"]
        assert live_members(redis_client, s.queue_prefix) == {member}
        w1.send(signal.SIGQUIT)
        code = w1.wait(timeout=30)
    assert live_members(redis_client, s.queue_prefix) == set()
    assert member in lease_holders_alive(redis_client, s.queue_prefix)
    assert redis_client.get(tombstone_key(s.queue_prefix, member)) == "draining"
    wait_for(
        lambda: member not in lease_holders_alive(redis_client, s.queue_prefix),
        timeout=30,
        what="the holder to expire",
    )
    assert code == 0  # Celery's cold shutdown; it sends no worker_shutdown (no worker.stopped)
    assert w1.events("heartbeat.failed") == []
