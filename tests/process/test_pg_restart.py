"""A PostgreSQL restart costs seconds, not ``STALE_AFTER_S`` (docs/design.md, "Lifecycle"):
an execution the restart interrupts ends through the normal retry path - the same run,
attempt + 1 - as soon as PostgreSQL answers again, and no live run is taken back.

A private PostgreSQL (soak/postgres.py, never the machine's shared one) serves a real
worker and a real beat with the default ``STALE_AFTER_S`` (120 s). An export is parked at
its first batch; the server is stopped (``pg_ctl stop -m fast`` ends every session), the
export is let go while it is down - its connection is gone, so the attempt fails, and its
failure report cannot reach the ledger either - then the server is started again. Before,
that report was tried once: the run stayed RUNNING under a dead execution and a live
holder until the staleness rule took it back two minutes later (``RECOVER``).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from harness.factories import add_tickets, audit_events, make_world, task_row
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from ledger.migrate import upgrade
from soak.postgres import SoakPostgres
from teamdesk.config import Settings
from teamdesk.db import make_engine
from tests.process.test_shutdown import GATED

pytestmark = pytest.mark.slow

BACK_WITHIN_S = 30.0  # detects a miss: the staleness rule would take 120 s


@pytest.fixture
def server() -> Iterator[SoakPostgres]:
    workdir = Path(tempfile.mkdtemp(prefix="td-restart-"))
    postgres = SoakPostgres(workdir)
    try:
        postgres.create()
        yield postgres
    finally:
        postgres.destroy()
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_export_interrupted_by_a_restart_retries_as_soon_as_postgresql_answers(
    server: SoakPostgres, settings: Settings, tmp_path: Path
) -> None:
    url = server.create_database(f"restart_{uuid.uuid4().hex[:8]}")
    upgrade(url)
    engine = make_engine(url)
    world = make_world(engine)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1200)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    s = settings.with_overrides(database_url=url, export_batch_size=500, retry_base_delay_s=1.0)
    assert s.stale_after_s == 120.0
    # A gate client whose reads outlast BLPOP's wait (redis-py's default socket timeout
    # is shorter than BACK_WITHIN_S).
    gate_client = redis.Redis.from_url(s.redis_url, socket_timeout=BACK_WITHIN_S + 10)
    gate = RemoteGate(gate_client, s.queue_prefix, "export.after_read")
    env = settings_env(s, **GATED)
    try:
        with cluster(tmp_path) as procs:
            w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
            beat = Proc("beat", celery_argv("beat"), settings_env(s), tmp_path).start()
            procs += [w1, beat]
            first = gate.wait_reached()
            engine.dispose()
            server.stop("fast")
            gate.release()  # the attempt goes on with PostgreSQL down, and fails
            w1.wait_event("heartbeat.failed")  # the worker saw it down too
            server.start()
            second = gate.wait_reached(timeout=BACK_WITHIN_S)  # attempt 2's first batch
            assert second["execution_id"] != first["execution_id"]
            gate.release(times=10)
            wait_for(
                lambda: task_row(engine, task_id)["status"] == "COMPLETED",
                timeout=BACK_WITHIN_S,
                what="the retried attempt to complete",
            )
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0
        attempts = [e for e in w1.events("task.attempt_failed") if e["task_id"] == str(task_id)]
        assert len(attempts) == 1 and "report_error" not in attempts[0]
    finally:
        engine.dispose()
        gate_client.close()
    assert audit_events(engine, task_id) == ["CLAIM", "WAIT", "CLAIM", "COMPLETE"]
    row = task_row(engine, task_id)
    assert (row["run"], row["attempts"], row["recoveries"]) == (0, 2, 0)
    assert row["result_summary"] == "1200 rows"
    engine.dispose()
