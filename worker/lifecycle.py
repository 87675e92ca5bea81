"""A worker's start and stop: the warm drain bounded by ``SHUTDOWN_TIMEOUT_S``, and the exit
code (docs/design.md, "Shutdown").

Celery leaves a warm shutdown unbounded, and ``worker_soft_shutdown_timeout`` only adds a
sleep before the cold path cancels work (so it stays 0): past the budget this sends
SIGQUIT (Celery's cold path), and ``HARD_EXIT_AFTER_S`` later ends the process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import celery.apps.worker as celery_worker_program
from celery import signals
from celery.worker import control as celery_control

from ledger.errors import TaskRejected
from tasks import export
from tasks.execution import TaskFailed
from tasks.names import EXPORTS_QUEUE, REMINDERS_QUEUE
from teamdesk import db, hooks, s3_store, tracing_setup
from teamdesk.config import get_settings
from teamdesk.logs import log_event
from teamdesk.version import version
from worker import lost, revokes
from worker import metrics as worker_metrics
from worker.liveness import renew_interval_s
from worker.steps import current_liveness

log = logging.getLogger("teamdesk.worker")

HARD_EXIT_AFTER_S = 10.0  # after the cold shutdown was requested, if the process still lives
LOST_REPORTS_WAIT_S = 5.0  # at the stop, for lost pool processes' reports under way


class Drain:
    """This process's stop: when it began, whether it ended cleanly (else exit 1: the
    budget passed, an operator's cold stop during the drain, or Celery's own failure).
    During it a thread renews the holder and the running messages' visibility: the
    worker's own timer stops with the consumer, and each renewal re-registers the holder
    (so it survives a Redis restart and redoes a removal Redis refused at SIGTERM)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.finished = threading.Event()
        self.escalated = threading.Event()
        self.cold_during_drain = False
        self.crashed = False  # Celery logged an unrecoverable error
        self._timers: list[threading.Timer] = []

    def begin(self, signal_name: str | None) -> None:

        self.started.set()
        settings = get_settings()
        log_event(log, "worker.stopping", signal=signal_name, budget_s=settings.shutdown_timeout_s)
        liveness = current_liveness()
        if liveness is not None:
            liveness.stop(draining=True)
            threading.Thread(
                target=self._keep_alive,
                args=(liveness,),
                name="teamdesk-drain-liveness",
                daemon=True,
            ).start()
        self._arm(settings.shutdown_timeout_s, self._escalate)

    def _keep_alive(self, liveness: Any) -> None:
        interval = renew_interval_s(liveness.settings)
        while not self.finished.wait(interval):
            liveness.drain_tick()  # logs its failures itself and keeps trying

    def _arm(self, delay: float, action: Any) -> None:
        timer = threading.Timer(delay, action)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _escalate(self) -> None:
        if self.finished.is_set():
            return
        self.escalated.set()
        log_event(
            log,
            "worker.shutdown_timeout",
            logging.ERROR,
            budget_s=get_settings().shutdown_timeout_s,
        )
        self._arm(HARD_EXIT_AFTER_S, self._hard_exit)
        os.kill(os.getpid(), signal.SIGQUIT)

    def _hard_exit(self) -> None:
        if not self.finished.is_set():
            log_event(log, "worker.stopped", logging.CRITICAL, exit_code=1, forced=True)
            logging.shutdown()
            os._exit(1)

    def end(self) -> None:

        self.finished.set()
        for timer in self._timers:
            timer.cancel()
        liveness = current_liveness()
        if liveness is not None and self.started.is_set():
            liveness.finish()

    @property
    def clean(self) -> bool:
        return not (self.escalated.is_set() or self.cold_during_drain or self.crashed)


