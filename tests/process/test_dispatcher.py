"""The dispatcher as platform teams run it: real ``celery -A tasks beat`` and ``worker``
subprocesses, real signals (docs/design.md, "Dispatch").

- workers split by queue (``-Q exports`` / ``-Q reminders``) plus beat run everything, and
  a queue nobody consumes is reported by the dispatcher, the CLI and the API;
- a standby beat takes over from a SIGKILLed leader, and at once from a SIGTERMed one;
- a beat SIGKILLed in the middle of a publish (between its stamp and its send) strands
  nothing;
- a Redis restart (broker, results, heartbeats, the lock: all lost) costs seconds, and no
  process exits;
- a dispatcher and a worker whose clocks are 150 s off never take a live lease, and
  scheduled reminders start on the database's time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from dispatcher.leader import leader_key
from harness.clock_skew import skewed_env
from harness.factories import World, add_ticket, add_tickets, task_row
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from tests.support.redis_server import dedicated_redis

pytestmark = pytest.mark.slow

FAST = {"scan_interval_s": 0.5, "heartbeat_ttl_s": 3.0}
GATES = "harness.remote_gates"


def fast(settings: Settings, **overrides: Any) -> Settings:
    return settings.with_overrides(**{**FAST, **overrides})


def export(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def reminder(engine: sa.Engine, world: World, in_s: float = 0.0) -> tuple[uuid.UUID, Any]:
    """A reminder due ``in_s`` from now by the database's clock; returns it and run_at."""
    with engine.begin() as conn:
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Call back", assignee_id=world.staff2_id
        )
        run_at = conn.execute(
            sa.text("SELECT now() + make_interval(secs => :s)"), {"s": in_s}
        ).scalar_one()
        task_id = service.create_reminder(conn, world.team_id, world.staff_id, ticket, run_at)
    return task_id, run_at


def audit(engine: sa.Engine, task_id: uuid.UUID) -> list[tuple[str, Any]]:
    with engine.connect() as conn:
        return [
            (r.event, r.at)
            for r in conn.execute(
                sa.text("SELECT event, at FROM task_audit WHERE task_id = :t ORDER BY id"),
                {"t": task_id},
            )
        ]


def events_of(engine: sa.Engine, task_id: uuid.UUID) -> list[str]:
    return [event for event, _ in audit(engine, task_id)]


def status(engine: sa.Engine, task_id: uuid.UUID) -> str:
    return str(task_row(engine, task_id)["status"])


def health_cluster(s: Settings) -> tuple[int, dict[str, Any]]:
    env = settings_env(s)
    command = [str(Path(sys.executable).parent / "teamdesk-tasks"), "health", "--cluster"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def seeded(engine: sa.Engine, world: World) -> World:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 30)
    return world


def test_workers_split_by_queue_and_one_beat_run_everything_and_a_missing_role_is_loud(
    engine: sa.Engine, seeded: World, settings: Settings, tmp_path: Path
) -> None:
    s = fast(settings)
    env = settings_env(s)
    with cluster(tmp_path) as procs:
        exporter = Proc("exp", worker_argv("exp", queues="exports"), env, tmp_path).start()
        reminder_worker = Proc("rem", worker_argv("rem", queues="reminders"), env, tmp_path)
        beat = Proc("beat", celery_argv("beat"), env, tmp_path)
        procs += [exporter, reminder_worker.start(), beat.start()]
        exporter.wait_event("worker.started", timeout=60)
        reminder_worker.wait_event("worker.started", timeout=60)
        beat.wait_event("dispatcher.leader", timeout=60)
        task_export = export(engine, seeded)
        task_reminder, _ = reminder(engine, seeded)
        wait_for(
            lambda: status(engine, task_export) == status(engine, task_reminder) == "COMPLETED",
            timeout=30,
            what="the export and the reminder to complete",
        )
        wait_for(lambda: health_cluster(s)[0] == 0, timeout=10, what="every role present")

        reminder_worker.send(signal.SIGTERM)
        assert reminder_worker.wait(timeout=30) == 0
        waiting, _ = reminder(engine, seeded)
        warning = beat.wait_event("dispatcher.no_consumers", timeout=30)
        assert warning["queue"] == "reminders" and warning["level"] == "warn"
        code, printed = health_cluster(s)
        assert (code, printed["missing"]) == (1, ["reminders worker"])
        assert (status(engine, waiting), task_row(engine, waiting)["dispatched_at"]) == (
            "WAITING",
            None,
        )

        again = Proc("rem2", worker_argv("rem2", queues="reminders"), env, tmp_path).start()
        procs.append(again)
        wait_for(lambda: status(engine, waiting) == "COMPLETED", timeout=30, what="the reminder")
    assert events_of(engine, waiting) == ["CLAIM", "COMPLETE"]


