"""What an operator relies on: every dispatcher statement walks a small partial index on a
large ledger, failures are logged throttled then recovered once, and the ``scan`` and
``health --cluster`` commands say what they did in one line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher.context import Cluster
from dispatcher.leader import Leadership, leader_key
from dispatcher.loop import DispatchLoop
from dispatcher.monitor import FailureLog
from dispatcher.scan import ScanCounts
from harness.factories import World, insert_task, task_row
from ledger import dispatch, lease
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat, WorkerSlots
from tests.support.queues import all_task_messages, closed_port

# --- the statements' plans on a large table -----------------------------------------------


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def table_scans(plan: dict[str, Any], table: str) -> list[tuple[str, str | None]]:
    """Each scan of ``table`` with the index it walks. A Bitmap Heap Scan names no index:
    its Bitmap Index Scan children do (they carry no relation name)."""
    scans: list[tuple[str, str | None]] = []
    for node in plan_nodes(plan):
        if node.get("Relation Name") != table:
            continue
        if node["Node Type"] == "Bitmap Heap Scan":
            scans += [
                (node["Node Type"], child.get("Index Name"))
                for child in plan_nodes(node)
                if child["Node Type"] == "Bitmap Index Scan"
            ]
        else:
            scans.append((node["Node Type"], node.get("Index Name")))
    return scans


def fill_100k(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("""
            INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status,
                                          progress, run_at, created_at, updated_at,
                                          result_csv, expires_at)
            SELECT 'EXPORT', :team, :owner, 'TEAM', '{}'::jsonb, 'COMPLETED', 100,
                   now() - g * interval '1 minute', now() - g * interval '1 minute',
                   now() - g * interval '1 minute',
                   CASE WHEN g <= 500 THEN 'id\n' END,
                   CASE WHEN g <= 500 THEN now() + interval '1 day' - g * interval '1 minute'
                   END
              FROM generate_series(1, 100000) AS g"""),
            {"team": world.team_id, "owner": world.staff_id},
        )
        conn.execute(
            sa.text("""
            INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status,
                                          dispatched_at, execution_id, lease_holder)
            SELECT 'EXPORT', :team, :owner, 'TEAM', '{}'::jsonb,
                   CASE g % 3 WHEN 0 THEN 'RUNNING' ELSE 'WAITING' END,
                   CASE g % 3 WHEN 1 THEN now() END,
                   CASE g % 3 WHEN 0 THEN gen_random_uuid() END,
                   CASE g % 3 WHEN 0 THEN 'host/' || g END
              FROM generate_series(1, 150) AS g"""),
            {"team": world.team_id, "owner": world.staff_id},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE background_tasks"))


PARTIAL = {
    "ix_background_tasks_ready",
    "ix_background_tasks_inflight",
    "ix_background_tasks_scheduled",
    "ix_background_tasks_dispatched",
    "ix_background_tasks_running",
    "ix_background_tasks_expiring",
}
BY_ID = {"pk_background_tasks"} | PARTIAL


def test_every_dispatcher_statement_walks_a_partial_index_on_100k_rows(
    engine: sa.Engine, world: World
) -> None:
    fill_100k(engine, world)
    some = uuid.uuid4()
    with engine.connect() as conn:
        now = dispatch.database_now(conn)
    cases: list[tuple[sa.TextClause, set[str], dict[str, Any]]] = [
        (
            lease.RECOVER_STALE,
            {"ix_background_tasks_running"},
            {
                "stale_after_s": 120,
                "use_heartbeats": True,
                "live_members": ["host/1"],
                "holders_seen_at": now,
                "max_recoveries": 2,
                "batch": 200,
                "too_many": "x",
            },
        ),
        (
            dispatch.WINDOW_STATE,
            {"ix_background_tasks_dispatched", "ix_background_tasks_scheduled"},
            {"promote_batch": 1000},
        ),
        (
            dispatch.STAMP_READY,
            {"ix_background_tasks_ready"},
            {"kind": "EXPORT", "n": 20, "cap": 0, "cursor": str(uuid.UUID(int=0))},
        ),
        (dispatch.READY_KINDS, {"ix_background_tasks_ready"}, {"kinds": ["EXPORT"]}),
        (
            dispatch.PUBLISHED_BEFORE,
            {"ix_background_tasks_dispatched"},
            {"grace_s": 5, "overdue_s": 600, "batch": 2000},
        ),
        (dispatch.PURGE_EXPIRED, {"ix_background_tasks_expiring"}, {"batch": 200}),
        (
            dispatch.PURGE_EXPIRED_CHUNKS,
            {"ix_background_tasks_results_expiring"},
            {"batch": 200},
        ),
        # Rows by id: the primary key, or a partial index just as narrow.
        (dispatch.UNSTAMP, {"pk_background_tasks"} | PARTIAL, {"ids": [str(some)], "stamp": now}),
        (
            dispatch.RESTAMP,
            {"pk_background_tasks"} | PARTIAL,
            {"ids": [str(some)], "stamps": [now]},
        ),
    ]
    with engine.connect() as conn:
        for statement, indexes, params in cases:
            explain = sa.text("EXPLAIN (FORMAT JSON) " + statement.text).bindparams(
                *statement._bindparams.values()
            )
            [plan] = conn.execute(explain, params).scalar_one()
            scans = table_scans(plan["Plan"], "background_tasks")
            assert scans, statement.text
            assert all(kind != "Seq Scan" for kind, _ in scans), (statement.text, scans)
            assert indexes & {name for _, name in scans}, (statement.text, scans)
        conn.rollback()


# --- failures: the throttled log ------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def fields(record: logging.LogRecord, *names: str) -> tuple[Any, ...]:
    return tuple(getattr(record, name) for name in names)


def test_failure_log_throttles_failed_and_logs_recovered_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    failures = FailureLog(logging.getLogger("test.dispatcher"), clock=clock)
    with caplog.at_level(logging.INFO):
        assert failures.succeeded() is False  # nothing to recover from
        assert failures.failed("PostgreSQL", "OperationalError") is True
        for step in (1.0, 10.0, 29.0):
            clock.now = 1000.0 + step
            assert failures.failed("PostgreSQL", "OperationalError") is False
        clock.now = 1030.0
        assert failures.failed("Redis", "ConnectionError") is True
        clock.now = 1042.5
        assert failures.succeeded() is True
        assert failures.succeeded() is False
        assert failures.failed("Redis", "TimeoutError") is True  # a new outage logs at once

    failed = records(caplog, "dispatcher.failed")
    assert [fields(r, "service", "error", "failed_scans", "suppressed") for r in failed] == [
        ("PostgreSQL", "OperationalError", 1, 0),
        ("Redis", "ConnectionError", 5, 3),
        ("Redis", "TimeoutError", 1, 0),
    ]
    [recovered] = records(caplog, "dispatcher.recovered")
    assert fields(recovered, "failed_scans", "down_s") == (5, 42.5)


def test_the_dispatcher_logs_a_database_outage_throttled_then_recovered_once(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One dispatcher process leads the whole cluster, so its throttle is the cluster's:
    rounds every second during a 10 s outage log dispatcher.failed once, and the first
    good round logs dispatcher.recovered once."""
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    offer = Heartbeat(redis_client, queue_prefix, "test-host", 20.0, WorkerSlots(("exports",), 1))
    assert offer.renew()
    clock = FakeClock()
    port = closed_port()
    down = settings.with_overrides(
        database_url=f"postgresql://postgres:hunter2@127.0.0.1:{port}/teamdesk",
        dispatch_listen_url=None,
    )
    monitor = FailureLog(logging.getLogger("teamdesk.dispatcher"), clock=clock)
    outage = DispatchLoop(Cluster(celery_app, down), monitor=monitor, clock=clock)
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(10):
                outage.run_for(0.0)
                clock.now += 1.0
            outage.close()
            healthy = DispatchLoop(
                Cluster(celery_app, settings.with_overrides(dispatch_listen_url=None)),
                monitor=monitor,
                clock=clock,
            )
            healthy.run_for(0.0)
            healthy.run_for(0.0)
            healthy.close()
    finally:
        offer.remove()

    [failed] = records(caplog, "dispatcher.failed")
    assert fields(failed, "service", "error") == ("PostgreSQL", "OperationalError")
    logged = " ".join(f"{k}={v}" for k, v in vars(failed).items())
    assert "hunter2" not in logged and str(port) not in logged
    [recovered] = records(caplog, "dispatcher.recovered")
    assert fields(recovered, "failed_scans") == (10,)
    assert all_task_messages(redis_client, queue_prefix)["exports"] == [f"{task_id}-0"]
    assert task_row(engine, task_id)["dispatched_at"] is not None


