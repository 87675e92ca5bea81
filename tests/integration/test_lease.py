"""Every lease rule (docs/design.md, "Lease" and "Lifecycle") at ledger level, against real
PostgreSQL."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import uuid
from datetime import datetime

import pytest
import sqlalchemy as sa

from harness.factories import World, age_task, insert_task, task_row
from ledger import artifacts, dispatch, lease, service
from ledger.errors import LeaseLost
from teamdesk import db


def claim(
    engine: sa.Engine,
    task_id: uuid.UUID,
    run: int = 0,
    holder: str | None = "host/a",
    **rules: object,
) -> lease.Claim | None:
    with engine.begin() as conn:
        return lease.claim(conn, task_id, run, holder, **rules)  # type: ignore[arg-type]


def claimed(engine: sa.Engine, task_id: uuid.UUID, **kw: object) -> lease.Lease:
    result = claim(engine, task_id, **kw)  # type: ignore[arg-type]
    assert result is not None
    return result.lease


def age_run_at(engine: sa.Engine, task_id: uuid.UUID) -> None:
    """Make a WAITING row due now (its backoff passed)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE background_tasks SET run_at = now() WHERE id = :id"), {"id": task_id}
        )


def set_attempts(engine: sa.Engine, task_id: uuid.UUID, attempts: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE background_tasks SET attempts = :n WHERE id = :id"),
            {"n": attempts, "id": task_id},
        )


def test_claim_sets_running_with_fresh_lease(engine: sa.Engine, world: World) -> None:
    task_id = insert_task_committed(engine, world, filters={"q": "x"})
    set_attempts(engine, task_id, 1)  # its first attempt failed; this is the retry
    result = claim(engine, task_id, holder="host-1/abc")
    assert result is not None
    row = task_row(engine, task_id)
    assert row["status"] == "RUNNING"
    assert row["execution_id"] == result.lease.execution_id
    assert row["lease_holder"] == "host-1/abc"
    assert row["attempts"] == 2 and row["progress"] == 0
    assert result.lease.attempt == 2
    assert row["updated_at"] > row["created_at"]
    assert (result.kind, result.scope, result.filters) == ("EXPORT", "TEAM", {"q": "x"})
    assert result.team_id == world.team_id and result.owner_id == world.staff_id


def insert_task_committed(engine: sa.Engine, world: World, **kw: object) -> uuid.UUID:
    with engine.begin() as conn:
        return insert_task(conn, world, **kw)  # type: ignore[arg-type]


def test_message_of_an_older_run_is_skipped(engine: sa.Engine, world: World) -> None:
    task_id = insert_task_committed(engine, world, run=1)
    before = task_row(engine, task_id)
    assert claim(engine, task_id, run=0) is None
    assert task_row(engine, task_id) == before


@pytest.mark.parametrize("status", ["COMPLETED", "FAILED", "CANCELLED"])
def test_finished_rows_are_never_claimed(engine: sa.Engine, world: World, status: str) -> None:
    task_id = insert_task_committed(engine, world, status=status)
    before = task_row(engine, task_id)
    assert claim(engine, task_id) is None
    assert task_row(engine, task_id) == before


