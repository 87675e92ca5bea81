"""A worker's start and stop as Celery signals them, handed to its life (worker/life.py),
and the exit code (docs/design.md, "Shutdown")."""

from __future__ import annotations

import logging
import sys
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
from worker import forking, lost, revokes
from worker import metrics as worker_metrics
from worker.life import LIFE

log = logging.getLogger("teamdesk.worker")

LOST_REPORTS_WAIT_S = 5.0  # at the stop, for lost pool processes' reports under way


class _CrashWatch(logging.Filter):
    """Notices the failures Celery only logs (an "Unrecoverable error", a bootstep that
    failed to stop), so the exit code says the stop did not end cleanly."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            LIFE.crashed = True
        return True


def _say(message: str, *_: Any, **__: Any) -> None:
    """Celery prints shutdown notices as plain text; route them through the JSON log."""
    logging.getLogger("celery.apps.worker").info("%s", message.strip())


QUEUES = (EXPORTS_QUEUE, REMINDERS_QUEUE)
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

    liveness = LIFE.liveness
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
    if how == "Warm" and not LIFE.drain_started.is_set():
        LIFE.drain(sig)
    elif how == "Cold" and LIFE.drain_started.is_set() and not LIFE.escalated.is_set():
        LIFE.cold_during_drain = True
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
    LIFE.end()
    if sender is not None and LIFE.drain_started.is_set():
        # Celery gives a first SIGINT exit code 1 even when the drain ends cleanly; a
        # deploy or Ctrl-C that finished its work exits 0, anything else exits 1.
        sender.exitcode = 0 if LIFE.clean else 1
    elif sender is not None and LIFE.crashed:
        sender.exitcode = 1
    code = getattr(sender, "exitcode", 0) or 0
    db.reset_engine(dispose=True)
    log_event(log, "worker.stopped", logging.ERROR if code else logging.INFO, exit_code=code)


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
    forking.connect()
    signals.worker_process_shutdown.connect(_on_child_exit, weak=False)
    signals.task_failure.connect(_on_task_failure, weak=False)
    worker_metrics.connect()
    revokes.connect()
    celery_control.control_command(
        name="shutdown", help="Shutdown worker(s): a warm stop, drained as on SIGTERM."
    )(_remote_shutdown)
    _connected = True
