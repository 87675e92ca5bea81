"""The execution wrapper both task kinds share: claim (or skip), run the body, classify the
outcome, and end the queue message to match (docs/design.md, "Lease" and "Lifecycle").

A body that returns has completed (a completion that matches no row raises LeaseLost), so
``task.completed`` needs no re-read. A lost lease or a failure report that matches no row
returns quietly, never raising into the queue. No retry travels through the broker
(docs/decisions.md, "Dispatch"); a lost pool process is worker/lost.py's to report.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, NoReturn

import redis
from celery import Task
from celery.exceptions import Ignore, Retry
from opentelemetry.trace import SpanKind
from sqlalchemy.engine import Connection, Engine

from ledger import lease, prepared
from ledger.errors import LeaseLost, TaskRejected
from tasks import delivery, queueing
from teamdesk import hooks, tracing
from teamdesk.config import Settings, get_settings
from teamdesk.db import DATABASE_ERRORS, get_engine, get_execution_engine
from teamdesk.failures import database_failure
from teamdesk.logs import log_event
from worker.life import lease_holder

log = logging.getLogger("teamdesk.task")

MSG_RETRYING = "The task hit a temporary error and will be retried."
MSG_EXHAUSTED = "The task failed after {n} attempts."
MSG_CLAIM_FAILED = "The task could not be started: the ledger was unreachable."
MSG_CLAIM_REFUSED = "The task could not be started ({cause}); it will be tried again."
MSG_CLAIM_REFUSED_FINAL = "The task could not be started after {n} attempts: {cause}."


class TaskFailed(Exception):
    """The task failed after its last attempt (the queue message ends failed)."""


@dataclass(frozen=True)
class Context:
    """What a task body gets: its claim, settings, the execution's connection and the
    engine it came from (both autocommit: each ledger write is one statement and one round
    trip) and a progress reporter."""

    claim: lease.Claim
    settings: Settings
    conn: Connection
    engine: Engine
    report_progress: Callable[[Connection, int, int, int], None]

    @property
    def lease(self) -> lease.Lease:
        return self.claim.lease


Body = Callable[[Context], str]


def backoff_s(settings: Settings, attempt: int) -> float:
    """The wait before attempt ``attempt + 1``: 2 s, 4 s, ... with the default base."""
    return float(settings.retry_base_delay_s * 2 ** (attempt - 1))


def _fields(task_id: uuid.UUID, run: int, attempt: int | None, **extra: Any) -> dict[str, Any]:
    return {"task_id": str(task_id), "run": run, "attempt": attempt, **extra}


def _outcome(task_id: uuid.UUID, run: int, outcome: str, **extra: Any) -> dict[str, Any]:
    """The small JSON result the queue keeps for a message."""
    return {"task_id": str(task_id), "run": run, "outcome": outcome, **extra}


def execute(
    task: Task, args: tuple[Any, ...], kwargs: dict[str, Any], body: Body
) -> dict[str, Any]:
    """Run one delivery of the message ``args``/``kwargs`` (tasks/delivery.py); returns a
    small JSON result for the queue. A malformed message is refused, nothing written."""
    try:
        message = delivery.parse(args, kwargs)
    except delivery.MessageRefused as exc:
        log_event(log, "task.refused", logging.WARNING, message_id=task.request.id, reason=str(exc))
        return {"outcome": "refused", "reason": str(exc)}
    # The run's trace continues from its publish (the message's header; teamdesk/tracing.py).
    with tracing.span(
        f"execute {task.name}",
        parent=getattr(task.request, tracing.HEADER, None),
        kind=SpanKind.CONSUMER,
        errors=False,
        task_id=message.task_id,
        run=message.run,
    ) as current:
        try:
            result = _deliver(task, message, body)
        except BaseException as exc:
            tracing.annotate(current, outcome=_ended_by(exc))
            if not isinstance(exc, Retry | Ignore):
                tracing.failed(current, exc)
            raise
        tracing.annotate(current, outcome=result.get("outcome"))
        return result


def _ended_by(exc: BaseException) -> str:
    """The outcome a delivery that raised ends with, for its span."""
    if isinstance(exc, Retry):
        return "retrying"
    if isinstance(exc, Ignore):
        return "cancelled"
    if isinstance(exc, TaskRejected):
        return "rejected"
    return "failed" if isinstance(exc, TaskFailed) else "error"


def _deliver(task: Task, message: delivery.Delivery, body: Body) -> dict[str, Any]:
    settings = get_settings()
    task_id, run = message.task_id, message.run
    engine = get_execution_engine()
    with ExitStack() as stack:
        try:
            # Opening the connection is part of the claim: a database refusing new
            # connections (restarting, at max_connections) ends this message as a failed
            # claim too.
            conn = stack.enter_context(_execution_connection(engine))
            hooks.fire("task.before_claim", task_id=task_id, run=run)
            claimed = lease.claim(
                conn,
                task_id,
                run,
                lease_holder(),
                message.published,
                stale_after_s=settings.stale_after_s,
                execution_id=delivery.issued_execution_id(task.request),
            )
        except Exception as exc:
            _claim_failed(task, message, exc)
        if claimed is None:
            return _skipped(task, conn, message)
        held = claimed.lease
        fields = _fields(task_id, run, held.attempt, execution=str(held.execution_id)[:8])
        log_event(log, "task.started", kind=claimed.kind, **fields)
        tracing.event("claimed")
        tracing.annotate_current(
            execution_id=held.execution_id,
            team_id=claimed.team_id,
            task_kind=claimed.kind,
            attempt=held.attempt,
        )
        hooks.fire("task.claimed", claim=claimed)
        context = Context(claimed, settings, conn, engine, _progress_reporter(task, held, settings))
        try:
            summary = body(context)
        except LeaseLost:
            return _lease_lost(task, conn, held, fields)
        except TaskRejected as exc:
            return _rejected(task, conn, held, exc, fields)
        except Exception as exc:
            return _failed_attempt(task, conn, held, exc, settings, fields)
        log_event(log, "task.completed", **fields)
        return _outcome(task_id, run, "completed", summary=summary)


@contextmanager
def _execution_connection(engine: Engine) -> Iterator[Connection]:
    """The execution's own connection. Closing one the database dropped fails while it
    resets the session, which must not replace the execution's outcome: it is invalidated
    instead (the pool drops it). After a statement on the raw driver connection (an
    export's COPY) SQLAlchemy does not know the server went away, and the pool's reset
    would log a traceback: such a connection is invalidated before it is closed."""
    conn = engine.connect()
    try:
        yield conn
    finally:
        if _server_gone(conn):
            with suppress(Exception):
                conn.invalidate()
        try:
            conn.close()
        except DATABASE_ERRORS:
            with suppress(Exception):
                conn.invalidate()
            with suppress(Exception):
                conn.close()


def _server_gone(conn: Connection) -> bool:
    """Whether the driver connection under ``conn`` is closed (psycopg2 marks it when the
    server went away) while SQLAlchemy still holds it as valid."""
    if conn.invalidated or conn.closed:
        return False
    dbapi = conn.connection.dbapi_connection
    return dbapi is not None and bool(getattr(dbapi, "closed", False))


def _skipped(task: Task, conn: Connection, message: delivery.Delivery) -> dict[str, Any]:
    """The claim took nothing: say why (one read). A message whose run was cancelled
    while queued ends REVOKED, as the cancel of a running one does."""
    try:
        skip = lease.skip_reason(conn, message.task_id, message.run, message.published)
    except Exception as exc:
        skip = lease.Skip(f"not claimable (the reason could not be read: {type(exc).__name__})")
    fields = _fields(message.task_id, message.run, None, reason=skip.reason)
    log_event(log, "task.skipped", **fields)
    if skip.cancelled:
        _end_revoked(task)
    return _outcome(message.task_id, message.run, "skipped", reason=skip.reason)


def _claim_failed(task: Task, message: delivery.Delivery, exc: Exception) -> NoReturn:
    """The claim itself failed; the row is still WAITING and published. A cause that
    passes (``ledger.prepared.is_transient``) ends the message RETRY and the scan
    publishes the run again; any other would fail every delivery the same way, so it
    fails the attempt (:func:`_claim_refused`). Raises Retry, TaskFailed."""
    task_id, run = message.task_id, message.run
    if not prepared.is_transient(exc):
        _claim_refused(task, message, exc)
    log_event(
        log,
        "task.attempt_failed",
        logging.WARNING,
        error=type(exc).__name__,
        reason=_cause(exc),
        exhausted=False,
        **_fields(task_id, run, None, stage="claim"),
    )
    raise Retry(MSG_CLAIM_FAILED, exc=TaskFailed(MSG_CLAIM_FAILED)) from None


def _cause(exc: Exception) -> str:
    """Why a database call failed, in the server's words; else the exception's class."""
    return database_failure(exc) if isinstance(exc, DATABASE_ERRORS) else type(exc).__name__


def _claim_refused(task: Task, message: delivery.Delivery, exc: Exception) -> None:
    """A claim that failed for a lasting cause: its attempt failed (raises Retry or
    TaskFailed). Returns only when the ledger could not be told, or the run is no longer
    this message's: the caller then treats it as transient."""
    settings = get_settings()
    cause = _cause(exc)
    try:
        with get_engine().begin() as conn:
            written = lease.refuse_claim(
                conn,
                message.task_id,
                message.run,
                message.published,
                max_attempts=settings.max_task_attempts,
                base_delay_s=settings.retry_base_delay_s,
                message=MSG_CLAIM_REFUSED.format(cause=cause),
                final_message=MSG_CLAIM_REFUSED_FINAL.format(
                    n=settings.max_task_attempts, cause=cause
                ),
            )
    except Exception:
        return
    if written is None:
        return
    final = written.status == "FAILED"
    fields = _fields(message.task_id, message.run, written.attempt, stage="claim")
    log_event(
        log,
        "task.failed" if final else "task.attempt_failed",
        logging.ERROR if final else logging.WARNING,
        error=type(exc).__name__,
        reason=cause,
        exhausted=final,
        **({} if final else {"retry_in_s": round(written.retry_in_s, 3)}),
        **fields,
    )
    if final:
        failure = TaskFailed(MSG_CLAIM_REFUSED_FINAL.format(n=written.attempt, cause=cause))
        _store_failure(task, failure)
        raise failure from None
    raise Retry(MSG_RETRYING, exc=TaskFailed(MSG_RETRYING), when=written.retry_in_s) from None


def _lease_lost(
    task: Task, conn: Connection, held: lease.Lease, fields: dict[str, Any]
) -> dict[str, Any]:
    """The lease is gone: ``task.cancelled`` and REVOKED (:func:`_end_revoked`) when a
    cancel of this run took it, else ``task.lease_lost``. One read says which; if it
    fails, lease_lost."""
    try:
        cancelled = lease.was_cancelled(conn, held)
    except Exception:  # the connection may be the reason the lease went
        cancelled = False
    if not cancelled:
        log_event(log, "task.lease_lost", **fields)
        return _outcome(held.task_id, held.run, "lease_lost")
    log_event(log, "task.cancelled", **fields)
    _end_revoked(task)
    return _outcome(held.task_id, held.run, "cancelled")  # called directly (no queue)


def _end_revoked(task: Task) -> None:
    """End the queue message as the cancel it is: REVOKED in the result backend and in
    Flower (a ``task-revoked`` event; Celery's ``Ignore`` acknowledges the message and
    sends no ``task-succeeded``). Called directly (no message), it returns."""
    if task.request.called_directly:
        return
    with suppress(Exception):  # best effort: the ledger already says CANCELLED
        task.send_event("task-revoked", terminated=False, signum=None, expired=False)
        task.backend.mark_as_revoked(task.request.id, "cancelled", request=task.request)
    raise Ignore()


def _store_failure(task: Task, exc: Exception) -> None:
    """Store FAILURE in the result backend (the tasks are ``ignore_result``, so Celery
    stores nothing). Best effort: the ledger already says FAILED."""
    if task.request.called_directly:
        return
    try:
        task.backend.mark_as_failure(task.request.id, exc, request=task.request)
    except (redis.RedisError, OSError) as store_exc:
        log.warning("failure not stored in the result backend: %s", type(store_exc).__name__)


def _rejected(
    task: Task, conn: Connection, held: lease.Lease, exc: TaskRejected, fields: dict[str, Any]
) -> dict[str, Any]:
    """FAILED with the rejection's reason, then raises it (a lost lease returns as one).
    If the ledger cannot be told, the row stays RUNNING until the staleness rule takes it
    back, and the message still ends as the rejection."""
    report_error: dict[str, str] = {}
    try:
        written = _report_failure(held, True, exc.message, 0.0)
    except Exception as report_exc:
        written, report_error = True, {"report_error": type(report_exc).__name__}
    if not written:
        return _lease_lost(task, conn, held, fields)
    log_event(
        log,
        "task.failed",
        logging.WARNING,
        exhausted=True,
        error=type(exc).__name__,
        reason=exc.message,
        **report_error,
        **fields,
    )
    _store_failure(task, exc)
    raise exc


def _failed_attempt(
    task: Task,
    conn: Connection,
    held: lease.Lease,
    exc: Exception,
    settings: Settings,
    fields: dict[str, Any],
) -> dict[str, Any]:
    """Report the failed attempt (FAILED on the last one, else WAITING for the backoff),
    then raise TaskFailed or Retry (a lost lease returns as one). If the ledger cannot be
    told, the row stays RUNNING until the staleness rule takes it back."""
    final = held.attempt >= settings.max_task_attempts
    delay = backoff_s(settings, held.attempt)
    message = MSG_EXHAUSTED.format(n=held.attempt) if final else MSG_RETRYING
    report_error: dict[str, str] = {}
    try:
        hooks.fire("task.before_failure_report", lease=held, final=final)
        written = _report_failure(held, final, message, delay)
    except Exception as report_exc:
        written, report_error = True, {"report_error": type(report_exc).__name__}
    if not written:
        return _lease_lost(task, conn, held, fields)
    error = type(exc).__name__
    if final:
        log_event(
            log, "task.failed", logging.ERROR, exhausted=True, error=error, **report_error, **fields
        )
        failure = TaskFailed(message)
        _store_failure(task, failure)
        raise failure from None
    log_event(
        log,
        "task.attempt_failed",
        logging.WARNING,
        error=error,
        exhausted=False,
        retry_in_s=delay,
        **report_error,
        **fields,
    )
    raise Retry(MSG_RETRYING, exc=TaskFailed(MSG_RETRYING), when=delay) from None


REPORT_RETRY_FIRST_S = 0.25  # then doubling, up to REPORT_RETRY_MAX_S between tries
REPORT_RETRY_MAX_S = 4.0


def _report_failure(held: lease.Lease, final: bool, message: str, delay: float) -> bool:
    """``lease.report_failure`` in a transaction of its own, tried again while the database
    is unreachable for up to half of ``STALE_AFTER_S`` (past it, the staleness rule
    decides), then raises."""
    deadline = time.monotonic() + get_settings().stale_after_s / 2
    pause = REPORT_RETRY_FIRST_S
    while True:
        try:
            with get_engine().begin() as conn:
                return lease.report_failure(
                    conn, held, final=final, message=message, retry_in_s=delay
                )
        except DATABASE_ERRORS:
            if time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)  # the database is away: wait for it, as the attempt cannot go on
        pause = min(pause * 2, REPORT_RETRY_MAX_S)


def _progress_reporter(
    task: Task, held: lease.Lease, settings: Settings
) -> Callable[[Connection, int, int, int], None]:
    """Ledger first, then a Flower event. The body says on which connection (an export's
    is busy streaming its COPY)."""

    def report(conn: Connection, percent: int, done: int, total: int) -> None:
        lease.report_progress(conn, held, percent, settings.durable_progress_after_s)
        if done < total:  # after the last batch the queue's next word is the task's end
            queueing.report_progress(task, percent, done, total)

    return report