def test_new_claim_replaces_running_lease_and_old_writes_change_nothing(
    engine: sa.Engine, world: World
) -> None:
    task_id = insert_task_committed(engine, world)
    old = claimed(engine, task_id, holder="host/a")
    new = claimed(engine, task_id, holder="host/b", stale_after_s=0)
    assert new.execution_id != old.execution_id
    assert (old.attempt, new.attempt) == (1, 1)  # a takeover continues the attempt
    with engine.begin() as conn:
        lease.report_progress(conn, new, 40, 30.0)
    snapshot = task_row(engine, task_id)
    assert snapshot["execution_id"] == new.execution_id and snapshot["lease_holder"] == "host/b"

    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.report_progress(conn, old, 90, 30.0)
    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.complete_export(conn, old, "id\n", "old result")
    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.complete_in_transaction(conn, old, "old result")
    with engine.begin() as conn:
        assert lease.report_failure(conn, old, final=True, message="boom") is False
        assert lease.report_failure(conn, old, final=False, message="boom", retry_in_s=2) is False
    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.check_lease(conn, old)
    assert task_row(engine, task_id) == snapshot

    with engine.begin() as conn:
        lease.check_lease(conn, new)
        lease.complete_export(conn, new, "id\r\n", "1 row")
    done = task_row(engine, task_id)
    assert done["status"] == "COMPLETED" and done["progress"] == 100
    assert done["result_csv"] == "id\r\n" and done["result_summary"] == "1 row"
    assert done["execution_id"] is None and done["lease_holder"] is None
    assert done["expires_at"] is not None
    hours = (done["expires_at"] - done["updated_at"]).total_seconds() / 3600
    assert hours == pytest.approx(24, abs=0.01)


def test_failure_report_never_touches_a_completed_row(engine: sa.Engine, world: World) -> None:
    task_id = insert_task_committed(engine, world)
    held = claimed(engine, task_id)
    with engine.begin() as conn:
        lease.complete_in_transaction(conn, held, "done")
    completed = task_row(engine, task_id)
    with engine.begin() as conn:
        assert lease.report_failure(conn, held, final=True, message="late") is False
        assert lease.report_failure(conn, held, final=False, message="late", retry_in_s=1) is False
    assert claim(engine, task_id) is None
    assert task_row(engine, task_id) == completed


def test_retryable_failure_sets_waiting_until_retry_is_due(engine: sa.Engine, world: World) -> None:
    """The retry is a ledger row: WAITING, unpublished, ready after the backoff by the
    database's clock; the next claim starts attempt 2."""
    task_id = insert_task_committed(engine, world)
    held = claimed(engine, task_id)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE background_tasks SET dispatched_at = now() WHERE id = :id"),
            {"id": task_id},
        )
        assert lease.report_failure(
            conn, held, final=False, message="Temporary error; will retry.", retry_in_s=4
        )
    row = task_row(engine, task_id)
    assert row["status"] == "WAITING" and row["execution_id"] is None
    assert row["lease_holder"] is None and row["last_error"] == "Temporary error; will retry."
    assert row["dispatched_at"] is None and row["attempts"] == 1
    assert (row["run_at"] - row["updated_at"]).total_seconds() == pytest.approx(4, abs=0.001)
    assert claim(engine, task_id) is None  # not due before its backoff has passed
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE background_tasks SET run_at = now() WHERE id = :id"), {"id": task_id}
        )
    assert claimed(engine, task_id).attempt == 2


def test_final_failure_sets_failed(engine: sa.Engine, world: World) -> None:
    task_id = insert_task_committed(engine, world)
    set_attempts(engine, task_id, 2)
    held = claimed(engine, task_id)
    with engine.begin() as conn:
        assert lease.report_failure(conn, held, final=True, message="Export failed.")
    row = task_row(engine, task_id)
    assert (row["status"], row["execution_id"], row["last_error"], row["attempts"]) == (
        "FAILED",
        None,
        "Export failed.",
        3,
    )
    assert claim(engine, task_id) is None


def test_progress_out_of_range_is_refused_before_any_write(engine: sa.Engine, world: World) -> None:
    task_id = insert_task_committed(engine, world)
    held = claimed(engine, task_id)
    before = task_row(engine, task_id)
    with pytest.raises(ValueError), engine.begin() as conn:
        lease.report_progress(conn, held, 101, 30.0)
    assert task_row(engine, task_id) == before


