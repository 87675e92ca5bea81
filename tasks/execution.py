"""The one execution wrapper both task kinds share: claim (or skip) -> run -> classify.

Outcomes (SPEC §5):
- success: the body committed under the lease; ``task.completed`` / ``task.skipped`` is
  decided by re-reading the ledger afterwards.
- :class:`LeaseLost`: a newer execution (or a cancel, or the dispatcher) owns the row. Log
  ``task.lease_lost`` and return quietly: no progress 100, no failure, no retry.
- :class:`TaskRejected`: write FAILED now and end the queue message failed, no retry.
- anything else: write WAITING and retry with backoff ``RETRY_BASE_DELAY_S * 2^(n-1)``
  until ``MAX_TASK_ATTEMPTS`` (the first included), then FAILED.
A failure report that matches 0 rows means a newer execution owns the task: return
quietly, never raise into the queue.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Task
from sqlalchemy.engine import Connection

from ledger import lease
from ledger.errors import LeaseLost, TaskRejected
from tasks import queueing
from teamdesk import hooks
from teamdesk.config import Settings, get_settings
from teamdesk.db import get_engine
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.task")

MSG_RETRYING = "The task hit a temporary error and will be retried."
MSG_EXHAUSTED = "The task failed after {n} attempts."
MSG_CLAIM_FAILED = "The task could not be started: the ledger was unreachable."


class TaskFailed(Exception):
    """The task failed after its last attempt (the queue message ends failed)."""


@dataclass(frozen=True)
class Context:
    """What a task body gets: its claim, settings, the execution's connection (autocommit:
    each ledger write is one statement and one round trip) and a progress reporter."""

    claim: lease.Claim
    settings: Settings
    conn: Connection
    report_progress: Callable[[int, int, int], None]

    @property
    def lease(self) -> lease.Lease:
        return self.claim.lease


Body = Callable[[Context], str]


def _fields(task_id: uuid.UUID, run: int, attempt: int, **extra: Any) -> dict[str, Any]:
    return {"task_id": str(task_id), "run": run, "attempt": attempt, **extra}


def execute(task: Task, task_id_text: str, run: int, body: Body) -> dict[str, Any]:
    """Run one delivery of ``task_id``/``run``; returns a small JSON result for the queue."""
    settings = get_settings()
    task_id = uuid.UUID(task_id_text)
    attempt = int(task.request.retries or 0) + 1
    with get_engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        try:
            hooks.fire("task.before_claim", task_id=task_id, run=run)
            claimed = lease.claim(conn, task_id, run, attempt, queueing.lease_holder())
        except Exception as exc:
            return _claim_failed(task, task_id, run, attempt, exc, settings)
        # After the claim: until it committed the row still said WAITING, and a scan that
        # saw no marker then would publish a duplicate that takes the lease over.
        queueing.message_started(task_id, run)
        if claimed is None:
            log_event(log, "task.skipped", **_fields(task_id, run, attempt, reason="not claimable"))
            return {"task_id": task_id_text, "run": run, "outcome": "skipped"}
        fields = _fields(task_id, run, attempt, execution=str(claimed.lease.execution_id)[:8])
        log_event(log, "task.started", kind=claimed.kind, **fields)
        hooks.fire("task.claimed", claim=claimed)
        context = Context(claimed, settings, conn, _progress_reporter(task, conn, claimed.lease))
        try:
            summary = body(context)
        except LeaseLost:
            log_event(log, "task.lease_lost", **fields)
            return {"task_id": task_id_text, "run": run, "outcome": "lease_lost"}
        except TaskRejected as exc:
            return _rejected(claimed.lease, exc, fields)
        except Exception as exc:
            return _failed_attempt(task, claimed.lease, exc, settings, fields)
        return _finished(conn, task_id, run, summary, fields)


def _claim_failed(
    task: Task, task_id: uuid.UUID, run: int, attempt: int, exc: Exception, settings: Settings
) -> dict[str, Any]:
    """The claim itself failed (the database went away): nothing was written, the row is
    as the dispatcher left it. The message is sent again after the backoff, with the
    queued marker kept; once the attempts are spent it ends failed and the marker goes
    with it, so the dispatcher's re-publish step sees the run as lost and sends it again
    (a marker outliving its message would keep the run WAITING forever)."""
    fields = _fields(task_id, run, attempt, stage="claim")
    exhausted = attempt >= settings.max_task_attempts
    log_event(
        log,
        "task.attempt_failed",
        logging.WARNING,
        error=type(exc).__name__,
        exhausted=exhausted,
        **fields,
    )
    if exhausted:
        queueing.message_started(task_id, run)
        raise TaskFailed(MSG_CLAIM_FAILED) from None
    delay = settings.retry_base_delay_s * 2 ** (attempt - 1)
    with queueing.retry_marker(task_id, run):
        raise task.retry(
            countdown=delay,
            max_retries=settings.max_task_attempts - 1,
            exc=TaskFailed(MSG_CLAIM_FAILED),
        )


def _finished(
    conn: Connection, task_id: uuid.UUID, run: int, summary: str, fields: dict[str, Any]
) -> dict[str, Any]:
    completed = lease.run_completed(conn, task_id, run)
    log_event(log, "task.completed" if completed else "task.skipped", **fields)
    return {
        "task_id": str(task_id),
        "run": run,
        "outcome": "completed" if completed else "skipped",
        "summary": summary,
    }


def _rejected(held: lease.Lease, exc: TaskRejected, fields: dict[str, Any]) -> dict[str, Any]:
    with get_engine().begin() as conn:
        written = lease.report_failure(conn, held, final=True, message=exc.message)
    if not written:
        log_event(log, "task.lease_lost", **fields)
        return {"task_id": str(held.task_id), "run": held.run, "outcome": "lease_lost"}
    log_event(
        log,
        "task.failed",
        logging.WARNING,
        exhausted=True,
        error=type(exc).__name__,
        reason=exc.message,
        **fields,
    )
    raise exc


def _failed_attempt(
    task: Task, held: lease.Lease, exc: Exception, settings: Settings, fields: dict[str, Any]
) -> dict[str, Any]:
    final = held.attempt >= settings.max_task_attempts
    delay = settings.retry_base_delay_s * 2 ** (held.attempt - 1)
    retry_at = datetime.now(UTC) + timedelta(seconds=delay)
    message = MSG_EXHAUSTED.format(n=held.attempt) if final else MSG_RETRYING
    report_error: dict[str, str] = {}
    try:
        hooks.fire("task.before_failure_report", lease=held, final=final)
        with get_engine().begin() as conn:
            written = lease.report_failure(
                conn, held, final=final, message=message, retry_at=retry_at
            )
    except Exception as report_exc:  # the ledger is unreachable: the queue still decides
        written, report_error = True, {"report_error": type(report_exc).__name__}
    if not written:
        log_event(log, "task.lease_lost", **fields)
        return {"task_id": str(held.task_id), "run": held.run, "outcome": "lease_lost"}
    if final:
        log_event(
            log,
            "task.failed",
            logging.ERROR,
            exhausted=True,
            error=type(exc).__name__,
            **report_error,
            **fields,
        )
        raise TaskFailed(message) from None
    log_event(
        log,
        "task.attempt_failed",
        logging.WARNING,
        error=type(exc).__name__,
        exhausted=False,
        retry_in_s=delay,
        **report_error,
        **fields,
    )
    with queueing.retry_marker(held.task_id, held.run):
        raise task.retry(
            countdown=delay,
            max_retries=settings.max_task_attempts - 1,
            exc=TaskFailed(MSG_RETRYING),
        )


def _progress_reporter(
    task: Task, conn: Connection, held: lease.Lease
) -> Callable[[int, int, int], None]:
    """Ledger first (the truth the API shows), then the queue (so Flower shows it too)."""

    def report(percent: int, done: int, total: int) -> None:
        lease.report_progress(conn, held, percent)
        if done < total:  # after the last batch the queue's next word is the task's end
            queueing.report_progress(task, percent, done, total)

    return report
