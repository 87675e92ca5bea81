"""Worker process lifecycle: start/stop logs and fork safety (SPEC §10-11)."""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from teamdesk import db
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.worker")

_connected = False


def _on_ready(sender: Any = None, **_: Any) -> None:
    hostname = getattr(sender, "hostname", None)
    log_event(log, "worker.started", hostname=hostname)


def _on_child_init(**_: Any) -> None:
    # A pool child must not reuse the parent's pooled connections (shared sockets).
    db.reset_engine(dispose=True)


def _on_task_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    """The queue's failure callback only logs (SPEC §5): it has no execution id, so a late
    callback writing the ledger could erase a newer lease. Failures the execution wrapper
    classified were logged there already; this reports the rest (a lost worker process,
    a time limit) so they are not silent."""
    from ledger.errors import TaskRejected
    from tasks.execution import TaskFailed

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
    signals.worker_ready.connect(_on_ready, weak=False)
    signals.worker_process_init.connect(_on_child_init, weak=False)
    signals.task_failure.connect(_on_task_failure, weak=False)
    _connected = True