def test_lease_lost_in_a_transaction_rolls_back_its_side_effects(
    engine: sa.Engine, world: World
) -> None:
    task_id = insert_task_committed(engine, world, kind="REMINDER")
    old = claimed(engine, task_id)
    claimed(engine, task_id, holder="host/b", stale_after_s=0)
    snapshot = task_row(engine, task_id)
    with pytest.raises(LeaseLost), engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO system_events (team_id, type) VALUES (:t, 'probe')"),
            {"t": world.team_id},
        )
        lease.complete_in_transaction(conn, old, "sent")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM system_events")).scalar_one() == 0
    assert task_row(engine, task_id) == snapshot


def test_two_claims_gated_between_read_and_commit_leave_one_lease(
    engine: sa.Engine, world: World
) -> None:
    """Both executions read the row, meet at a barrier, then claim. The second UPDATE waits
    for the first commit, then finds a RUNNING row whose execution is alive and claims
    nothing; only the one lease may complete."""
    task_id = insert_task_committed(engine, world)
    barrier = threading.Barrier(2, timeout=10)
    leases: dict[str, lease.Lease] = {}
    errors: list[BaseException] = []

    def execution(name: str) -> None:
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.text("SELECT status FROM background_tasks WHERE id = :id"), {"id": task_id}
                ).one()
                barrier.wait()
                got = lease.claim(conn, task_id, 0, f"host/{name}", stale_after_s=60)
                if got is not None:
                    leases[name] = got.lease
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=execution, args=(n,)) for n in ("a", "b")]
    try:
        for t in threads:
            t.start()
    finally:
        for t in threads:
            t.join(timeout=20)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    row = task_row(engine, task_id)
    assert len(leases) == 1
    survivors = [n for n, held in leases.items() if held.execution_id == row["execution_id"]]
    assert len(survivors) == 1
    assert [e for e, _ in audit_events(engine, task_id)] == ["CLAIM"]
    with engine.begin() as conn:
        lease.complete_export(conn, leases[survivors[0]], "winner\r\n", "winner")
    done = task_row(engine, task_id)
    assert (done["status"], done["result_csv"]) == ("COMPLETED", "winner\r\n")


def audit_events(engine: sa.Engine, task_id: uuid.UUID) -> list[tuple[str, uuid.UUID | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT event, execution_id FROM task_audit WHERE task_id = :t ORDER BY id"),
            {"t": task_id},
        )
        return [(r.event, r.execution_id) for r in rows]


def test_audit_trail_records_every_lease_change(engine: sa.Engine, world: World) -> None:
    from ledger import audit

    task_id = insert_task_committed(engine, world)
    old = claimed(engine, task_id)
    new = claimed(engine, task_id, holder="host/b", stale_after_s=0)
    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.complete_export(conn, old, "x", "old")
    with engine.begin() as conn:
        assert lease.report_failure(conn, old, final=True, message="late") is False
        lease.complete_export(conn, new, "id\n", "new")
    assert audit_events(engine, task_id) == [
        ("CLAIM", old.execution_id),
        ("CLAIM", new.execution_id),
        ("COMPLETE", new.execution_id),
    ]
    with engine.connect() as conn:
        assert audit.stale_writes(conn) == [] and audit.repeated_completions(conn) == {}
    # What a commit by the replaced execution would look like, were the guard missing:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO task_audit (task_id, run, event, execution_id) "
                "VALUES (:t, 0, 'COMPLETE', :e)"
            ),
            {"t": task_id, "e": old.execution_id},
        )
    with engine.connect() as conn:
        (stale,) = audit.stale_writes(conn)
        assert (stale.task_id, stale.event, stale.execution_id) == (
            task_id,
            "COMPLETE",
            old.execution_id,
        )
        assert audit.repeated_completions(conn) == {task_id: 2}