@pytest.mark.alone  # the takeover within the lock's TTL + 2 s
def test_a_standby_beat_takes_over_from_a_killed_leader_and_at_once_from_a_stopped_one(
    engine: sa.Engine,
    seeded: World,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    s = fast(settings)
    env = settings_env(s)
    key = leader_key(s.queue_prefix)
    with cluster(tmp_path) as procs:
        worker = Proc("w", worker_argv("w"), env, tmp_path).start()
        first = Proc("beat1", celery_argv("beat"), env, tmp_path).start()
        procs += [worker, first]
        worker.wait_event("worker.started", timeout=60)
        assert first.wait_event("dispatcher.leader", timeout=60)["role"] == "leader"
        second = Proc("beat2", celery_argv("beat"), env, tmp_path).start()
        procs.append(second)
        assert second.wait_event("dispatcher.leader", timeout=60)["role"] == "standby"
        ttl_ms = redis_client.pttl(key)
        assert 0 < ttl_ms <= 3000  # 5 scan intervals of 0.5 s, at least 2 s

        first.send(signal.SIGKILL)  # no chance to release the lock
        first.wait(timeout=10)
        killed = time.monotonic()
        second.wait_event("dispatcher.leader", timeout=30, count=2)
        took_over = time.monotonic() - killed
        task_id = export(engine, seeded)
        wait_for(lambda: status(engine, task_id) == "COMPLETED", timeout=30, what="COMPLETED")

        third = Proc("beat3", celery_argv("beat"), env, tmp_path).start()
        procs.append(third)
        assert third.wait_event("dispatcher.leader", timeout=60)["role"] == "standby"
        second.send(signal.SIGTERM)
        stopped = time.monotonic()
        assert second.wait(timeout=30) == 0
        third.wait_event("dispatcher.leader", timeout=30, count=2)
        handed_over = time.monotonic() - stopped
        later = export(engine, seeded)
        wait_for(lambda: status(engine, later) == "COMPLETED", timeout=30, what="COMPLETED")
    assert took_over <= 3 + 2  # the lock's TTL, then the standby's next try
    assert handed_over < 2.5  # released on SIGTERM: the standby's next try takes it
    assert events_of(engine, task_id) == events_of(engine, later) == ["CLAIM", "COMPLETE"]


def test_a_beat_killed_in_the_middle_of_a_publish_strands_nothing(
    engine: sa.Engine,
    seeded: World,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    """The first beat stamps the run and stops before the send; it is SIGKILLed there. A
    new beat completes the run, which is claimed exactly once."""
    point = "dispatcher.before_publish"
    s = fast(settings)
    gate = RemoteGate(redis_client, s.queue_prefix, point)
    gated = settings_env(s, TEAMDESK_TEST_HOOKS=GATES, TEAMDESK_TEST_GATES=point)
    with cluster(tmp_path) as procs:
        worker = Proc("w", worker_argv("w"), settings_env(s), tmp_path).start()
        procs.append(worker)
        worker.wait_event("worker.started", timeout=60)
        task_id = export(engine, seeded)
        first = Proc("beat1", celery_argv("beat"), gated, tmp_path).start()
        procs.append(first)
        parked = gate.wait_reached(timeout=60)
        assert parked["task_ids"] == [str(task_id)]
        assert task_row(engine, task_id)["dispatched_at"] is not None  # stamped
        first.send(signal.SIGKILL)
        first.wait(timeout=10)
        second = Proc("beat2", celery_argv("beat"), settings_env(s), tmp_path).start()
        procs.append(second)
        wait_for(lambda: status(engine, task_id) == "COMPLETED", timeout=60, what="COMPLETED")
    assert events_of(engine, task_id) == ["CLAIM", "COMPLETE"]


def test_a_redis_restart_costs_seconds_and_no_process_exits(
    engine: sa.Engine, seeded: World, settings: Settings, tmp_path: Path
) -> None:
    """Broker, results, heartbeats and the leader lock live in one Redis without
    persistence. With the worker frozen the window fills up; Redis restarts (down 2 s) and
    the window's messages are gone. The dispatcher publishes them again and every task
    completes, each exactly once, within seconds of Redis answering; no process exits."""
    with dedicated_redis() as server:
        s = fast(settings, redis_url=server.url, broker_url=server.url)
        env = settings_env(s)
        with engine.begin() as conn:
            ticket = add_ticket(conn, seeded.team_id, seeded.customer_id, "Done", status="CLOSED")
            rows = list(
                conn.execute(
                    sa.text("""
                    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)
                    SELECT 'REMINDER', :team, :owner, 'TEAM', jsonb_build_object('ticket_id', :t)
                      FROM generate_series(1, 250)
                    RETURNING id"""),
                    {"team": seeded.team_id, "owner": seeded.staff_id, "t": str(ticket)},
                ).scalars()
            )
        queue = server.client()
        with cluster(tmp_path) as procs:
            worker = Proc("w", worker_argv("w", concurrency=2), env, tmp_path).start()
            beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
            procs += [worker, beat]
            wait_for(lambda: finished(engine, rows) >= 20, timeout=60, what="the drain to start")
            worker.send(signal.SIGSTOP)
            try:
                wait_for(
                    lambda: waiting_in_broker(engine, rows) >= 4,
                    what="the window (two or more per worker process) to fill up",
                )
                # Messages on the list are lost with the restart; those the frozen worker
                # had already taken (prefetched) survive in its memory and need no publish.
                lost = queue.llen(f"{s.queue_prefix}:reminders")
                assert lost >= 1
                server.restart(down_s=2.0)
                answered = time.monotonic()
            finally:
                worker.send(signal.SIGCONT)
            wait_for(
                lambda: finished(engine, rows) == len(rows),
                timeout=60,
                interval=0.1,
                what="every task to complete",
            )
            done_in = time.monotonic() - answered
            assert worker.popen is not None and worker.popen.poll() is None
            assert beat.popen is not None and beat.popen.poll() is None
        redispatched = sum(e.get("redispatched", 0) for e in beat.events("dispatcher.scan"))
        assert len(beat.events("dispatcher.recovered")) == 1
    with engine.connect() as conn:
        counts = conn.execute(
            sa.text("""
            SELECT count(*) FILTER (WHERE event = 'COMPLETE'), count(DISTINCT task_id)
              FROM task_audit WHERE task_id = ANY(:ids)"""),
            {"ids": rows},
        ).one()
    assert tuple(counts) == (250, 250)  # each completed exactly once
    assert redispatched >= lost  # the lost messages were published again
    print(f"all {len(rows)} completed {done_in:.1f} s after Redis answered again")
    assert done_in < 30, done_in


def waiting_in_broker(engine: sa.Engine, rows: list[uuid.UUID]) -> int:
    """Runs published and not yet claimed (the window, as the ledger sees it)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM background_tasks WHERE id = ANY(:ids) "
                    "AND status = 'WAITING' AND dispatched_at IS NOT NULL"
                ),
                {"ids": rows},
            ).scalar_one()
        )


def finished(engine: sa.Engine, rows: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM background_tasks WHERE id = ANY(:ids) "
                    "AND status = 'COMPLETED'"
                ),
                {"ids": rows},
            ).scalar_one()
        )


@pytest.mark.parametrize(("beat_skew", "worker_skew"), [(150, -150), (-150, 150)])
def test_skewed_clocks_never_take_a_live_lease_and_reminders_start_on_database_time(
    engine: sa.Engine,
    seeded: World,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
    beat_skew: int,
    worker_skew: int,
) -> None:
    """STALE_AFTER_S 20 and scans every 0.5 s: a host clock 150 s off in either direction
    would call the parked export's lease stale at once (or never start the reminder for
    150 s). With every threshold on the database's clock neither happens."""
    s = fast(settings, stale_after_s=20.0)
    gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")
    worker_env = settings_env(s, TEAMDESK_TEST_HOOKS=GATES, TEAMDESK_TEST_GATES="export.after_read")
    started = datetime.now(UTC)
    with cluster(tmp_path) as procs:
        worker = Proc(
            "w", worker_argv("w", concurrency=2), skewed_env(worker_env, worker_skew), tmp_path
        ).start()
        beat = Proc(
            "beat", celery_argv("beat"), skewed_env(settings_env(s), beat_skew), tmp_path
        ).start()
        procs += [worker, beat]
        worker.wait_event("worker.started", timeout=60)
        task_id = export(engine, seeded)
        parked = gate.wait_reached(timeout=60)
        due, run_at = reminder(engine, seeded, in_s=2.0)
        # Ahead by the database's clock: scheduled, out of the ready set until a fill of
        # the skewed dispatcher promotes it.
        assert task_row(engine, due)["scheduled"] is True
        # Scans every 0.5 s ran while the reminder waited for its time (2 s or more) and
        # the export stayed parked.
        wait_for(lambda: status(engine, due) == "COMPLETED", timeout=30, what="the reminder")
        held = task_row(engine, task_id)
        assert (held["status"], str(held["execution_id"])) == ("RUNNING", parked["execution_id"])
        gate.release(times=5)
        wait_for(lambda: status(engine, task_id) == "COMPLETED", timeout=30, what="the export")
    for proc, skew in ((beat, beat_skew), (worker, worker_skew)):  # the clocks were off
        logged = datetime.fromisoformat(
            proc.events("dispatcher.leader" if proc is beat else "worker.started")[0]["time"]
        )
        assert abs((logged - started).total_seconds() - skew) < 30, (proc.name, logged)
    assert events_of(engine, task_id) == ["CLAIM", "COMPLETE"]  # never recovered
    claim_at = dict(audit(engine, due))["CLAIM"]
    assert claim_at >= run_at  # never early by the skew
    assert beat.events("task.stalled") == []


def _request_unread_by(port: int) -> bool:
    """A request sits in the receive queue of the server listening on ``port``: it was
    sent, and the (frozen) server has not read it, so its client waits for the answer."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, queues = line.split()[1], line.split()[4]
        if int(local.split(":")[1], 16) == port and int(queues.split(":")[1], 16) > 0:
            return True
    return False


def test_sigterm_while_beat_waits_on_a_frozen_redis_stops_it_cleanly(
    settings: Settings, tmp_path: Path
) -> None:
    """SIGTERM lands while the dispatcher waits inside a Redis read (its Redis frozen by
    SIGSTOP, the request seen unread in the server's receive queue; beat is Redis's only
    client): beat stops with exit 0 once Redis answers again. With
    Celery's handler, which raises ``SystemExit`` inside the read, redis-py's clean-up
    failed ("I/O operation on closed file") and beat exited 1 (a CI run failed so)."""
    with dedicated_redis() as server:
        s = fast(settings, redis_url=server.url, broker_url=server.url)
        with cluster(tmp_path) as procs:
            beat = Proc("beat", celery_argv("beat"), settings_env(s), tmp_path).start()
            procs.append(beat)
            beat.wait_event("dispatcher.leader", timeout=60)
            server.process.send_signal(signal.SIGSTOP)
            try:
                wait_for(
                    lambda: _request_unread_by(server.port),
                    timeout=30,
                    what="beat waiting for the frozen Redis's answer",
                )
                beat.send(signal.SIGTERM)
            finally:
                server.process.send_signal(signal.SIGCONT)
            assert beat.wait(timeout=60) == 0, beat.output()[-3000:]
        assert "I/O operation on closed file" not in beat.output()
        assert not [line for line in beat.output().splitlines() if '"level": "fatal"' in line]