def test_a_standby_dispatcher_does_nothing_until_the_lock_is_free(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    other = Leadership(redis_client, leader_key(queue_prefix), 15)
    assert other.ensure()
    standby = DispatchLoop(
        Cluster(celery_app, settings.with_overrides(dispatch_listen_url=None, dispatch_window=5))
    )
    try:
        with caplog.at_level(logging.INFO):
            assert standby.run_for(0.0) == pytest.approx(1.0)
            assert task_row(engine, task_id)["dispatched_at"] is None
            other.release()
            assert standby.run_for(0.0) == 0.0
    finally:
        standby.close()
    assert task_row(engine, task_id)["dispatched_at"] is not None
    roles = [r.role for r in records(caplog, "dispatcher.leader")]  # type: ignore[attr-defined]
    assert roles[-2:] == ["standby", "leader"]  # (the first may be the other holder's)
    assert not redis_client.exists(leader_key(queue_prefix))  # released on close


# --- the command line -----------------------------------------------------------------------


def cli(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "DATABASE_URL": settings.database_url,
        "REDIS_URL": settings.redis_url,
        "QUEUE_PREFIX": settings.queue_prefix,
        "LOG_LEVEL": "error",
        "DISPATCH_WINDOW": "10",
        **env,
    }
    environment.pop("BROKER_URL", None)
    command = [str(Path(sys.executable).parent / "teamdesk-tasks"), *args]
    return subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=60, check=False
    )