def test_lease_statements_are_prepared_once_per_session(engine: sa.Engine, world: World) -> None:
    first, second = insert_task_committed(engine, world), insert_task_committed(engine, world)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for task_id in (first, second):
            held = lease.claim(conn, task_id, 0)
            assert held is not None
            lease.complete_export(conn, held.lease, b"id\n", "0 rows")
        names = conn.exec_driver_sql(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE 'td_prep_%%'"
        ).scalars()
        assert len(set(names)) == 2  # the claim and the completion, once each (a chunk is a COPY)
    assert task_row(engine, second)["result_csv"] == "id\n"


def in_transaction(conn: sa.Connection) -> bool:
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    return bool(dbapi.get_transaction_status() != 0)  # 0: idle, outside any transaction


def test_a_large_csv_is_stored_in_bounded_chunks_byte_for_byte(
    engine: sa.Engine, world: World
) -> None:
    text = "id,title\n" + "".join(
        f'{i},"caf\u00e9 $$ \\\\ ""q"" \u2603 {i}"\n' for i in range(80_000)
    )
    data = text.encode()
    assert len(data) > 2 * artifacts.CHUNK_BYTES
    task_id = insert_task_committed(engine, world)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        held = lease.claim(conn, task_id, 0)
        assert held is not None
        lease.complete_export(conn, held.lease, data, "80000 rows")
        assert not in_transaction(conn)
    row = task_row(engine, task_id)
    assert (row["status"], row["result_csv"]) == ("COMPLETED", text)
    assert (row["result_key"], row["result_bytes"]) == (held.lease.execution_id, len(data))
    assert row["result_sha256"] == hashlib.sha256(data).hexdigest()
    with engine.connect() as conn:
        sizes = (
            conn.execute(
                sa.text(
                    "SELECT octet_length(data) FROM export_chunks WHERE task_id = :t ORDER BY seq"
                ),
                {"t": task_id},
            )
            .scalars()
            .all()
        )
    assert sizes[:-1] == [artifacts.CHUNK_BYTES] * (len(sizes) - 1)
    assert sum(sizes) == len(data) and 0 < sizes[-1] <= artifacts.CHUNK_BYTES


def test_a_replaced_executions_chunks_are_never_served_and_are_purged(
    engine: sa.Engine, world: World
) -> None:
    """The late execution writes its CSV under its own key and its completion is refused;
    the newer one's completion names its own key; the late chunks are an orphan the
    retention step removes (after its grace), the served ones stay."""
    task_id = insert_task_committed(engine, world)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        held = lease.claim(conn, task_id, 0)
        assert held is not None
        newer = claimed(engine, task_id, stale_after_s=0)
        with pytest.raises(LeaseLost):
            lease.complete_export(conn, held.lease, b"x" * ((2 << 20) + 5), "late")
        lease.complete_export(conn, newer, b"id\nwinner\n", "1 row")
    row = task_row(engine, task_id)
    assert (row["status"], row["result_key"], row["result_csv"]) == (
        "COMPLETED",
        newer.execution_id,
        "id\nwinner\n",
    )

    def keys() -> dict[str, int]:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT CAST(execution_id AS text), count(*) FROM export_chunks"
                    " WHERE task_id = :t GROUP BY 1"
                ),
                {"t": task_id},
            )
            return {key: n for key, n in rows}

    late, served = str(held.lease.execution_id), str(newer.execution_id)
    assert keys() == {late: 3, served: 1}  # 2 MiB and 5 bytes: three chunks
    with engine.begin() as conn:
        assert artifacts.purge_orphans(conn, batch=10) == 0  # within its grace
        conn.execute(sa.text("UPDATE export_chunks SET created_at = now() - interval '2 minutes'"))
    with engine.begin() as conn:
        assert artifacts.purge_orphans(conn, batch=10) == 3
    assert keys() == {served: 1}
    assert task_row(engine, task_id)["result_csv"] == "id\nwinner\n"


