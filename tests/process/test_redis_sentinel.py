"""Redis under Sentinel (docs/design.md, "Topologies"): the broker, the results, the
heartbeats and the leader lock all reach Redis through its sentinels
(``REDIS_URL`` = ``BROKER_URL`` = ``sentinel://...;sentinel://...``, ``REDIS_SENTINEL_MASTER``),
and a failover costs seconds: every task completes once, no process exits.

A private group (soak/sentinel.py, shared with the soak: a master, one replica, three real
sentinels) serves two real workers and a real beat. 100 exports and 100 reminders are
created; every export parks at its first batch (a remote gate, kept in the shared Redis,
not the one failed over), so when the four worker processes are all parked, four exports
are mid-run and the rest of the work is queued or in the broker. Then the master is
killed (SIGKILL: what it had not replicated is lost) and the sentinels promote the
replica; the parked exports are let go. Asynchronous replication may have lost the
newest messages and acknowledgements: the ledger's scan publishes what the
broker no longer holds, and the lease refuses any second execution of a run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from harness.factories import (
    World,
    add_ticket,
    add_tickets,
    audit_events,
    notifications,
    task_row,
)
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import GATE_REDIS_ENV, RemoteGate
from harness.waiting import wait_for
from ledger import service
from soak.sentinel import MASTER_NAME, sentinel_group
from teamdesk.config import Settings
from tests.process.test_shutdown import GATED

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXPORTS = REMINDERS = 100
TICKETS = 5
PROCESSES = 4  # two workers, -c 2
DONE_WITHIN_S = 90.0  # detects a miss; a failover costs seconds


Reminders = dict[uuid.UUID, uuid.UUID]  # reminder -> its ticket


def create_work(engine: sa.Engine, world: World) -> tuple[list[uuid.UUID], Reminders]:
    """The exports, and each reminder with its ticket (open, assigned to staff)."""
    reminders: Reminders = {}
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, TICKETS)
        tickets = [
            add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff2_id)
            for _ in range(REMINDERS)
        ]
    with engine.begin() as conn:
        exports = [
            service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
            for _ in range(EXPORTS)
        ]
        for ticket in tickets:
            task_id = service.create_reminder(conn, world.team_id, world.staff_id, ticket)
            reminders[task_id] = ticket
    return exports, reminders


def ticket_versions(engine: sa.Engine, tickets: list[uuid.UUID]) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT version FROM tickets WHERE id = ANY(:ids)"), {"ids": tickets}
        )
        return [int(version) for (version,) in rows]


def statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM background_tasks GROUP BY 1"))
        return {status: int(n) for status, n in rows}


def test_a_master_failover_while_200_tasks_run_costs_seconds(
    settings: Settings,
    engine: sa.Engine,
    world: World,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    exports, reminders = create_work(engine, world)
    with sentinel_group() as group:
        s = settings.with_overrides(
            redis_url=group.url(),
            broker_url=group.url(),
            redis_sentinel_master=MASTER_NAME,
            scan_interval_s=1.0,
        )
        gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")
        env = settings_env(s, **GATED, **{GATE_REDIS_ENV: settings.redis_url})
        with cluster(tmp_path) as procs:
            try:
                w1 = Proc("w1", worker_argv("w1", concurrency=2), env, tmp_path).start()
                w2 = Proc("w2", worker_argv("w2", concurrency=2), env, tmp_path).start()
                beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
                procs += [w1, w2, beat]
                parked = [gate.wait_reached(timeout=60) for _ in range(PROCESSES)]
                assert len({p["execution_id"] for p in parked}) == PROCESSES
                group.kill_master()
            finally:
                gate.release(times=EXPORTS * 2)
            wait_for(
                lambda: statuses(engine) == {"COMPLETED": EXPORTS + REMINDERS},
                timeout=DONE_WITHIN_S,
                what="every task to complete after the failover",
            )
            health = subprocess.run(
                [sys.executable, "-m", "cli.main", "health", "--cluster"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert health.returncode == 0, health.stdout + health.stderr
            assert [proc.popen.poll() for proc in procs] == [None, None, None]  # type: ignore[union-attr]
            for worker in (w1, w2):
                worker.send(signal.SIGTERM)
            assert [w1.wait(timeout=60), w2.wait(timeout=60)] == [0, 0]
    # Once: one completion per task, one notification and one ticket version per
    # reminder; nothing failed, nothing taken back from a live holder.
    for task_id in [*exports, *reminders]:
        events = audit_events(engine, task_id)
        assert events.count("COMPLETE") == 1, (task_id, events)
        assert "RECOVER" not in events and "FAIL" not in events, (task_id, events)
    for task_id in exports:
        assert task_row(engine, task_id)["result_summary"] == f"{TICKETS + REMINDERS} rows"
    assert [notifications(engine, task_id) for task_id in reminders] == [1] * REMINDERS
    assert ticket_versions(engine, list(reminders.values())) == [1] * REMINDERS
    for worker in (w1, w2):
        assert not [line for line in worker.lines() if "Traceback" in str(line)]
