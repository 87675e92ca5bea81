"""A progress write after a long silence survives a PostgreSQL crash (docs/design.md, "Lease").

The staleness rule measures a run's silence on ``updated_at``. A progress write that
commits asynchronously can be lost in a crash, which moves ``updated_at`` back to the
write before it; when that one is old, a live execution looks silent and the next scan
takes its run back (the full soak saw this after ``pg_ctl stop -m immediate``). So a
progress write whose previous write is older than ``durable_after_s`` commits durably;
one that follows a recent write still commits without waiting for the WAL flush.

The crash is real and its loss certain: a private PostgreSQL server (soak/postgres.py,
never the machine's shared one) whose WAL writer is stopped (SIGSTOP) while the write
commits, so no process hands an asynchronous commit to the kernel, is then crashed by
SIGKILL of that WAL writer. The postmaster's crash recovery replays only the WAL that
reached the kernel. Nothing else writes WAL meanwhile: autovacuum is off, the background
writer writes no pages, checkpoints are an hour apart.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
import sqlalchemy as sa

from harness.factories import age_task, insert_task, make_world, task_row
from ledger import lease
from ledger.migrate import upgrade
from soak.postgres import SoakPostgres
from teamdesk.db import make_engine

pytestmark = pytest.mark.slow

RECOVERY_TIMEOUT_S = 60.0
WALWRITER = "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'"
QUIET = ("autovacuum=off", "bgwriter_lru_maxpages=0", "checkpoint_timeout=1h")
DURABLE_AFTER_S = 30.0


@pytest.fixture(scope="module")
def server() -> Iterator[SoakPostgres]:
    workdir = Path(tempfile.mkdtemp(prefix="td-crash-"))
    postgres = SoakPostgres(workdir, QUIET)
    try:
        postgres.create()
        yield postgres
    finally:
        postgres.destroy()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def engine(server: SoakPostgres) -> Iterator[sa.Engine]:
    url = server.create_database(f"crash_{uuid.uuid4().hex[:8]}")
    upgrade(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def _claimed(engine: sa.Engine) -> lease.Lease:
    world = make_world(engine)
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    with engine.begin() as conn:
        claim = lease.claim(conn, task_id, 0, "host/a")
    assert claim is not None
    return claim.lease


def _crash_while_reporting(
    server: SoakPostgres, engine: sa.Engine, held: lease.Lease, progress: int
) -> None:
    """Report ``progress`` with the WAL writer stopped, then crash the server."""
    with engine.connect() as conn:
        walwriter = conn.execute(
            sa.text("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
        ).scalar_one()
    os.kill(walwriter, signal.SIGSTOP)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            lease.report_progress(conn, held, progress, DURABLE_AFTER_S)
    finally:
        os.kill(walwriter, signal.SIGKILL)  # a stopped process dies of it too
    _wait_recovered(server, walwriter)


def _wait_recovered(server: SoakPostgres, killed: int) -> None:
    """Until the server answers after its crash recovery. Answering alone is not enough:
    the postmaster notices the killed WAL writer a moment later, and a connection made
    in between reaches the server before the crash (then the next one finds it "in
    recovery mode"). Recovered means answering with a new WAL writer."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        server.wait_answering()
        try:
            conn = psycopg2.connect(server.admin_url, connect_timeout=2)
            try:
                with conn.cursor() as cur:
                    cur.execute(WALWRITER)
                    found = cur.fetchone()
            finally:
                conn.close()
            if found is not None and found[0] != killed:
                return
        except psycopg2.OperationalError:
            pass  # the crash or the recovery is under way
        time.sleep(0.1)  # polling for the recovery to end, bounded by the deadline
    raise AssertionError("the private PostgreSQL did not recover from the crash")


def _durable_baseline(engine: sa.Engine) -> None:
    """Everything committed so far (the claim's asynchronous commit too) is on disk."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("CHECKPOINT"))


def test_a_progress_write_after_a_long_silence_survives_a_crash(
    server: SoakPostgres, engine: sa.Engine
) -> None:
    held = _claimed(engine)
    age_task(engine, held.task_id, DURABLE_AFTER_S + 5)  # the last write is 35 s old
    _durable_baseline(engine)
    before = task_row(engine, held.task_id)

    _crash_while_reporting(server, engine, held, 40)

    row = task_row(engine, held.task_id)
    assert row["progress"] == 40
    assert row["updated_at"] > before["updated_at"]
    assert (row["status"], row["execution_id"], row["lease_holder"]) == (
        "RUNNING",
        held.execution_id,
        "host/a",
    )


def test_a_progress_write_right_after_another_may_be_lost_in_a_crash(
    server: SoakPostgres, engine: sa.Engine
) -> None:
    """The hot path keeps its asynchronous commit (and the crash above is one that loses
    such a commit): the claim just wrote the row, so this write is not waited for."""
    held = _claimed(engine)
    _durable_baseline(engine)
    before = task_row(engine, held.task_id)

    _crash_while_reporting(server, engine, held, 40)

    assert task_row(engine, held.task_id) == before