class _CrashWatch(logging.Filter):
    """Notices the failures Celery only logs (an "Unrecoverable error", a bootstep that
    failed to stop), so the exit code says the stop did not end cleanly."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            _drain.crashed = True
        return True


def _say(message: str, *_: Any, **__: Any) -> None:
    """Celery prints shutdown notices as plain text; route them through the JSON log."""
    logging.getLogger("celery.apps.worker").info("%s", message.strip())


QUEUES = (EXPORTS_QUEUE, REMINDERS_QUEUE)
_drain = Drain()
_connected = False


def _on_init(
    sender: Any = None, instance: Any = None, options: dict[str, Any] | None = None, **_: Any
) -> None:
    _refuse_unknown_queues((options or {}).get("queues"))
    s3_store.store_or_exit(get_settings(), "celery worker")  # EXPORT_STORE answers
    tracing_setup.configure("worker")  # before the pool forks: its processes inherit it
    export.guard()  # built here, before the pool forks: no pool process pays for it
    # The startup banner is plain text on stdout; worker.started carries its facts as JSON.
    if instance is not None:
        instance.quiet = True


MSG_UNKNOWN_QUEUE = (
    "celery worker: the queue {names} does not exist in this version; workers consume "
    "{known} (-Q {default}); see CHANGELOG.md"
)


def _refuse_unknown_queues(selected: str | list[str] | tuple[str, ...] | None) -> None:
    """``-Q`` naming a queue this version does not have (``maintenance``, from an older
    command line): one line and exit 2, before Celery fails with a traceback whose hint
    (``task_create_missing_queues``) would be wrong here."""
    if not selected:
        return
    parts = [selected] if isinstance(selected, str) else list(selected)
    names = [name.strip() for part in parts for name in part.split(",") if name.strip()]
    unknown = [name for name in names if name not in QUEUES]
    if unknown:
        print(
            MSG_UNKNOWN_QUEUE.format(
                names=", ".join(repr(name) for name in unknown),
                known=" and/or ".join(QUEUES),
                default=",".join(QUEUES),
            ),
            file=sys.stderr,
        )
        raise SystemExit(2)


def _on_ready(sender: Any = None, **_: Any) -> None:
    controller = getattr(sender, "controller", None)
    pool = getattr(controller, "pool_cls", None)
    pool_name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    try:
        queues = sorted(sender.app.amqp.queues.consume_from)
    except AttributeError:
        queues = []

    liveness = current_liveness()
    log_event(
        log,
        "worker.started",
        hostname=getattr(sender, "hostname", None),
        member=liveness.member if liveness is not None else None,
        pool=str(pool_name).rsplit(".", 1)[-1],
        concurrency=getattr(controller, "concurrency", None),
        queues=queues,
        version=version(),
    )


def _on_shutting_down(sig: str | None = None, how: str | None = None, **_: Any) -> None:
    if how == "Warm" and not _drain.started.is_set():
        _drain.begin(sig)
    elif how == "Cold" and _drain.started.is_set() and not _drain.escalated.is_set():
        _drain.cold_during_drain = True
        log_event(log, "worker.stopping", logging.WARNING, signal=sig, cold=True)


_celery_remote_shutdown = celery_control.shutdown


def _remote_shutdown(state: Any, msg: str = "Got shutdown from remote", **kwargs: Any) -> None:
    """``celery control shutdown``, drained as a SIGTERM is. Celery sends no
    ``worker_shutting_down`` for it: without this the heartbeat stopped outright while the
    pool finished its tasks, and the dispatcher took those live runs back and ran them
    again."""
    _on_shutting_down(sig="control shutdown", how="Warm")
    _celery_remote_shutdown(state, msg, **kwargs)  # logs, raises WorkerShutdown


def _on_shutdown(sender: Any = None, **_: Any) -> None:
    lost.settle(LOST_REPORTS_WAIT_S)
    _drain.end()
    if sender is not None and _drain.started.is_set():
        # Celery gives a first SIGINT exit code 1 even when the drain ends cleanly; a
        # deploy or Ctrl-C that finished its work exits 0, anything else exits 1.
        sender.exitcode = 0 if _drain.clean else 1
    elif sender is not None and _drain.crashed:
        sender.exitcode = 1
    code = getattr(sender, "exitcode", 0) or 0
    db.reset_engine(dispose=True)
    log_event(log, "worker.stopped", logging.ERROR if code else logging.INFO, exit_code=code)


def _on_child_init(**_: Any) -> None:
    # A pool child must not reuse the parent's pooled connections (shared sockets).
    db.reset_engine(dispose=True)


def _on_child_exit(**_: Any) -> None:
    tracing_setup.flush()  # its last spans, before billiard's os._exit


def _on_task_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    """Logs only, and only the failures nothing else logged (a time limit, a pool process
    killed in a cold shutdown): the execution wrapper logs those it classified, and
    worker/lost.py reports a lost pool process."""

    hooks.fire("queue.failure_callback", task_id=task_id, exception=exception)
    if isinstance(exception, TaskRejected | TaskFailed):
        return
    task_part, _sep, run = (task_id or "").rpartition("-")
    log_event(
        log,
        "task.failed",
        logging.ERROR,
        task_id=task_part or task_id,
        run=int(run) if run.isdigit() else None,
        exhausted=True,
        source="queue",
        error=type(exception).__name__,
    )


def connect() -> None:
    """Connect the lifecycle receivers once per process (create_app may run many times)."""
    global _connected
    if _connected:
        return

    celery_worker_program.safe_say = _say
    logging.getLogger("celery.worker.worker").addFilter(_CrashWatch(logging.CRITICAL))
    logging.getLogger("celery.bootsteps").addFilter(_CrashWatch(logging.ERROR))
    signals.celeryd_init.connect(_on_init, weak=False)
    signals.worker_ready.connect(_on_ready, weak=False)
    signals.worker_shutting_down.connect(_on_shutting_down, weak=False)
    signals.worker_shutdown.connect(_on_shutdown, weak=False)
    signals.worker_process_init.connect(_on_child_init, weak=False)
    signals.worker_process_shutdown.connect(_on_child_exit, weak=False)
    signals.task_failure.connect(_on_task_failure, weak=False)
    worker_metrics.connect()
    revokes.connect()
    celery_control.control_command(
        name="shutdown", help="Shutdown worker(s): a warm stop, drained as on SIGTERM."
    )(_remote_shutdown)
    _connected = True
