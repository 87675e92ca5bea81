"""A pool process lost mid-task is its run's failed attempt, reported by the worker's main
process (docs/design.md, "Lifecycle"), which also issues each delivery's execution id
(docs/design.md, "Lease").

The report's thread runs while billiard forks the replacement, and a child forked while
that thread held a lock waits on it for ever (with an SQLAlchemy engine: an import lock on
the first connection; found by tests/process/test_pool_process_lost.py). So each try is a
psycopg2 connection of its own (imported at start), one unprepared bounded statement, and
the fork guard covers only the log line: held across the round trip, a slow database held
up the renewal thread's logging and the main thread's fork.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg2
from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery import bootsteps
from celery.worker import state
from celery.worker.request import Request

from ledger import lease
from tasks import delivery
from teamdesk.config import Settings, get_settings
from teamdesk.db import KEEPALIVES, libpq_url
from teamdesk.logs import log_event
from worker.forking import fork_guard

log = logging.getLogger("teamdesk.worker")

MSG_LOST = "The worker process running the task was lost ({how}); the task will be retried."
MSG_LOST_FINAL = (
    "The task failed after {n} attempts; the worker process running the last one was lost ({how})."
)
CONNECT_TIMEOUT_S = 2
RETRY_FIRST_S = 0.25  # then doubling, up to RETRY_MAX_S between tries
RETRY_MAX_S = 4.0
_HOW = re.compile(r"exited prematurely: (?P<how>.+?)(?: Job: \d+)?\.?$")


@dataclass(frozen=True)
class LostExecution:
    """An execution whose pool process died: the lease the main process issued for it."""

    held: lease.Lease
    pid: int | None
    how: str  # billiard's words for the exit: "signal 9 (SIGKILL)", "exitcode 1"

    def fields(self) -> dict[str, Any]:
        return {
            "task_id": str(self.held.task_id),
            "run": self.held.run,
            "execution": str(self.held.execution_id)[:8],
            "pool_pid": self.pid,
            "exit": self.how,
        }


def how_it_ended(exc: BaseException) -> str:
    """``signal 9 (SIGKILL)`` from billiard's ``Worker exited prematurely: signal 9
    (SIGKILL) Job: 3.``; the exception's name when it says nothing of the kind."""
    match = _HOW.search(str(exc))
    return match.group("how") if match else type(exc).__name__


