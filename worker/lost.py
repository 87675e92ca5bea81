"""A pool process lost mid-task - the OOM killer, a segfault, ``kill -9`` - is the run's
failed attempt, reported by the worker's main process within seconds (docs/design.md,
"Lifecycle").

The main process issues each delivery's execution id as it hands the message to its pool
(:class:`ExecutionRequest`, Celery's ``Task.Request``): the id travels in the request
the pool process receives, which claims with it (tasks/delivery.py). When billiard
reports that process gone (``WorkerLostError``, at once: the pool watches its children),
the main process acknowledges the message and hands the lease it knows to
:class:`LostReports`, whose thread writes ``ledger.lease.report_lost``: the attempt
failed, WAITING after the backoff or FAILED on the last attempt, with a ``last_error``
that names the process and how it ended. The write is the lease's own guarded statement,
so it changes nothing when that execution never claimed, or a newer execution or a
cancel owns the run. Nothing waits on Celery's re-send after a lost process
(``retry_on_worker_lost``: a 180 s countdown held in a worker's memory), nor on the
staleness rule, and a lost process is never a recovery.

The write runs on a thread of its own, never on the event loop: PostgreSQL may be away
(then it is tried again for up to half of ``STALE_AFTER_S``, as a failure report is;
past that the staleness rule takes the run back). billiard forks the replacement pool
process at that very moment, and a child forked while the thread held a lock the child
then takes waits on it forever: with an SQLAlchemy engine, a module's import lock on the
first connection (found by tests/process/test_pool_process_lost.py). So each try is one
psycopg2 connection of its own (imported at start, nothing imported on the way), one
unprepared statement bounded by the lease's statement timeout, closed after it; the
fork guard (worker/liveness.py) is held only around the log line and its metric. Holding
it across the round trip made a slow database hold up the heartbeat renewal's logging
and the main thread's fork, for as long as the statement took. A cold
shutdown's killed children are not reported (the process is going away; the heartbeat's
expiry hands their runs to the dispatcher, docs/design.md "Shutdown").
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
from worker.liveness import fork_guard

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
        """The execution this request's lost pool process held, or None when the failure
        is not a lost process (or one Celery itself caused: a terminate, a revoke, a cold
        shutdown), or the message named no run. Not during a stop either: a SIGTERM sent
        to the whole process group (systemd's default ``KillMode=control-group``,
        ``kill -TERM -<pgid>``) ends the pool's processes too, and their runs are not
        failed attempts; the heartbeat's expiry hands them to the dispatcher."""
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


# How often the worker's main process looks for pool processes that exited. billiard
# looks when a process's sentinel says it ended, but a process whose pipe closed before
# the kernel made it a zombie is not yet reapable then, and billiard's own next look is
# its 5 s maintenance timer: the loss was seen 0.1 to 5 s after the kill.
POOL_LOOK_S = 0.5


class PoolWatch(bootsteps.StartStopStep):
    """Looks at the pool for exited processes every ``POOL_LOOK_S`` (billiard's
    ``maintain_pool``: it reaps them, fails their jobs with ``WorkerLostError`` and
    starts replacements), on the event loop as billiard's own timer does. Prefork only."""

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
        """Write the lost attempt (tried again while PostgreSQL is unreachable, for up to
        half of ``STALE_AFTER_S``) and log ``task.process_lost`` with what it did."""
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
