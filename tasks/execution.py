"""The one execution wrapper both task kinds share: claim (or skip) -> run -> classify.

Outcomes (docs/design.md, "Lifecycle"):
- success: the body committed its completion under the lease. A completion statement
  that matches no row raises :class:`LeaseLost`, so a body that returns has completed:
  ``task.completed`` needs no re-read of the ledger.
- :class:`LeaseLost`: a newer execution (or the dispatcher) owns the row. Log
  ``task.lease_lost`` and return quietly: no progress 100, no failure, no retry. When a
  cancel of this run took the lease, log ``task.cancelled`` and end the message REVOKED.
- :class:`TaskRejected`: write FAILED now and end the queue message failed, no retry.
- anything else: with attempts left, write WAITING, ready again after the backoff
  ``RETRY_BASE_DELAY_S * 2^(n-1)`` by the database's clock, and end the message as RETRY
  (the dispatcher publishes the next attempt when it is due); on the last attempt
  (``MAX_TASK_ATTEMPTS``, the first included) write FAILED.
A failure report that matches 0 rows means a newer execution owns the task: return
quietly, never raise into the queue. A claim that fails ends the message as RETRY when
its cause passes by itself, else as a failed attempt (``_claim_failed``); a pool process
that dies is its worker's main process's to report (worker/lost.py).

No retry travels through the broker: Celery's countdowns are host clocks (the sender's
and whichever worker receives the message), and a message parked in a worker's memory
until its ETA would sit outside the dispatcher's window.
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
from worker.steps import lease_holder

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
    """What a task body gets: its claim, settings, the execution's connection (autocommit:
    each ledger write is one statement and one round trip), the engine it came from (its
    connections are autocommit too: for a second one) and a progress reporter."""

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
    """Run one delivery of the message ``args``/``kwargs`` (``[task_id, run, stamp]``,
    tasks/delivery.py); returns a small JSON result for the queue. A malformed message is
    refused with one warning line and nothing written."""
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
    task_id, run, stamp = message.task_id, message.run, message.stamp
    engine = get_execution_engine()
    with ExitStack() as stack:
        try:
            # Opening the connection is part of the claim: a database refusing new
            # connections (restarting, at max_connections) must end this message as a
            # failed claim too, or its marker would keep the run from being published again.
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
        # After the claim: until it committed the row still said WAITING, and a scan that
        # saw no marker then would publish the run again.
        queueing.message_started(task_id, run, stamp)
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
        # The completion matched its row (else LeaseLost above): no re-read needed.
        log_event(log, "task.completed", **fields)
        return _outcome(task_id, run, "completed", summary=summary)


@contextmanager
def _execution_connection(engine: Engine) -> Iterator[Connection]:
    """The execution's own connection (``engine``'s are autocommit). Closing one the
    database dropped (a restart, a terminated backend, a failover) fails while it resets
    the session; that must not replace the execution's outcome (its retry, rejection or
    completion), so such a connection is invalidated instead: the pool drops it. A
    statement sent on the raw driver connection (an export's COPY) leaves SQLAlchemy
    unaware that the server went away, and the pool's reset would log a traceback: such a
    connection is invalidated before it is closed."""
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
    """The claim took nothing: say why (one read; a lost connection says so instead). A
    message whose run was cancelled while it waited in the queue ends REVOKED, as the
    cancel of a running one does, not as a success that skipped."""
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
    """The claim itself failed: nothing was claimed, the row is WAITING and published, as
    the dispatcher left it. The message ends and its queued marker goes with it.

    A cause that passes by itself (the database went away, a timeout, a conflict; see
    ``ledger.prepared.is_transient``) costs no attempt: the message ends as RETRY and the
    dispatcher publishes the run again once the database answers (a marker outliving its
    message would keep the run waiting until the marker expires). Any other cause - a
    missing prepared statement, a permission, a schema mismatch, a bug - would fail every
    delivery the same way, forever: it fails the attempt, with the cause in
    ``last_error`` (``lease.refuse_claim``), so the run ends FAILED after its attempts."""
    task_id, run = message.task_id, message.run
    queueing.message_started(task_id, run, message.stamp)
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
    """A claim that failed for a lasting cause: its attempt failed (returns only when the
    ledger could not be told, or the run is no longer this message's: then as a
    transient failure)."""
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
    """The lease is gone. A cancel of this run ends the message as what it is: logged
    ``task.cancelled``, REVOKED in the result backend and in Flower (a ``task-revoked``
    event, and no ``task-succeeded``: Celery's ``Ignore`` acknowledges the message and
    reports nothing more). Anything else (a newer execution, the dispatcher) is
    ``task.lease_lost``. One read says which; if it fails, lease_lost."""
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
    Flower (a ``task-revoked`` event, and no ``task-succeeded``: Celery's ``Ignore``
    acknowledges the message and reports nothing more). Called directly (no message),
    it returns."""
    if task.request.called_directly:
        return
    with suppress(Exception):  # best effort: the ledger already says CANCELLED
        task.send_event("task-revoked", terminated=False, signum=None, expired=False)
        task.backend.mark_as_revoked(task.request.id, "cancelled", request=task.request)
    raise Ignore()


def _store_failure(task: Task, exc: Exception) -> None:
    """The one outcome the result backend keeps: a message that ended FAILURE (the tasks
    are ``ignore_result``: successes come to Flower as task-succeeded events, retries as
    task-retried, and the ledger is the truth for everything else). Best effort: the
    ledger already says FAILED."""
    if task.request.called_directly:
        return
    try:
        task.backend.mark_as_failure(task.request.id, exc, request=task.request)
    except (redis.RedisError, OSError) as store_exc:
        log.warning("failure not stored in the result backend: %s", type(store_exc).__name__)


def _rejected(
    task: Task, conn: Connection, held: lease.Lease, exc: TaskRejected, fields: dict[str, Any]
) -> dict[str, Any]:
    """A rejection is final: FAILED with its reason. If the ledger cannot be told (tried
    again while PostgreSQL is unreachable, as a failed attempt's report is), the row stays
    RUNNING under this execution's lease until the staleness rule takes it back, and the
    message still ends as the rejection it is."""
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
    """Record the failed attempt in the ledger: FAILED on the last one, else WAITING until
    the backoff has passed. If the ledger cannot be told, the row stays RUNNING under this
    execution's lease until the dispatcher's staleness rule takes it back."""
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
    """``lease.report_failure`` in a transaction of its own, tried again while the database is
    unreachable, for up to half of ``STALE_AFTER_S``. An attempt that failed because
    PostgreSQL went away (a restart) usually cannot report at once either; without this its
    run waited for the staleness rule (``STALE_AFTER_S``) instead of retrying as soon as
    PostgreSQL answers again. The budget stays under ``STALE_AFTER_S``: past it, that rule
    decides."""
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
    """Ledger first (the truth the API shows), then the queue (so Flower shows it too). The
    body says on which connection (an export's is busy streaming its COPY)."""

    def report(conn: Connection, percent: int, done: int, total: int) -> None:
        lease.report_progress(conn, held, percent, settings.durable_progress_after_s)
        if done < total:  # after the last batch the queue's next word is the task's end
            queueing.report_progress(task, percent, done, total)

    return report