def test_scan_command_runs_one_scan_and_prints_what_it_did(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    with engine.begin() as conn:
        rows = [insert_task(conn, world) for _ in range(2)]

    plain = cli(settings, "scan")
    as_json = cli(settings, "scan", "--json")

    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.count("\n") == 1 and "dispatched 2" in plain.stdout
    assert "no live worker consumes exports, reminders" not in plain.stdout  # nothing ready
    assert as_json.returncode == 0, as_json.stderr
    printed = json.loads(as_json.stdout)
    assert printed.keys() == ScanCounts().as_dict().keys()
    assert (printed["dispatched"], printed["redis_error"]) == (0, None)  # the first scan did it
    published = sorted(all_task_messages(redis_client, queue_prefix)["exports"])
    assert published == sorted(f"{t}-0" for t in rows)
    assert "scan" in cli(settings, "--help").stdout
    assert "--json" in cli(settings, "scan", "--help").stdout


@pytest.mark.parametrize("down", ["DATABASE_URL", "REDIS_URL"])
def test_scan_command_exits_1_with_a_clear_message_when_a_service_is_down(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    down: str,
) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    port = closed_port()
    url = (
        f"postgresql://postgres:hunter2@127.0.0.1:{port}/teamdesk"
        if down == "DATABASE_URL"
        else f"redis://:hunter2@127.0.0.1:{port}/0"
    )

    result = cli(settings, "scan", **{down: url})

    assert result.returncode == 1
    if down == "DATABASE_URL":  # the cause, as every command says it (teamdesk/failures.py)
        assert f"cannot use PostgreSQL: connection refused at 127.0.0.1:{port}" in result.stderr
    else:
        assert "cannot reach Redis" in result.stderr
        assert str(port) not in result.stdout + result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert task_row(engine, task_id)["dispatched_at"] is None
    assert all_task_messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}


