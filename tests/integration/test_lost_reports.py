"""The worker's report of a lost pool process (worker/lost.py) never holds the fork guard
while it waits on PostgreSQL: the heartbeat renewal logs under that guard, and billiard
forks under it. A database that accepts the connection and then never answers (a frozen
server, a full pooler's queue) must hold up neither."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import sqlalchemy as sa

from harness.factories import World, insert_task
from ledger import lease
from teamdesk.config import Settings
from tests.support.mute_proxy import mute_proxy
from worker.forking import fork_guard
from worker.lost import LostExecution, LostReports

GUARD_WAIT_S = 2.0  # far less than the report's own bounds (connect 2 s + statement 60 s)


def test_a_report_waiting_on_a_silent_database_leaves_the_fork_guard_free(
    engine: sa.Engine, world: World, settings: Settings
) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    lost = LostExecution(lease.Lease(task_id, 0, uuid.uuid4(), attempt=0), 4242, "signal 9")
    with mute_proxy(settings.database_url) as proxy:
        silent = dataclasses.replace(
            settings, database_url=proxy.url_for(settings.database_url), stale_after_s=1.0
        )
        reporter = LostReports(silent)
        started = threading.Event()
        reporter_write = reporter._write

        def write(lost: LostExecution, how: str) -> lease.FailedAttempt | None:
            started.set()
            return reporter_write(lost, how)

        reporter._write = write  # type: ignore[method-assign]
        reporter.submit(lost)
        assert started.wait(10), "the report never started"
        deadline = time.monotonic() + 5
        while proxy.muted < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # detects a login that never happened; orders nothing
        assert proxy.muted >= 1, "the report never reached the silent database"
        took_guard = fork_guard._lock.acquire(timeout=GUARD_WAIT_S)
        if took_guard:
            fork_guard._lock.release()
    assert took_guard, "the fork guard was held while the report waited on the database"
