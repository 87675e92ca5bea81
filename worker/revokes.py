"""A revoked queue message cancels its run, from the worker's main process
(docs/design.md, "Operating with Celery's tools"); Celery alone would only discard it.

The cancel runs on the main process's own thread (the consumer's event loop), not on a
thread of its own: a terminate makes billiard fork a replacement pool process at that
moment, and a fork while another thread holds a lock (the Redis client's pool, the
engine's) leaves the child hung on it for ever (found by tests/process/test_celery_revoke.py,
about 1 run in 50). So it uses a connection of its own (no pool: nothing crosses a fork),
and every wait is bounded on this side (docs/decisions.md, "Issue 34: smaller items").
"""

from __future__ import annotations

import logging
import select
import time
import uuid
from typing import Any

import psycopg2
from celery import bootsteps, signals
from celery.worker import state as worker_state
from psycopg2 import extensions
from sqlalchemy.dialects.postgresql import psycopg2 as pg_dialect

from ledger import dispatch, service
from tasks import delivery
from teamdesk.config import get_settings
from teamdesk.db import libpq_url
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.worker")

# The event loop waits at most this long for a connection (each host), then for the
# transaction: the server's bound on a statement, and a margin for the network.
CONNECT_TIMEOUT_S = 2
STATEMENT_TIMEOUT_S = 5.0
ANSWER_MARGIN_S = 1.0
APPLICATION_NAME = "teamdesk"
# How often the worker's main process looks for running requests revoked since.
REVOKE_LOOK_S = 0.5
_connected = False


def _driver_sql(statement: Any) -> str:
    """A ledger statement (SQLAlchemy text) in psycopg2's ``%(name)s`` form."""
    return str(statement.compile(dialect=pg_dialect.dialect()))


# The fenced cancel of ledger.service.cancel_run, its statements as the ledger writes them.
_BEGIN = "BEGIN; " + _driver_sql(dispatch.LIMIT_STATEMENT_TIME)
_CANCEL_RUN = _driver_sql(service.CANCEL_RUN)
_WAKE_AND_COMMIT = _driver_sql(service.WAKE) + "; COMMIT"


class NoAnswer(Exception):
    """PostgreSQL did not answer within the event loop's bound."""


def _message(request: Any) -> delivery.Delivery | None:
    """The run a request's message names; None for a message not the dispatcher's."""
    try:
        return delivery.parse(tuple(request.args or ()), dict(request.kwargs or {}))
    except (delivery.MessageRefused, AttributeError, TypeError):
        return None


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    """Celery's ``task_revoked`` (the worker's main process, its own thread)."""
    message = _message(request)
    if message is None:
        return
    if terminated:
        _store_terminated(sender, request)
    cancel_revoked(message, bool(terminated))


def _store_terminated(task: Any, request: Any) -> None:
    """REVOKED in the result backend for a terminated message, as for every other cancel
    (Celery stores it only for tasks that keep results; ours are ``ignore_result``).
    Best effort, one Redis write bounded by its socket timeout: the ledger is the truth."""
    try:
        task.backend.mark_as_revoked(request.id, "terminated", request=request)
    except Exception as exc:
        log.warning("revoke not stored in the result backend: %s", type(exc).__name__)


