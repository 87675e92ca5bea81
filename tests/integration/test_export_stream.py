"""The export's one streaming COPY: its bounds (statement_timeout on every connection the
export uses), the buffer handed to the completion as it is, progress every batch while
the stream runs, and the cap checked before any row is sent."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg2
import pytest
import sqlalchemy as sa
from celery import Celery

from harness.csv_reference import expected_csv
from harness.factories import (
    World,
    add_ticket,
    add_tickets,
    audit_events,
    insert_task,
    stored_csv,
    task_row,
)
from harness.waiting import wait_for
from ledger import artifacts, lease, service
from tasks import export
from teamdesk import hooks
from teamdesk.config import get_settings
from tests.support.dispatching import running_cluster


def create_export(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def insert_task_committed(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return insert_task(conn, world)


def test_every_lease_statement_is_bounded_by_itself_and_the_session_keeps_its_settings(
    engine: sa.Engine, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease statement run on its own (an execution's autocommit connection) carries its
    statement timeout in its own round trip and transaction; the session's setting never
    changes (behind PgBouncer in transaction pooling another client gets that session
    next). Before, the claim set the timeout for the whole session."""
    monkeypatch.setattr(lease, "STATEMENT_TIMEOUT_MS", 300)
    task_id = insert_task_committed(engine, world)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        held = lease.claim(conn, task_id, 0)
        assert held is not None
        lease.report_progress(conn, held.lease, 20, 30.0)
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "0"
    with (
        engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn,
        engine.begin() as locker,  # the row locked: the next write has to wait
    ):
        locker.execute(
            sa.text("SELECT 1 FROM background_tasks WHERE id = :id FOR UPDATE"),
            {"id": task_id},
        )
        with pytest.raises(psycopg2.errors.QueryCanceled, match="statement timeout"):
            lease.report_progress(conn, held.lease, 40, 30.0)
    assert task_row(engine, task_id)["progress"] == 20


def test_a_read_that_waits_past_its_budget_is_a_failed_attempt(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
) -> None:
    """A read the database cannot serve (here: the tickets table locked) ends at the
    budget (EXPORT_READ_BUDGET_S) as a failed attempt, instead of holding the worker
    process forever."""
    app = make_app(retry_base_delay_s=600, export_read_budget_s=1.0)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    task_id = create_export(engine, world)
    with engine.connect() as locker:
        # Locked before the cluster starts: its first scan publishes the export.
        locker.exec_driver_sql("BEGIN; LOCK TABLE tickets IN ACCESS EXCLUSIVE MODE")
        try:
            with running_cluster(app):
                wait_for(lambda: task_row(engine, task_id)["attempts"] == 1, what="the claim")
                wait_for(lambda: task_row(engine, task_id)["status"] == "WAITING", what="a failure")
        finally:
            locker.exec_driver_sql("ROLLBACK")
    row = task_row(engine, task_id)
    assert (row["attempts"], row["execution_id"], row["result_csv"]) == (1, None, None)
    assert row["last_error"] == "The task hit a temporary error and will be retried."


