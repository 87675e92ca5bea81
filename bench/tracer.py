"""Round-trip tracer for profile runs (``BENCH_TRACE=1``): every PostgreSQL and Redis round
trip a pool child makes, timed and grouped, plus the time of the task's named steps.

PostgreSQL: the engine's connections are built with a psycopg2 connection/cursor subclass
that times ``execute``, ``copy_expert``, ``commit`` and ``rollback``; a round trip that
opens a transaction is also counted as a ``BEGIN`` (psycopg2 sends it first, separately).
Every statement is named after what it does (``claim``, ``progress``, ``complete``, ...);
``BEGIN`` and ``COMMIT`` are named after the statement they open or close (a pool sends
nothing at checkout: teamdesk.db.hung_up), so each step's round trips can be read off
directly.

Redis: ``Redis.execute_command`` and ``Pipeline.execute`` (result backend, task events),
timed by command name.

Steps: wrappers around ``execute()`` and the named functions it calls. ``celery_child``
is the rest of the child's task time (prerun to postrun minus ``execute()``).

Written to ``$BENCH_STATS_DIR/trace-<pid>.json`` with the stats. Profile runs only: the
wrappers cost a few microseconds per call, so throughput figures never use them.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions as ext
import redis
import redis.client
import sqlalchemy as sa
from celery import signals

STATEMENTS = (  # a needle in the statement (whitespace folded) -> its name, first match wins
    ("SET status = 'RUNNING'", "claim"),
    ("SET progress", "progress"),
    ("SET status = 'COMPLETED'", "complete"),
    ("SET status = %(status)s", "failure_report"),
    ("SELECT status, run FROM background_tasks", "completed_reread"),
    ("SELECT 1 FROM background_tasks", "check_lease"),
    ("pg_advisory_xact_lock", "reminder.team_lock"),
    ("FROM memberships", "role_check"),
    ("FOR UPDATE", "reminder.ticket_lock"),
    ("INSERT INTO notifications", "reminder.notification"),
    ("UPDATE tickets SET version", "reminder.bump_version"),
    ("INSERT INTO system_events", "reminder.event"),
    ("SELECT count(*)", "export.count"),
    ("row_number()", "export.boundaries"),
    ("SET LOCAL", "transaction_setup"),
    ("SET TRANSACTION", "transaction_setup"),
    ("set_config", "transaction_setup"),
)
MARKERS = ("ping", "BEGIN", "COMMIT", "ROLLBACK")


class Totals:
    def __init__(self) -> None:
        self.tasks = 0
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.where: dict[str, list[str]] = {}  # the first call site of every Redis command

    def add(self, key: str, seconds: float, calls: int = 1) -> None:
        self.seconds[key] += seconds
        self.calls[key] += calls
        if key.startswith("redis:") and key not in self.where:
            self.where[key] = [
                f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()[-12:-2]
            ]


totals = Totals()
_last: dict[int, str] = {}  # id(dbapi conn) -> name of its last statement


def _name(sql: str) -> str:
    text = " ".join(sql.split())
    if text in ("SELECT 1", "SELECT 1;"):
        return "ping"
    if text.startswith("COPY"):
        return "export.copy"
    for needle, name in STATEMENTS:
        if needle in text:
            return name
    return text[:40]


def _record(conn: Any, name: str, seconds: float) -> None:
    """One PostgreSQL round trip; BEGIN/COMMIT/ROLLBACK are named after the statement
    they open or close, so a transaction's cost lands on the step that needed it."""
    key = id(conn)
    if name in ("COMMIT", "ROLLBACK"):
        name = f"{name} (after {_last.get(key, '?')})"
    elif name != "ping":
        _last[key] = name
    totals.add(f"pg:{name}", seconds)


class TracedCursor(ext.cursor):
    def execute(self, query: Any, vars: Any = None) -> Any:
        conn = self.connection
        opens = not conn.autocommit and conn.status == ext.STATUS_READY
        name = _name(query.decode() if isinstance(query, bytes) else str(query))
        started = time.perf_counter()
        try:
            return super().execute(query, vars)
        finally:
            elapsed = time.perf_counter() - started
            if opens:  # psycopg2 sent BEGIN first: two round trips, split evenly
                elapsed /= 2
                totals.add(f"pg:BEGIN (before {name})", elapsed)
            _record(conn, name, elapsed)

    def copy_expert(self, sql: Any, file: Any, size: int = 8192) -> Any:
        started = time.perf_counter()
        try:
            return super().copy_expert(sql, file, size)
        finally:
            _record(self.connection, "export.copy", time.perf_counter() - started)