def test_with_prepared_statements_off_nothing_is_prepared(database_url: str, world: World) -> None:
    """DATABASE_PREPARED_STATEMENTS=off (PgBouncer in transaction pooling, where the next
    transaction may run on another server session that never saw the PREPARE): the lease's
    and the dispatcher's statements run unprepared and do the same work."""
    engine = db.make_engine(database_url, prepared_statements=False)
    try:
        task_id = insert_task_committed(engine, world)
        with engine.begin() as conn:
            state = dispatch.window_state(conn)
            turn = dispatch.stamp_ready(conn, kind="EXPORT", n=5, team_cap=0)
        assert "EXPORT" in state.waiting and [r.task_id for r in turn.refs] == [task_id]
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            held = lease.claim(conn, task_id, 0, stamp=turn.refs[0].stamp)
            assert held is not None
            lease.complete_export(conn, held.lease, b"id\n", "0 rows")
            names = conn.exec_driver_sql("SELECT name FROM pg_prepared_statements").scalars()
            assert list(names) == []
        row = task_row(engine, task_id)
        assert (row["status"], row["result_csv"]) == ("COMPLETED", "id\n")
    finally:
        engine.dispose()


def test_a_redelivery_never_takes_over_a_live_execution(engine: sa.Engine, world: World) -> None:
    """A delivery of the same publish while its execution writes (kombu restored the
    message after a broker reconnect) claims nothing; once the row is silent for
    stale_after_s by the database's clock it takes the run over and continues the attempt."""
    task_id = insert_task_committed(engine, world)
    stamp = publish(engine, task_id)
    live = claimed(engine, task_id, holder="host/a", stamp=stamp)
    before = task_row(engine, task_id)
    assert claim(engine, task_id, holder="host/b", stamp=stamp, stale_after_s=60) is None
    assert task_row(engine, task_id) == before
    with engine.connect() as conn:
        reason = lease.skip_reason(conn, task_id, 0, stamp)
    assert reason == lease.Skip("the run is held by a live execution", cancelled=False)

    age_task(engine, task_id, 61)
    stale = claimed(engine, task_id, holder="host/b", stamp=stamp, stale_after_s=60)
    assert stale.attempt == live.attempt == 1
    row = task_row(engine, task_id)
    assert (row["execution_id"], row["lease_holder"]) == (stale.execution_id, "host/b")
    assert [e for e, _ in audit_events(engine, task_id)] == ["CLAIM", "CLAIM"]


def lost(conn: sa.Connection, held: lease.Lease) -> lease.FailedAttempt | None:
    """report_lost (on ``conn``'s driver connection, in its transaction) with 3 attempts, a
    2 s backoff base and two short messages."""
    return lease.report_lost(
        conn.connection.dbapi_connection,
        held,
        max_attempts=3,
        base_delay_s=2.0,
        message="lost ({how})",
        final_message="lost for good",
    )


def test_a_claim_takes_the_execution_id_its_worker_issued(engine: sa.Engine, world: World) -> None:
    task_id = insert_task_committed(engine, world)
    issued = uuid.uuid4()
    held = claimed(engine, task_id, holder="host/a", execution_id=issued)
    assert held.execution_id == issued == task_row(engine, task_id)["execution_id"]


