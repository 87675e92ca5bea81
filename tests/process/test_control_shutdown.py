"""``celery control shutdown`` keeps its Celery meaning - a warm stop - and drains like a
SIGTERM (docs/design.md, "Shutdown"): the worker leaves the active sets but stays a lease
holder while its in-flight export ends, so no scan takes that live run back. Celery sends
no ``worker_shutting_down`` for a remote shutdown: before, the worker's heartbeat step
removed it as a holder outright while the pool finished the export, and the dispatcher's
heartbeat rule took the run back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from dispatcher.scan import read_heartbeats, run_once
from harness.factories import World, task_row
from harness.processes import ROOT, Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from tasks.celery_app import create_app
from teamdesk.config import Settings
from teamdesk.heartbeat import lease_holders_alive, live_members
from tests.process.test_shutdown import GATED, export, short
from tests.support.queues import send_message

pytestmark = pytest.mark.slow


def test_remote_shutdown_drains_the_in_flight_export_with_its_lease(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = short(settings)
    task_id = export(engine, world)
    gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")
    app = create_app(s)
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=1), settings_env(s, **GATED), tmp_path)
        procs.append(w1.start())
        started = w1.wait_event("worker.started")
        member = started["member"]
        wait_for(
            lambda: read_heartbeats(redis_client, s.queue_prefix, s.heartbeat_ttl_s).trusted,
            what="the heartbeat record to be trusted",
        )
        send_message(app, task_id, 0, "EXPORT")
        parked = gate.wait_reached()

        # Celery's shutdown never replies (the worker stops instead): the CLI's "no nodes
        # replied" is expected; the worker's log says whether it got the command.
        subprocess.run(
            celery_argv("control", "shutdown", "--timeout", "1", "-d", started["hostname"]),
            env=settings_env(s),
            cwd=ROOT,
            capture_output=True,
            timeout=60,
        )
        w1.wait_event("worker.stopping")
        wait_for(
            lambda: member not in live_members(redis_client, s.queue_prefix),
            what="the worker to leave the active sets",
        )
        # Still a lease holder: a scan (only the heartbeat rule can act) takes nothing back.
        assert member in lease_holders_alive(redis_client, s.queue_prefix)
        counts = run_once(app, settings=s.with_overrides(stale_after_s=600.0))
        assert (counts.heartbeat_rule, counts.recovered) == (True, 0)
        held = task_row(engine, task_id)
        assert (held["status"], str(held["execution_id"])) == ("RUNNING", parked["execution_id"])

        gate.release(times=3)
        assert w1.wait(timeout=30) == 0
        row = task_row(engine, task_id)
        assert (row["status"], row["attempts"], row["recoveries"]) == ("COMPLETED", 1, 0)
        assert row["result_summary"] == "1200 rows"
        assert len(w1.events("task.started")) == len(w1.events("task.completed")) == 1
        assert w1.events("task.lease_lost") == []
        assert w1.events("worker.stopping")[0]["signal"] == "control shutdown"
        assert w1.events("worker.stopped")[-1]["exit_code"] == 0
        assert member not in lease_holders_alive(redis_client, s.queue_prefix)
    app.close()
