"""The dispatcher scan's recovery and purge (docs/design.md, "Dispatch") against real
PostgreSQL and Redis.

A stale RUNNING run goes back to WAITING (or FAILED past MAX_RECOVERIES) and is published
again; a dead holder is recovered early only when the heartbeats can be trusted; a holder
that registered after the scan read them is not taken for dead; expired CSVs are purged;
and every threshold is the database's clock, never a time passed in from a host.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher.scan import ScanCounts, run_once
from harness.factories import World, age_task, insert_task, task_row
from ledger import artifacts, dispatch, lease
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat
from tests.support.dispatch_scan import LONG_UP, long_up, messages, running_row, waiting_rows

# --- recover -----------------------------------------------------------------------------------


def test_stale_running_run_goes_back_to_waiting_and_is_published_again(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    offer()
    stale = running_row(engine, world, holder=None, kind="REMINDER")
    busy = running_row(engine, world, holder=None)
    age_task(engine, stale, settings.stale_after_s + 5)
    busy_before = task_row(engine, busy)

    with caplog.at_level(logging.INFO):
        counts = run_once(celery_app, uptime=long_up)

    assert (counts.recovered, counts.failed_recoveries, counts.dispatched) == (1, 0, 1)
    row = task_row(engine, stale)
    assert (row["status"], row["recoveries"], row["execution_id"], row["lease_holder"]) == (
        "WAITING",
        1,
        None,
        None,
    )
    assert row["attempts"] == 0  # stalls have their own budget
    assert row["dispatched_at"] is not None  # recovered, then dispatched by the same scan
    assert task_row(engine, busy) == busy_before
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": [f"{stale}-0"]}
    [record] = [r for r in caplog.records if getattr(r, "event", None) == "task.stalled"]
    assert (record.task_id, record.run, record.outcome) == (str(stale), 0, "WAITING")  # type: ignore[attr-defined]


def test_a_lease_written_just_now_is_not_stale(
    engine: sa.Engine, world: World, celery_app: Celery, settings: Settings
) -> None:
    """Staleness is measured by the database's clock on updated_at: a lease one second
    short of STALE_AFTER_S stays."""
    task_id = running_row(engine, world, holder=None)
    age_task(engine, task_id, settings.stale_after_s - 1)
    before = task_row(engine, task_id)

    assert run_once(celery_app, uptime=long_up).recovered == 0
    assert task_row(engine, task_id) == before


def test_run_past_max_recoveries_fails_with_the_fixed_message(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
) -> None:
    offer()
    task_id = running_row(engine, world, recoveries=settings.max_recoveries)
    age_task(engine, task_id, settings.stale_after_s + 5)

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.recovered, counts.failed_recoveries, counts.dispatched) == (0, 1, 0)
    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"], row["recoveries"]) == (
        "FAILED",
        "The task stopped responding too many times.",
        settings.max_recoveries,
    )
    assert (row["execution_id"], row["lease_holder"], row["dispatched_at"]) == (None, None, None)
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}


def test_dead_holder_is_recovered_before_the_stale_rule_when_heartbeats_are_trusted(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    live_worker = offer()
    dead = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    alive = running_row(engine, world, holder=live_worker.member)
    unregistered = running_row(engine, world, holder=None)  # only the 2-minute rule applies
    alive_before, unregistered_before = task_row(engine, alive), task_row(engine, unregistered)

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.heartbeat_rule, counts.recovered, counts.dispatched) == (True, 1, 1)
    row = task_row(engine, dead)
    assert (row["status"], row["recoveries"], row["lease_holder"], row["execution_id"]) == (
        "WAITING",
        1,
        None,
        None,
    )
    assert task_row(engine, alive) == alive_before
    assert task_row(engine, unregistered) == unregistered_before
    assert messages(redis_client, queue_prefix) == {"exports": [f"{dead}-0"], "reminders": []}


@pytest.mark.parametrize("why", ["redis restarted less than one TTL ago", "heartbeat read failed"])
def test_dead_holder_is_not_recovered_early_when_heartbeats_cannot_be_trusted(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
    why: str,
) -> None:
    offer()
    dead = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    stale = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    age_task(engine, stale, settings.stale_after_s + 5)
    dead_before = task_row(engine, dead)
    if why == "heartbeat read failed":

        def unreadable(_client: redis.Redis) -> float:
            raise redis.ConnectionError("Redis went away")

        counts = run_once(celery_app, uptime=unreadable)
        assert counts.redis_error == "ConnectionError"
    else:
        just_started = settings.heartbeat_ttl_s - 1
        counts = run_once(celery_app, uptime=lambda _c: just_started)
        assert counts.redis_error is None

    assert (counts.heartbeat_rule, counts.recovered, counts.dispatched) == (False, 1, 1)
    assert task_row(engine, dead) == dead_before  # cannot tell is never dead
    assert task_row(engine, stale)["status"] == "WAITING"  # the 2-minute rule still holds
    assert messages(redis_client, queue_prefix) == {"exports": [f"{stale}-0"], "reminders": []}


def test_holder_that_registered_and_claimed_after_the_heartbeat_read_is_not_taken_for_dead(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    """A process starts between the scan's heartbeat read and its recovery statement:
    it registers and claims; its member is missing from what the scan read."""
    task_id = waiting_rows(engine, world, 1)[0]
    newcomer = Heartbeat(redis_client, queue_prefix, "test-host", 20.0)
    claimed: list[lease.Claim | None] = []

    def uptime_then_newcomer_claims(client: redis.Redis) -> float:
        # Runs inside the scan, after it read the live members (the gate point).
        assert newcomer.renew()
        with engine.begin() as conn:
            claimed.append(lease.claim(conn, task_id, 0, newcomer.member))
        return LONG_UP

    try:
        counts = run_once(celery_app, uptime=uptime_then_newcomer_claims)
    finally:
        newcomer.remove()

    assert claimed and claimed[0] is not None
    assert (counts.heartbeat_rule, counts.recovered) == (True, 0)
    row = task_row(engine, task_id)
    assert (row["status"], row["lease_holder"], row["recoveries"]) == (
        "RUNNING",
        newcomer.member,
        0,
    )
    assert row["execution_id"] == claimed[0].lease.execution_id
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}


# --- purge -------------------------------------------------------------------------------------


def test_purge_clears_only_expired_csvs_by_the_database_clock(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    expired, kept = running_row(engine, world), running_row(engine, world)
    for row_id, expires in ((expired, "- interval '1 minute'"), (kept, "+ interval '1 hour'")):
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"""UPDATE background_tasks
                   SET status = 'COMPLETED', execution_id = NULL, lease_holder = NULL,
                       result_csv = 'id,title' || chr(10), result_summary = '1 rows',
                       expires_at = now() {expires}
                 WHERE id = :id"""),
                {"id": row_id},
            )
    kept_before = task_row(engine, kept)

    counts = run_once(celery_app, uptime=long_up)

    assert counts == ScanCounts(purged=1, heartbeat_rule=True)
    row = task_row(engine, expired)
    assert (row["status"], row["result_csv"], row["result_summary"]) == (
        "COMPLETED",
        None,
        "1 rows",
    )
    assert task_row(engine, kept) == kept_before


def test_purge_deletes_the_chunks_of_expired_csvs_and_of_executions_that_never_completed(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    """An expired CSV's chunks go with its key; a kept one's stay; the chunks of an
    execution that lost its lease (an orphan, past its grace) go too."""
    with engine.begin() as conn:
        expired, kept, lost = (insert_task(conn, world) for _ in range(3))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for task_id in (expired, kept):
            held = lease.claim(conn, task_id, 0, "host/a")
            assert held is not None
            lease.complete_export(conn, held.lease, b"id,title\n" + b"x" * (3 << 20), "1 rows")
        late = lease.claim(conn, lost, 0, "host/a")
        assert late is not None
        artifacts.store(conn, lost, late.lease.execution_id, b"id,title\nhalf")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET expires_at = now() - interval '1 minute'"
                " WHERE id = :id"
            ),
            {"id": expired},
        )
        conn.execute(  # the late execution lost its lease, and its chunks their grace
            sa.text(
                "UPDATE background_tasks SET status = 'WAITING', execution_id = NULL WHERE id = :id"
            ),
            {"id": lost},
        )
        conn.execute(sa.text("UPDATE export_chunks SET created_at = now() - interval '2 minutes'"))
    kept_before = task_row(engine, kept)

    counts = run_once(celery_app, uptime=long_up)

    assert counts.purged == 1
    row = task_row(engine, expired)
    assert (row["status"], row["result_key"], row["result_csv"], row["result_summary"]) == (
        "COMPLETED",
        None,
        None,
        "1 rows",
    )
    assert task_row(engine, kept) == kept_before
    with engine.connect() as conn:
        left = conn.execute(
            sa.text("SELECT task_id, count(*) FROM export_chunks GROUP BY task_id")
        ).all()
    assert {(t, n) for t, n in left} == {(kept, 4)}  # 3 MiB and a line: four chunks


def test_time_passed_in_from_a_host_is_nowhere_in_the_dispatcher_statements() -> None:
    """Every threshold is the database's clock: no statement takes a time parameter other
    than stamps read back from the ledger itself."""
    statements = {
        name: getattr(dispatch, name).text
        for name in dir(dispatch)
        if name.isupper() and hasattr(getattr(dispatch, name), "text")
    }
    params = {name: set(getattr(dispatch, name).compile().params) for name in statements}
    allowed_times = {"holders_seen_at", "stamp", "stamps"}  # all read from the database
    for name, names in params.items():
        suspicious = {p for p in names if p.endswith(("_at", "now", "before"))}
        assert suspicious <= allowed_times, (name, suspicious)