class ExecutionRequest(Request):
    """Celery's request, which also issues the delivery's execution id and reports an
    execution whose pool process was lost (in the worker's main process)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._request_dict[delivery.EXECUTION_ID_FIELD] = str(uuid.uuid4())

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        try:
            lost = self._lost_execution(exc_info.exception)
        except Exception:  # never keep Celery's own failure handling from running
            lost = None
        if lost is None:
            super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
            return
        # What Celery's own re-send would do for the message (it ends, as a retry), without
        # the re-send: the ledger decides what runs next.
        state.task_ready(self)
        if self.task.acks_late:
            self.acknowledge()
        self.send_event("task-retried", exception=f"WorkerLostError({lost.how!r})", traceback="")
        reports().submit(lost)

    def _lost_execution(self, exc: BaseException) -> LostExecution | None:
        """The execution this request's lost pool process held; None when the failure is
        not a lost process, Celery caused it (a terminate, a revoke, a cold shutdown), the
        message named no run, or the worker is stopping: a SIGTERM to the whole process
        group (systemd's ``KillMode=control-group``) ends the pool's processes too, and
        those runs go back by the heartbeat's expiry."""
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if state.should_terminate or state.should_stop is not None:
            return None
        if self._already_revoked or self._already_cancelled:
            return None
        if isinstance(exc, SystemExit | KeyboardInterrupt):
            exc = self._worker_lost_info(exc).exception
        if not isinstance(exc, WorkerLostError):
            return None
        try:
            message = delivery.parse(tuple(self.args or ()), dict(self.kwargs or {}))
        except delivery.MessageRefused:
            return None
        issued = self._request_dict.get(delivery.EXECUTION_ID_FIELD)
        held = lease.Lease(message.task_id, message.run, uuid.UUID(issued), attempt=0)
        return LostExecution(held, self.worker_pid, how_it_ended(exc))


# billiard looks when a process's sentinel says it ended, but one whose pipe closed before
# it became a zombie is not reapable yet, and billiard's next look is its 5 s maintenance
# timer: a loss was seen 0.1 to 5 s after the kill.
POOL_LOOK_S = 0.5


class PoolWatch(bootsteps.StartStopStep):
    """Runs billiard's ``maintain_pool`` (reap exited processes, fail their jobs with
    ``WorkerLostError``, start replacements) every ``POOL_LOOK_S`` on the event loop, as
    billiard's own timer does. Prefork only."""

    requires = {"celery.worker.components:Pool", "celery.worker.components:Timer"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.entry: Any = None

    def start(self, parent: Any) -> None:
        look = getattr(parent.pool, "maintain_pool", None)
        if callable(look) and getattr(parent, "use_eventloop", False):
            self.entry = parent.timer.call_repeatedly(POOL_LOOK_S, look, priority=0)

    def stop(self, parent: Any) -> None:
        if self.entry is not None:
            self.entry.cancel()
            self.entry = None


class LostReports:
    """The thread that writes lost executions to the ledger, one at a time."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._queue: queue.SimpleQueue[LostExecution] = queue.SimpleQueue()
        self._pending = 0
        self._settled = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="teamdesk-lost", daemon=True)
        self._thread.start()

    def submit(self, lost: LostExecution) -> None:
        with self._settled:
            self._pending += 1
        self._queue.put(lost)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every submitted report to be written (the worker's
        stop); whether they all were."""
        with self._settled:
            return self._settled.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while True:
            lost = self._queue.get()
            try:
                self.report(lost)
            except Exception as exc:  # never let the thread die
                with fork_guard:
                    log_event(
                        log,
                        "task.process_lost",
                        logging.ERROR,
                        outcome="unreported",
                        error=type(exc).__name__,
                        **lost.fields(),
                    )
            finally:
                with self._settled:
                    self._pending -= 1
                    self._settled.notify_all()

    def report(self, lost: LostExecution) -> lease.FailedAttempt | None:
        """Write the lost attempt (tried again for up to half of ``STALE_AFTER_S`` while
        PostgreSQL is unreachable, then raises) and log ``task.process_lost``."""
        settings = self.settings
        how = lost.how if lost.pid is None else f"pid {lost.pid}, {lost.how}"
        deadline = time.monotonic() + settings.stale_after_s / 2
        pause = RETRY_FIRST_S
        while True:
            try:
                written = self._write(lost, how)
                break
            except psycopg2.OperationalError:
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)  # the database is away; the attempt is over either way
            pause = min(pause * 2, RETRY_MAX_S)
        self._log(lost, written)
        return written

    def _write(self, lost: LostExecution, how: str) -> lease.FailedAttempt | None:
        """One try, on a connection of its own, closed after it."""
        settings = self.settings
        conn = psycopg2.connect(
            libpq_url(settings.database_url),
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name="teamdesk-worker-lost",
            **KEEPALIVES,
        )
        try:
            conn.autocommit = True
            return lease.report_lost(
                conn,
                lost.held,
                max_attempts=settings.max_task_attempts,
                base_delay_s=settings.retry_base_delay_s,
                message=MSG_LOST.format(how=how),
                final_message=MSG_LOST_FINAL.format(n=settings.max_task_attempts, how=how),
            )
        finally:
            conn.close()

    def _log(self, lost: LostExecution, written: lease.FailedAttempt | None) -> None:
        fields = lost.fields()
        with fork_guard:
            if written is None:  # it never claimed, or the run is no longer its own
                log_event(log, "task.process_lost", logging.WARNING, outcome="not_held", **fields)
            elif written.status == "FAILED":
                log_event(
                    log,
                    "task.process_lost",
                    logging.ERROR,
                    outcome="failed",
                    attempt=written.attempt,
                    **fields,
                )
            else:
                log_event(
                    log,
                    "task.process_lost",
                    logging.WARNING,
                    outcome="retry",
                    attempt=written.attempt,
                    retry_in_s=round(written.retry_in_s, 3),
                    **fields,
                )


_reports: LostReports | None = None
_reports_lock = threading.Lock()


def reports() -> LostReports:
    """This worker process's reporter, started on first use."""
    global _reports
    with _reports_lock:
        if _reports is None:
            _reports = LostReports(get_settings())
        return _reports


def settle(timeout_s: float) -> None:
    """At the worker's stop: let the reports under way be written, up to ``timeout_s``."""
    if _reports is not None:
        _reports.settle(timeout_s)
