"""A real worker's output: one JSON object per line with the fields of docs/design.md,
"Logs"; secrets redacted, LOG_LEVEL honoured, a bad LOG_LEVEL refused before anything starts."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

from harness.factories import World, add_tickets, insert_task, task_row
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.waiting import wait_for
from ledger import service
from tasks.celery_app import create_app
from teamdesk.config import Settings
from tests.support.queues import send_message

pytestmark = pytest.mark.slow

REQUIRED = ("time", "level", "event", "service", "pid")
AUTH_VALUE = "Bearer tok_live_5ecret"


def with_password(url: str, password: str) -> str:
    """The same database with a password in the URL (trust auth ignores it)."""
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{password}@{host}"


def run_worker_through(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path, log_level: str
) -> Proc:
    """Start a worker, run one export and one rejected export through it, stop it."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 10)
        good = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        bad = insert_task(conn, world, filters={"priority": ["SOMEDAY"]})
    s = settings.with_overrides(
        database_url=with_password(settings.database_url, "pg_s3cret"), log_level=log_level
    )
    env = settings_env(
        s,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_LOG_SAMPLE="1",
        TEAMDESK_TEST_AUTH_VALUE=AUTH_VALUE,
    )
    app = create_app(s)
    with cluster(tmp_path) as procs:
        worker = Proc("w", worker_argv("w", concurrency=1), env, tmp_path).start()
        procs.append(worker)
        for task_id in (good, bad):
            send_message(app, task_id, 0, "EXPORT")
        wait_for(
            lambda: (
                task_row(engine, good)["status"] == "COMPLETED"
                and task_row(engine, bad)["status"] == "FAILED"
            ),
            what="both tasks to end",
        )
        worker.send(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    app.close()
    return worker


def test_every_line_is_json_with_the_spec_fields_and_no_secret(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    worker = run_worker_through(engine, world, settings, tmp_path, "info")
    text = worker.output()
    lines = worker.lines()  # raises on any line that is not JSON
    assert len(lines) >= 8
    for line in lines:
        assert all(key in line for key in REQUIRED), line
        assert line["service"] == "worker"
        assert line["level"] in ("fatal", "error", "warn", "info", "debug", "trace")
        assert str(line["time"]).endswith("Z")
    events = [line["event"] for line in lines]
    for expected in (
        "worker.started",
        "task.started",
        "task.completed",
        "task.failed",
        "worker.stopping",
        "worker.stopped",
    ):
        assert expected in events, expected
    for line in lines:
        if str(line["event"]).startswith("task."):
            assert {"task_id", "run", "attempt"} <= set(line), line
    assert "pg_s3cret" not in text and "tok_live_5ecret" not in text
    (sample,) = [line for line in lines if line.get("headers")]
    assert sample["headers"] == {"Authorization": "[REDACTED]"}
    assert ":[REDACTED]@" in str(sample["message"])
    child_pids = {line["pid"] for line in lines if line["event"] == "task.started"}
    parent_pids = {line["pid"] for line in lines if line["event"] == "worker.started"}
    assert child_pids and parent_pids and child_pids.isdisjoint(parent_pids)


def test_warn_level_hides_info(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    worker = run_worker_through(engine, world, settings, tmp_path, "warn")
    lines = worker.lines()
    events = [line["event"] for line in lines]
    assert "task.started" not in events and "task.completed" not in events
    assert "worker.started" not in events
    assert "task.failed" in events  # the rejection is logged at warn
    assert {line["level"] for line in lines} <= {"warn", "error", "fatal"}


def test_bad_log_level_refuses_to_start(settings: Settings) -> None:
    env = settings_env(settings.with_overrides(log_level="info"), LOG_LEVEL="loud")
    proc = subprocess.run(
        celery_argv("worker"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "configuration error: LOG_LEVEL must be one of "
        "fatal|error|warn|info|debug|trace|silent, got 'loud'"
    )
    assert "Traceback" not in proc.stderr


def test_a_queue_of_an_older_version_is_one_line_not_a_traceback(settings: Settings) -> None:
    """``-Q exports,maintenance`` (the queue earlier versions required): exit 2 and one
    line naming it and the queues that exist. Before: Celery's 72-line traceback whose
    hint (``task_create_missing_queues``) is wrong for this project."""
    proc = subprocess.run(
        celery_argv("worker", "-Q", "exports,maintenance", "--without-mingle"),
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "celery worker: the queue 'maintenance' does not exist in this version; workers "
        "consume exports and/or reminders (-Q exports,reminders); see CHANGELOG.md\n"
    )
    assert proc.stdout == ""
