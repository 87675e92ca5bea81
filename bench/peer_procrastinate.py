"""Peer for P1: procrastinate draining bare no-op jobs on the same PostgreSQL server.

What it measures: how many no-op jobs per second procrastinate (a job queue in Python
that keeps its queue in PostgreSQL) gets through with ``concurrency`` workers, counted
from the first job start to the last job finish. ``bench.run`` divides our small exports
per second by this figure (``p1_export_vs_procrastinate``).

Why it is the comparison: our tasks keep their state in PostgreSQL and travel through
Celery and Redis. procrastinate is the nearest design without a broker: a job is a row
in ``procrastinate_jobs``, a worker takes one with procrastinate's own SQL function
(``procrastinate_fetch_job_v2``: ``FOR UPDATE SKIP LOCKED``, status ``todo`` ->
``doing``) and records the end with another (``procrastinate_finish_job_v1``); triggers
write a ``procrastinate_events`` row at each change of status. Each job costs a few round
trips and row writes to PostgreSQL, the floor a PostgreSQL-backed queue in Python has.

How:

1. A database of its own (``tdbench_procrastinate_<hex>``), created over a maintenance
   connection to the given server and dropped (``WITH (FORCE)``) in a ``finally``.
2. procrastinate's schema, applied with its own API: ``procrastinate.App(connector=
   PsycopgConnector(conninfo=...))``, ``app.open()`` (sync), then
   ``app.schema_manager.apply_schema()``.
3. The workers start first, as real OS processes, through procrastinate's own command
   line (``python -m procrastinate --app=bench.peer_procrastinate.app worker``, the way
   it is deployed; ``app`` is built on first access, see ``__getattr__``), log level
   ``warning`` like our Celery workers (no per-job log lines). The bench waits, with a
   deadline, until each worker's LISTEN connection is open (``pg_stat_activity``), so
   every worker is warm, registered and idle when the jobs appear.
4. ``jobs`` no-op jobs are deferred by task name with one
   ``app.configure_task(name, queue=...).batch_defer(...)`` (one INSERT through
   ``procrastinate_defer_jobs_v1``, one transaction): all become visible at once, at the
   commit, and the workers wake on its NOTIFY. Deferring is not timed.
5. The bench polls ``procrastinate_jobs`` with a deadline until every job has succeeded
   (failing early if a job fails or a worker exits), then reads the time from the
   database: ``seconds`` = last ``succeeded`` event minus first ``started`` event
   (``procrastinate_events.at``, the database clock). Process start-up, the defer and the
   polling are outside that window. ``jobs_per_s`` = ``jobs / seconds``.

Mode: ``processes`` (the default) starts ``concurrency`` worker processes with
``--concurrency=1`` each. Our worker is ``-c 2`` prefork: two OS processes each running
one task at a time, so two single-job procrastinate processes are the like-for-like
shape, and each gets a core of its own instead of sharing one event loop and its GIL.
(``--concurrency`` inside one procrastinate process is asyncio concurrency; a sync task
then runs in a thread pool, and procrastinate's documentation advises against concurrency
for synchronous blocking tasks.) ``mode="async"`` runs one process with
``--concurrency=N`` instead, for reference.

The job: ``noop``, a plain ``def`` that returns ``None`` (our bare Celery no-op is a
plain ``def`` too), so procrastinate runs it as a sync task (through ``asgiref``'s
``sync_to_async`` in a worker thread). Jobs are kept (``--delete-jobs=never``, the
default), so their events can be read back.

Compare at the same job count as the drain it is set against: procrastinate's rate falls
as the backlog grows, most likely as each fetch's index scan steps over the rows already
taken and not yet vacuumed (here, quiet machine: about 540 jobs/s for 2,000 jobs, 300
for 5,000, 255 for 8,000, PostgreSQL's CPU per job rising from about 0.9 to 3.2 ms). Out
of the box each pool checkout also runs a connection check (``check_connection``: an
empty query) and each query its own transaction: about four transactions per job.

Also returned: per-worker job counts and first-start offsets (``start_skew_s``), the defer
time, and where the CPU went during the drain (the worker processes, and the PostgreSQL
backends of their connections, told apart by ``application_name``), with the machine's
other busy cores and load average. All connections go to the loopback address only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import procrastinate
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness.waiting import wait_for

DSN_ENV = "TDBENCH_PROCRASTINATE_DSN"  # the workers' conninfo, read when they import us
TASK_NAME = "tdbench_noop"
QUEUE = "tdbench"
WORKER_APP_NAME = "tdbench-procrastinate-worker"  # application_name of the workers' conns
DEFERRER_APP_NAME = "tdbench-procrastinate-deferrer"
MONITOR_APP_NAME = "tdbench-procrastinate-monitor"
REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60.0  # every worker started and LISTENing (within timeout_s)
STOP_TIMEOUT_S = 15.0  # a SIGTERMed worker's graceful exit, before SIGKILL
POLL_S = 0.1  # progress polling; the figure itself comes from the job rows
CLK_TCK = os.sysconf("SC_CLK_TCK")
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def noop() -> None:
    """The bare job: does nothing (the counterpart of the bench's Celery no-op)."""


def __getattr__(name: str) -> Any:
    """``app``, the workers' App, built on first use: `python -m procrastinate
    --app=bench.peer_procrastinate.app worker` reads it in each worker process, with
    DSN_ENV set to the bench database (its pool opens when the worker command starts).
    Built lazily, importing this module (``bench.run``) builds no App."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    worker_app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=os.environ.get(DSN_ENV, ""))
    )
    worker_app.task(name=TASK_NAME, queue=QUEUE)(noop)
    globals()["app"] = worker_app
    return worker_app


# ---- helpers ------------------------------------------------------------------------------
def _libpq_url(database_url: str) -> str:
    """A SQLAlchemy-style ``postgresql+driver://`` URL as libpq reads it."""
    return re.sub(r"^postgres(?:ql)?\+\w+://", "postgresql://", database_url)


def _check_local(conninfo: str) -> None:
    hosts = [h for h in str(conninfo_to_dict(conninfo).get("host") or "").split(",") if h]
    if any(h not in LOCAL_HOSTS and not h.startswith("/") for h in hosts):
        raise SystemExit("peer_procrastinate: refusing a non-local PostgreSQL server")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _machine_busy_s() -> float:
    """CPU seconds used by every process on the machine (all cores; not idle/iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


@dataclass
class _CpuSnapshot:
    workers: float
    postgres: dict[int, float]
    machine: float
    at: float


def _cpu_snapshot(monitor: psycopg.Connection[Any], db_name: str, pids: list[int]) -> _CpuSnapshot:
    rows = monitor.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
        (db_name, WORKER_APP_NAME),
    ).fetchall()
    return _CpuSnapshot(
        workers=sum(_cpu_seconds(p) for p in pids),
        postgres={int(r[0]): _cpu_seconds(int(r[0])) for r in rows},
        machine=_machine_busy_s(),
        at=time.monotonic(),
    )


@contextmanager
def _scratch_database(admin_conninfo: str) -> Iterator[str]:
    """A new, empty database on the server; dropped (with its sessions) at the end."""
    name = f"tdbench_procrastinate_{secrets.token_hex(5)}"
    with psycopg.connect(admin_conninfo, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(admin_conninfo, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@dataclass
class _Worker:
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        with suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def _start_worker(name: str, dsn: str, concurrency: int, log: Path) -> _Worker:
    env = dict(os.environ)
    env[DSN_ENV] = dsn
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    argv = [
        sys.executable,
        "-m",
        "procrastinate",
        "--app=bench.peer_procrastinate.app",
        "--log-level=warning",
        "worker",
        f"--name={name}",
        f"--queues={QUEUE}",
        f"--concurrency={concurrency}",
        "--delete-jobs=never",
    ]
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as a group in the end
        )
    return _Worker(popen=popen, log=log)


def _stop_workers(workers: list[_Worker]) -> None:
    """SIGTERM (procrastinate's graceful stop), wait with a deadline, then SIGKILL."""
    for w in workers:
        if w.popen.poll() is None:
            with suppress(ProcessLookupError):
                w.popen.send_signal(signal.SIGTERM)
    with suppress(AssertionError):  # a timeout: SIGKILL below
        wait_for(
            lambda: all(w.popen.poll() is not None for w in workers),
            STOP_TIMEOUT_S,
            POLL_S,
            "workers to stop after SIGTERM",
        )
    for w in workers:
        if w.popen.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(w.popen.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            w.popen.wait(timeout=STOP_TIMEOUT_S)


def _check_alive(workers: list[_Worker]) -> None:
    for w in workers:
        if w.popen.poll() is not None:
            raise RuntimeError(
                f"peer_procrastinate: a worker exited ({w.popen.returncode}):\n{w.tail()}"
            )


# ---- the measurement ----------------------------------------------------------------------
def procrastinate_noop_jobs_per_s(
    database_url: str,
    jobs: int,
    concurrency: int = 2,
    timeout_s: float = 300,
    mode: str = "processes",
) -> dict[str, Any]:
    """``jobs`` no-op procrastinate jobs drained by ``concurrency`` workers; see the module
    docstring. ``mode``: ``"processes"`` (``concurrency`` processes of one job each) or
    ``"async"`` (one process, ``--concurrency=concurrency``)."""
    if jobs < 1 or concurrency < 1:
        raise ValueError("jobs and concurrency must be at least 1")
    if mode not in ("processes", "async"):
        raise ValueError(f"mode must be 'processes' or 'async', not {mode!r}")
    deadline = time.monotonic() + timeout_s
    admin = _libpq_url(database_url)
    _check_local(admin)

    with _scratch_database(admin) as db_name, tempfile.TemporaryDirectory() as logs:
        worker_dsn = make_conninfo(admin, dbname=db_name, application_name=WORKER_APP_NAME)
        deferrer = procrastinate.App(
            connector=procrastinate.PsycopgConnector(
                conninfo=make_conninfo(admin, dbname=db_name, application_name=DEFERRER_APP_NAME)
            )
        )
        workers: list[_Worker] = []
        monitor = psycopg.connect(
            make_conninfo(admin, dbname=db_name, application_name=MONITOR_APP_NAME),
            autocommit=True,
        )
        try:
            with deferrer.open():
                deferrer.schema_manager.apply_schema()

                if mode == "processes":
                    shape = [(f"tdbench-w{i}", 1) for i in range(concurrency)]
                else:
                    shape = [("tdbench-w0", concurrency)]
                for name, per_process in shape:
                    log = Path(logs) / f"{name}.log"
                    workers.append(_start_worker(name, worker_dsn, per_process, log))

                def listening() -> bool:
                    _check_alive(workers)
                    row = monitor.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                        " AND application_name = %s AND state = 'idle'"
                        " AND query LIKE 'LISTEN %%'",
                        (db_name, WORKER_APP_NAME),
                    ).fetchone()
                    return row is not None and row[0] >= len(workers)

                wait_for(
                    listening,
                    min(READY_TIMEOUT_S, max(deadline - time.monotonic(), 0.0)),
                    POLL_S,
                    f"{len(workers)} procrastinate worker(s) to LISTEN",
                )

                pids = [w.popen.pid for w in workers]
                load_before = os.getloadavg()
                before = _cpu_snapshot(monitor, db_name, pids)
                started = time.perf_counter()
                deferrer.configure_task(TASK_NAME, queue=QUEUE).batch_defer(
                    *({} for _ in range(jobs))
                )
                defer_s = time.perf_counter() - started

            def drained() -> bool:
                row = monitor.execute(
                    "SELECT count(*) FILTER (WHERE status = 'succeeded'),"
                    " count(*) FILTER (WHERE status NOT IN ('todo', 'doing', 'succeeded'))"
                    " FROM procrastinate_jobs"
                ).fetchone()
                assert row is not None
                if row[1]:
                    raise RuntimeError(
                        f"peer_procrastinate: {row[1]} job(s) did not succeed:\n"
                        + "\n".join(w.tail() for w in workers)
                    )
                _check_alive(workers)
                return bool(row[0] >= jobs)

            wait_for(
                drained,
                max(deadline - time.monotonic(), 0.0),
                POLL_S,
                f"{jobs} procrastinate jobs to succeed",
            )
            after = _cpu_snapshot(monitor, db_name, pids)
            load_after = os.getloadavg()

            window = monitor.execute(
                "SELECT count(*) FILTER (WHERE type = 'started'),"
                " count(*) FILTER (WHERE type = 'succeeded'),"
                " EXTRACT(EPOCH FROM max(at) FILTER (WHERE type = 'succeeded')"
                "   - min(at) FILTER (WHERE type = 'started'))"
                " FROM procrastinate_events"
            ).fetchone()
            assert window is not None and window[2] is not None
            n_started, n_succeeded, seconds = int(window[0]), int(window[1]), float(window[2])
            if n_started != jobs or n_succeeded != jobs:
                raise RuntimeError(
                    f"peer_procrastinate: {n_started} started / {n_succeeded} succeeded "
                    f"events for {jobs} jobs"
                )
            # Who ran what, and when each worker took its first job (while they are still
            # registered: unregistering sets procrastinate_jobs.worker_id to NULL).
            per_worker = monitor.execute(
                "SELECT j.worker_id, count(*),"
                " EXTRACT(EPOCH FROM min(e.at)"
                "   - (SELECT min(at) FROM procrastinate_events WHERE type = 'started'))"
                " FROM procrastinate_jobs j"
                " JOIN procrastinate_events e ON e.job_id = j.id AND e.type = 'started'"
                " GROUP BY j.worker_id ORDER BY j.worker_id"
            ).fetchall()
        finally:
            monitor.close()
            _stop_workers(workers)

    wall = max(after.at - before.at, 1e-6)
    workers_cpu = after.workers - before.workers
    postgres_cpu = sum(v - before.postgres.get(pid, 0.0) for pid, v in after.postgres.items())
    machine_cpu = after.machine - before.machine
    return {
        "jobs_per_s": jobs / seconds,
        "jobs": jobs,
        "concurrency": concurrency,
        "mode": mode,
        "worker_processes": len(shape),
        "seconds": seconds,
        "procrastinate_version": version("procrastinate"),
        "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
        "task": "sync def, returns None",
        "defer_s": defer_s,
        "per_worker_jobs": [int(r[1]) for r in per_worker],
        "start_skew_s": max(float(r[2]) for r in per_worker),
        "cpu": {
            # from just before the defer to the drain seen by polling (wall_s)
            "wall_s": wall,
            "workers_s": workers_cpu,
            "postgres_s": postgres_cpu,
            "workers_us_per_job": workers_cpu / jobs * 1e6,
            "postgres_us_per_job": postgres_cpu / jobs * 1e6,
            # everything else busy on the machine (incl. the defer and this process)
            "other_cores": max(0.0, (machine_cpu - workers_cpu - postgres_cpu) / wall),
        },
        "loadavg_1m_before": load_before[0],
        "loadavg_1m_after": load_after[0],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--mode", choices=("processes", "async"), default="processes")
    cli = parser.parse_args(argv)
    result = procrastinate_noop_jobs_per_s(
        cli.database_url, cli.jobs, concurrency=cli.concurrency, mode=cli.mode
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    # Run the imported module's copy: an App built from code in ``__main__`` makes
    # procrastinate warn (it cannot know the task paths of a ``__main__`` module).
    from bench.peer_procrastinate import main as _main

    _main()