def test_a_read_silent_for_half_of_stale_after_is_cancelled_not_taken_back(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    """A read that writes no progress (the tickets table locked: no row arrives) for half
    of STALE_AFTER_S is cancelled (tasks/watchdog.py) and ends as a failed attempt of the
    same run, though its whole budget (EXPORT_READ_BUDGET_S, 60 s) is far from spent.
    Before, the read stayed silent for its budget and the dispatcher took the live run
    back at STALE_AFTER_S (RECOVER), the execution still holding the worker process."""
    app = make_app(stale_after_s=4.0, retry_base_delay_s=600)
    assert get_settings().export_read_budget_s == 60.0
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    task_id = create_export(engine, world)
    with engine.connect() as locker:
        locker.exec_driver_sql("BEGIN; LOCK TABLE tickets IN ACCESS EXCLUSIVE MODE")
        try:
            with running_cluster(app):
                wait_for(lambda: task_row(engine, task_id)["attempts"] == 1, what="the claim")
                wait_for(
                    lambda: task_row(engine, task_id)["status"] == "WAITING",
                    timeout=20,
                    what="the silent read to end",
                )
        finally:
            locker.exec_driver_sql("ROLLBACK")
    assert audit_events(engine, task_id) == ["CLAIM", "WAIT"]
    row = task_row(engine, task_id)
    assert (row["run"], row["attempts"], row["recoveries"]) == (0, 1, 0)
    assert (row["execution_id"], row["result_csv"]) == (None, None)
    assert row["last_error"] == "The task hit a temporary error and will be retried."


def test_progress_arrives_while_the_stream_runs_and_the_csv_is_exact(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    """Progress every batch, written on a second connection while the execution's is busy
    with the COPY; titles that could end a dollar-quoted literal or need escaping in a
    quoted one come back byte for byte."""
    app = make_app(export_batch_size=4)
    titles = ["$t$", "$$", "a\\b", "it's", 'say "hi"', "caf\u00e9 \u2603", "=1+1", "\ttab"]
    with engine.begin() as conn:
        for title in titles:
            add_ticket(conn, world.team_id, world.customer_id, title)
        add_tickets(conn, world.team_id, world.customer_id, 2)
    task_id = create_export(engine, world)
    seen: list[tuple[int, int, int]] = []

    def record(claim: lease.Claim, done: int, total: int) -> None:
        seen.append((done, total, task_row(engine, task_id)["progress"]))

    with hooks.installed("export.after_read", record), running_cluster(app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
    row = task_row(engine, task_id)
    assert row["result_csv"] == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
    assert row["result_summary"] == "10 rows"
    # The hook fires before each batch's progress write: the ledger still shows the last.
    assert seen == [(4, 10, 0), (8, 10, 40), (10, 10, 80)]


def test_progress_written_during_the_stream_leaves_its_session_untouched(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second connection (progress while the COPY holds the execution's) gets no
    session setting: each progress write is bounded by itself (the test above), so a
    pooled session goes back to PgBouncer as it came."""
    bounds: list[str] = []
    batch_done = export._batch_done

    def observed(ctx: object, done: int, total: int, conn: sa.Connection) -> None:
        bounds.append(conn.exec_driver_sql("SHOW statement_timeout").scalar_one())
        batch_done(ctx, done, total, conn)  # type: ignore[arg-type]

    monkeypatch.setattr(export, "_batch_done", observed)
    app = make_app(export_batch_size=2)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 5)
    task_id = create_export(engine, world)
    with running_cluster(app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
    assert bounds == ["0", "0"]  # rows 2 and 4 of 5; the last batch goes with the role read
    assert task_row(engine, task_id)["result_summary"] == "5 rows"


def test_chunks_commit_without_waiting_for_the_disk_and_leave_the_session_as_it_was(
    engine: sa.Engine, world: World
) -> None:
    """Each chunk is its own transaction with ``synchronous_commit = off`` (ledger/
    artifacts.py: the completion's synchronous commit flushes the log past them), seen
    from inside by a trigger this test puts on the table; the setting and the bound are
    the transaction's only, so the session - behind PgBouncer, another client's next -
    keeps its own. A chunk written in the caller's transaction keeps the caller's
    durability. The chunks are all there, in order."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE chunk_commits (seq int, synchronous_commit text)")
        conn.exec_driver_sql("""
            CREATE FUNCTION record_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO chunk_commits VALUES (NEW.seq, current_setting('synchronous_commit'));
                RETURN NEW;
            END $$""")
        conn.exec_driver_sql(
            "CREATE TRIGGER record_commit_mode BEFORE INSERT ON export_chunks"
            " FOR EACH ROW EXECUTE FUNCTION record_commit_mode()"
        )
    task_id = insert_task_committed(engine, world)
    execution = uuid.uuid4()
    writer = artifacts.ChunkWriter(task_id, execution, chunk_bytes=4)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        writer.write(lambda: conn, b"id\r\n1\r\n2\r\n")
        stored = writer.finish(conn)
        session = conn.exec_driver_sql(
            "SELECT current_setting('statement_timeout'), current_setting('synchronous_commit')"
        ).one()
    with engine.begin() as conn:  # the caller's own transaction
        artifacts.store(conn, task_id, uuid.uuid4(), b"id\r\n")
    with engine.connect() as conn:
        modes = conn.exec_driver_sql("SELECT seq, synchronous_commit FROM chunk_commits").all()
        data = stored_csv(conn, task_id, execution).encode()
    assert tuple(session) == ("0", "on")
    assert [tuple(m) for m in modes] == [(0, "off"), (1, "off"), (2, "off"), (0, "on")]
    assert (stored.chunks, stored.size, data) == (3, 10, b"id\r\n1\r\n2\r\n")