NO_DISPATCHER = "no dispatcher is running (start one: celery -A tasks beat)"


def test_health_cluster_names_the_missing_roles_and_the_tasks_they_hold_up(
    settings: Settings,
    engine: sa.Engine,
    world: World,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    def check(**env: str) -> tuple[int, dict[str, Any], list[str]]:
        result = cli(settings, "health", "--cluster", **env)
        assert "hunter2" not in result.stdout + result.stderr
        return result.returncode, json.loads(result.stdout), result.stderr.splitlines()

    with engine.begin() as conn:
        for _ in range(3):
            insert_task(conn, world)  # ready exports
        later = insert_task(conn, world, kind="REMINDER")
        conn.execute(  # scheduled: not waiting for anyone yet
            sa.text("UPDATE background_tasks SET run_at = now() + interval '1 hour' WHERE id = :t"),
            {"t": later},
        )
    everything_missing = [
        NO_DISPATCHER,
        "no worker consumes exports (3 tasks waiting)",
        "no worker consumes reminders",
    ]
    assert check() == (
        1,
        {
            "redis": True,
            "database": True,
            "dispatcher": False,
            "consumers": {"exports": 0, "reminders": 0},
            "missing": ["dispatcher", "exports worker", "reminders worker"],
            "waiting": {"exports": 3, "reminders": 0},
            "busiest_teams": {
                "exports": [{"team_id": str(world.team_id), "ready": 3}],
                "reminders": [],
            },
            "problems": everything_missing,
        },
        [f"teamdesk-tasks health --cluster: {p}" for p in everything_missing],
    )
    exporter = Heartbeat(redis_client, queue_prefix, "h", 20.0, WorkerSlots(("exports",), 2))
    reminder = Heartbeat(redis_client, queue_prefix, "h", 20.0, WorkerSlots(("reminders",), 1))
    leader = Leadership(redis_client, leader_key(queue_prefix), 15)
    try:
        assert exporter.renew() and leader.ensure()
        code, printed, said = check()
        assert (code, printed["missing"], printed["problems"]) == (
            1,
            ["reminders worker"],
            ["no worker consumes reminders"],
        )
        assert said == ["teamdesk-tasks health --cluster: no worker consumes reminders"]
        assert reminder.renew()
        code, printed, said = check()
        assert (code, printed["missing"], printed["problems"], said) == (0, [], [], [])
        assert printed["consumers"] == {"exports": 2, "reminders": 1}
        port = closed_port()
        code, printed, said = check(DATABASE_URL=f"postgresql://u:hunter2@127.0.0.1:{port}/x")
        assert (
            code,
            printed["database"],
            printed["waiting"],
            printed["busiest_teams"],
            printed["missing"],
        ) == (1, False, None, None, [])
        problem = (
            f"cannot use PostgreSQL: connection refused at 127.0.0.1:{port}; "
            "check DATABASE_URL and that PostgreSQL is running"
        )
        assert printed["problems"] == [problem]
        assert said == [f"teamdesk-tasks health --cluster: {problem}"]
    finally:
        exporter.remove()
        reminder.remove()
        leader.release()
    port = closed_port()
    code, printed, said = check(REDIS_URL=f"redis://:hunter2@127.0.0.1:{port}/0")
    assert (code, printed) == (
        1,
        {
            "redis": False,
            "database": True,
            "dispatcher": None,
            "consumers": None,
            "missing": None,
            "waiting": {"exports": 3, "reminders": 0},
            "busiest_teams": {
                "exports": [{"team_id": str(world.team_id), "ready": 3}],
                "reminders": [],
            },
            "problems": ["Redis does not answer: nothing can be published or run"],
        },
    )
    assert said == [
        "teamdesk-tasks health --cluster: Redis does not answer: nothing can be published or run"
    ]