class TracedConnection(ext.connection):
    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cursor_factory", TracedCursor)
        return super().cursor(*args, **kwargs)

    def commit(self) -> None:
        busy = self.status != ext.STATUS_READY
        started = time.perf_counter()
        super().commit()
        if busy:
            _record(self, "COMMIT", time.perf_counter() - started)

    def rollback(self) -> None:
        busy = self.status != ext.STATUS_READY
        started = time.perf_counter()
        super().rollback()
        if busy:
            _record(self, "ROLLBACK", time.perf_counter() - started)


def _trace_engines() -> None:
    from teamdesk import db

    real_make_engine = db.make_engine

    def make_engine(url: str, prepared_statements: bool = True, **kwargs: object) -> sa.Engine:
        engine = real_make_engine(
            url,
            prepared_statements,
            connect_args={
                "connect_timeout": 5,
                "application_name": "teamdesk-tasks",
                "connection_factory": TracedConnection,
            },
            **kwargs,
        )
        return engine

    db.make_engine = make_engine


def _trace_redis() -> None:
    real_command = redis.Redis.execute_command
    real_pipeline = redis.client.Pipeline.execute

    def execute_command(self: Any, *args: Any, **options: Any) -> Any:
        started = time.perf_counter()
        try:
            return real_command(self, *args, **options)
        finally:
            totals.add(f"redis:{str(args[0]).upper()}", time.perf_counter() - started)

    def execute(self: Any, raise_on_error: bool = True) -> Any:
        names = "+".join(sorted({str(c[0][0]).upper() for c in self.command_stack}))
        started = time.perf_counter()
        try:
            return real_pipeline(self, raise_on_error)
        finally:
            totals.add(f"redis:pipeline({names})", time.perf_counter() - started)

    redis.Redis.execute_command = execute_command  # type: ignore[method-assign]
    redis.client.Pipeline.execute = execute  # type: ignore[method-assign]


def _wrap(owner: Any, name: str, key: str) -> None:
    """Time calls of ``owner.name`` (skipped when the code under test has no such name)."""
    real: Callable[..., Any] | None = getattr(owner, name, None)
    if real is None:
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals.add(f"step:{key}", time.perf_counter() - started)

    setattr(owner, name, wrapped)


def _trace_steps() -> None:
    from ledger import lease
    from tasks import definitions, execution, export, queueing

    for fn in (
        "claim",
        "report_progress",
        "complete_export",
        "complete_in_transaction",
        "check_lease",
    ):
        _wrap(lease, fn, f"lease.{fn}")
    _wrap(queueing, "report_progress", "queueing.report_progress")
    _wrap(execution, "log_event", "log_event")
    for fn in ("check_permission", "_read_small", "_read_in_batches", "_batch_done"):
        _wrap(export, fn, f"export.{fn}")
    _wrap(definitions, "run_export", "body.run_export")
    _wrap(definitions, "run_reminder", "body.run_reminder")
    _wrap(definitions, "execute", "execute")  # outermost: wraps bench's timed execute


_task_started: list[float] = []


def _prerun(**_: Any) -> None:
    _task_started[:] = [time.perf_counter()]


def _postrun(**_: Any) -> None:
    if _task_started:
        totals.add("celery_child_task", time.perf_counter() - _task_started[0])
    totals.tasks += 1


def dump() -> None:
    directory = os.environ.get("BENCH_STATS_DIR")
    if not directory or not totals.tasks:
        return
    data = {
        "tasks": totals.tasks,
        "seconds": totals.seconds,
        "calls": totals.calls,
        "where": totals.where,
    }
    Path(directory, f"trace-{os.getpid()}.json").write_text(json.dumps(data))


def install() -> None:
    assert psycopg2  # the driver the engine uses
    _trace_engines()
    _trace_redis()
    _trace_steps()
    signals.task_prerun.connect(_prerun, weak=False)
    signals.task_postrun.connect(_postrun, weak=False)
    signals.worker_process_shutdown.connect(lambda **_: dump(), weak=False)