class RevokeWatch(bootsteps.StartStopStep):
    """Cancels the run of every active request whose id was revoked (for a plain ``revoke``
    of a running message Celery only remembers the id), once per request, every
    ``REVOKE_LOOK_S`` on the worker's timer. A terminated request is no longer active:
    ``task_revoked`` cancelled its run."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.entry: Any = None
        self.cancelled: set[str] = set()

    def start(self, parent: Any) -> None:
        self.entry = parent.timer.call_repeatedly(REVOKE_LOOK_S, self.look, priority=0)

    def stop(self, parent: Any) -> None:
        if self.entry is not None:
            self.entry.cancel()
            self.entry = None

    def look(self) -> None:
        active = list(worker_state.active_requests)
        self.cancelled.intersection_update(request.id for request in active)
        for request in active:
            if request.id in self.cancelled or request.id not in worker_state.revoked:
                continue
            self.cancelled.add(request.id)
            message = _message(request)
            if message is not None:
                cancel_revoked(message, terminated=False, running=True)


def cancel_revoked(message: delivery.Delivery, terminated: bool, running: bool = False) -> None:
    """Cancel the run a revoked message named; never raises. ``running``: the message was
    being executed (a plain revoke of an active request), not discarded or terminated."""
    fields: dict[str, Any] = {
        "task_id": str(message.task_id),
        "run": message.run,
        "terminated": terminated,
        "running": running or terminated,
    }
    try:
        cancelled = cancel_run(message.task_id, message.run)
    except Exception as exc:
        log_event(
            log,
            "task.revoked",
            logging.WARNING,
            cancelled=False,
            error=type(exc).__name__,
            **fields,
        )
        return
    log_event(log, "task.revoked", cancelled=cancelled, **fields)


def cancel_run(task_id: uuid.UUID, run: int) -> bool:
    """``ledger.service.cancel_run`` in one transaction on a connection of its own, every
    wait bounded on this side. Raises NoAnswer, or the driver's error."""
    conn = _connect(get_settings().database_url)
    try:
        deadline = time.monotonic() + STATEMENT_TIMEOUT_S + ANSWER_MARGIN_S
        cursor = conn.cursor()
        _send(cursor, _BEGIN, {"ms": str(round(STATEMENT_TIMEOUT_S * 1000))}, deadline)
        _send(cursor, _CANCEL_RUN, {"task_id": str(task_id), "run": run}, deadline)
        cancelled = cursor.rowcount == 1
        # A cancelled run in flight frees a window slot: wake the dispatcher.
        _send(cursor, _WAKE_AND_COMMIT if cancelled else "COMMIT", None, deadline)
        return cancelled
    finally:
        conn.close()


def _connect(database_url: str) -> Any:
    """An asynchronous connection to the first host of ``database_url`` that answers
    within CONNECT_TIMEOUT_S, tried in order as libpq does (libpq applies
    ``connect_timeout`` only to blocking connects)."""
    params = extensions.parse_dsn(libpq_url(database_url))
    params["application_name"] = APPLICATION_NAME
    hosts, ports = params.get("host", "").split(","), params.get("port", "").split(",")
    error: Exception = NoAnswer()
    for i, host in enumerate(hosts):
        one = dict(params, host=host, port=ports[i] if len(ports) == len(hosts) else ports[0])
        try:
            return _connect_one({k: v for k, v in one.items() if v})
        except (NoAnswer, psycopg2.OperationalError) as exc:
            error = exc
    raise error


def _connect_one(params: dict[str, str]) -> Any:
    conn = psycopg2.connect(**params, async_=True)
    try:
        _wait(conn, time.monotonic() + CONNECT_TIMEOUT_S)
    except BaseException:
        conn.close()
        raise
    return conn


def _send(cursor: Any, sql: str, params: dict[str, Any] | None, deadline: float) -> None:
    cursor.execute(sql, params)
    _wait(cursor.connection, deadline)


def _wait(conn: Any, deadline: float) -> None:
    """Drive an asynchronous connection's connect or query until it is done, waiting for
    its socket at most until ``deadline`` (monotonic)."""
    while True:
        state = conn.poll()
        if state == extensions.POLL_OK:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoAnswer()
        events = select.POLLIN if state == extensions.POLL_READ else select.POLLOUT
        poller = select.poll()  # not select(): a worker's descriptors may pass 1024
        poller.register(conn.fileno(), events)
        poller.poll(left * 1000)


def connect() -> None:
    """Connect the receiver once per process."""
    global _connected
    if not _connected:
        signals.task_revoked.connect(_on_revoked, weak=False)
        _connected = True