def test_a_lost_process_is_a_failed_attempt_of_the_same_run(
    engine: sa.Engine, world: World
) -> None:
    """report_lost: the held execution's attempt failed; WAITING, unpublished, due after
    the backoff by the database's clock, with the reason; never a recovery."""
    task_id = insert_task_committed(engine, world)
    stamp = publish(engine, task_id)
    held = claimed(engine, task_id, holder="host/a", stamp=stamp)
    with engine.begin() as conn:
        written = lost(conn, dataclasses.replace(held, attempt=0))
        due_in = conn.execute(
            sa.text(
                "SELECT extract(epoch FROM run_at - now()) FROM background_tasks WHERE id = :i"
            ),
            {"i": task_id},
        ).scalar_one()
    assert written is not None and (written.status, written.attempt) == ("WAITING", 1)
    assert 1.5 < written.retry_in_s <= 2.0 and 1.5 < float(due_in) <= 2.0
    row = task_row(engine, task_id)
    assert (row["status"], row["attempts"], row["recoveries"], row["run"]) == ("WAITING", 1, 0, 0)
    assert (row["execution_id"], row["lease_holder"], row["dispatched_at"]) == (None, None, None)
    assert row["last_error"] == "lost ({how})"
    assert audit_events(engine, task_id)[-1] == ("WAIT", held.execution_id)
    # The next attempt after the second loss waits twice as long.
    age_run_at(engine, task_id)
    again = claimed(engine, task_id, holder="host/a")
    assert again.attempt == 2
    with engine.begin() as conn:
        second = lost(conn, again)
    assert second is not None and (second.status, second.attempt) == ("WAITING", 2)
    assert 3.5 < second.retry_in_s <= 4.0


def test_a_lost_process_on_the_last_attempt_fails_the_run(engine: sa.Engine, world: World) -> None:
    task_id = insert_task_committed(engine, world)
    set_attempts(engine, task_id, 2)
    held = claimed(engine, task_id, holder="host/a")
    assert held.attempt == 3
    with engine.begin() as conn:
        written = lost(conn, held)
    assert written is not None and (written.status, written.attempt) == ("FAILED", 3)
    assert written.retry_in_s == 0
    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"], row["execution_id"]) == (
        "FAILED",
        "lost for good",
        None,
    )
    assert audit_events(engine, task_id)[-1] == ("FAIL", held.execution_id)


def test_a_lost_process_that_holds_no_lease_changes_nothing(
    engine: sa.Engine, world: World
) -> None:
    """The lost execution never claimed, or a newer execution or a cancel owns the run:
    None, nothing written."""
    task_id = insert_task_committed(engine, world)
    never = lease.Lease(task_id, 0, uuid.uuid4(), attempt=0)
    before = task_row(engine, task_id)
    with engine.begin() as conn:
        assert lost(conn, never) is None
    assert task_row(engine, task_id) == before
    old = claimed(engine, task_id, holder="host/a")
    newer = claimed(engine, task_id, holder="host/b", stale_after_s=0)
    snapshot = task_row(engine, task_id)
    with engine.begin() as conn:
        assert lost(conn, old) is None
    assert task_row(engine, task_id) == snapshot
    with engine.begin() as conn:
        assert service.cancel_run(conn, task_id, 0)
    cancelled = task_row(engine, task_id)
    with engine.begin() as conn:
        assert lost(conn, newer) is None
    assert task_row(engine, task_id) == cancelled


def test_a_run_scheduled_later_is_never_claimed(engine: sa.Engine, world: World) -> None:
    """Even a message carrying the row's stamp claims a WAITING row only once it is due."""
    task_id = insert_task_committed(engine, world)
    stamp = publish(engine, task_id)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET run_at = now() + interval '1 hour' WHERE id = :id"
            ),
            {"id": task_id},
        )
    before = task_row(engine, task_id)
    assert claim(engine, task_id, stamp=stamp) is None
    assert task_row(engine, task_id) == before
    with engine.connect() as conn:
        assert lease.skip_reason(conn, task_id, 0, stamp).reason == "the run is not due yet"
        assert lease.skip_reason(conn, task_id, 0, None).reason == "the run is not due yet"
        assert lease.skip_reason(conn, task_id, 1, stamp).reason == "the message is for another run"


def publish(engine: sa.Engine, task_id: uuid.UUID) -> datetime:
    """Stamp the row as the dispatcher does; returns the stamp."""
    with engine.begin() as conn:
        stamp: datetime = conn.execute(
            sa.text(
                "UPDATE background_tasks SET dispatched_at = clock_timestamp() "
                "WHERE id = :id RETURNING dispatched_at"
            ),
            {"id": task_id},
        ).scalar_one()
    return stamp
