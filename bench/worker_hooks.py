"""Loaded inside bench workers by the test-hook seam ``TEAMDESK_TEST_HOOKS=bench.worker_hooks``.

``tasks/celery.py`` (what ``celery -A tasks`` loads) builds the app with ``create_app()``
and then imports this module, so what it adds lives on exactly the app (settings, routes,
bootsteps, signals) the real tasks use:

- ``bench.noop``: a bare task with the real tasks' options and an empty body, the
  baseline every throughput ratio divides by;
- per pool child, the wall-clock time of its first task start and last task end, the task
  count, each ``execute()`` duration (claim to completion) and its peak RSS, written to
  ``$BENCH_STATS_DIR/<pid>.json`` by a small thread every ``FLUSH_EVERY_S`` (a pool child
  is not always told that it exits, so the bench waits one interval after the last task);
- with ``BENCH_TRACE=1``, the round-trip tracer of :mod:`bench.tracer` (profile runs only).

Nothing here changes what the real tasks do; the signal handlers cost a few microseconds
per task and run in the baseline as well.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

from celery import Task, signals

from bench import FLUSH_EVERY_S, NOOP_TASK
from ledger.errors import TaskRejected
from tasks import definitions
from tasks.execution import TaskFailed
from worker.lost import ExecutionRequest

TRACING = os.environ.get("BENCH_TRACE") == "1"
MAX_DURATIONS = 2000

# tasks/celery.py imports this module right after it built ``app`` (while tasks.celery is
# still being imported, so only the names bound before that point exist).
_entry = sys.modules.get("tasks.celery")
app = getattr(_entry, "app", None)
assert app is not None, "bench.worker_hooks must be loaded by tasks/celery.py (TEAMDESK_TEST_HOOKS)"


@app.task(
    name=NOOP_TASK,
    bind=True,
    shared=False,
    acks_late=True,
    Request=ExecutionRequest,
    throws=(TaskRejected, TaskFailed),
)
def noop(self: Task, task_id: str, run: int) -> dict[str, Any]:
    """The real tasks' signature and result shape, without the ledger."""
    return {"task_id": task_id, "run": run, "outcome": "completed", "summary": "noop"}


class _Stats:
    def __init__(self) -> None:
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.count = 0
        self.durations: list[float] = []
        self.hwm_before_kib: int | None = None
        self.dirty = False
        self.task_started = 0.0
        self.flusher: threading.Thread | None = None
        self.directory = os.environ.get("BENCH_STATS_DIR")

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "first_start": self.first_start,
            "last_end": self.last_end,
            "count": self.count,
            "execute_s": self.durations,
            "hwm_before_kib": self.hwm_before_kib,
            "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        }

    def flush(self) -> None:
        if not self.directory:
            return
        path = Path(self.directory) / f"{os.getpid()}.json"
        tmp = path.with_suffix(".part")
        self.dirty = False
        tmp.write_text(json.dumps(self.as_dict()))
        tmp.replace(path)
        if TRACING:
            from bench import tracer

            tracer.dump()

    def start_flusher(self) -> None:
        if self.flusher is None:  # threads do not survive the fork: start it in the child
            self.flusher = threading.Thread(target=self._flush_forever, daemon=True)
            self.flusher.start()

    def _flush_forever(self) -> None:
        while True:
            time.sleep(FLUSH_EVERY_S)
            if self.dirty:
                self.flush()


_stats = _Stats()


def _vm_hwm_kib() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _on_prerun(**_: Any) -> None:
    _stats.task_started = time.perf_counter()
    if _stats.first_start is None:
        _stats.first_start = time.time()
        _stats.hwm_before_kib = _vm_hwm_kib()
        _stats.start_flusher()


def _on_postrun(**_: Any) -> None:
    _stats.last_end = time.time()
    _stats.count += 1
    if _real_execute is None and len(_stats.durations) < MAX_DURATIONS:
        _stats.durations.append(time.perf_counter() - _stats.task_started)
    _stats.dirty = True


def _on_child_exit(**_: Any) -> None:
    if _stats.count:
        _stats.flush()


# The tasks call ``execute`` through tasks.definitions' globals, so rebinding it there
# times every call. If that module is ever reorganised, P2 falls back to prerun/postrun.
_real_execute: Any = getattr(definitions, "execute", None)


def _timed_execute(*args: Any, **kwargs: Any) -> Any:
    """``execute()`` = claim to completion (and the completed/skipped re-read)."""
    started = time.perf_counter()
    try:
        return _real_execute(*args, **kwargs)
    finally:
        if len(_stats.durations) < MAX_DURATIONS:
            _stats.durations.append(time.perf_counter() - started)


if _real_execute is not None:
    definitions.execute = _timed_execute
signals.task_prerun.connect(_on_prerun, weak=False)
signals.task_postrun.connect(_on_postrun, weak=False)
signals.worker_process_shutdown.connect(_on_child_exit, weak=False)

if TRACING:
    from bench import tracer

    tracer.install()
