"""A revoked queue message cancels its run (docs/design.md, "Operating with Celery's tools").

``celery control revoke <task_id>-<run>`` (what Flower's revoke button sends) tells every
live worker to discard that message id; ``celery control terminate SIGTERM <id>`` (Flower's
Terminate) also makes a worker kill the pool process running it. Celery does either in the
worker's main process and then sends ``task_revoked``. Left there, the ledger would never
hear of it: the run would stay WAITING and published (or RUNNING), be published again when
its message was judged lost, and be discarded again for as long as the workers remember the
revoke.

So a revoke means what an operator expects: the run named by the message is CANCELLED
in the ledger (the fenced cancel of ``ledger.service.cancel_run``: only while WAITING or
RUNNING, only that run), its window and team slots are free at once, and a terminated
execution's lease is cleared with it (its process is gone anyway). If it fails
(PostgreSQL away), the message is still gone: its queued marker is ended, so the
dispatcher publishes the run again, a worker discards it again, and the cancel is tried
again - the loop converges once the database answers. A terminated run whose cancel
failed is taken back by the staleness rule and ends the same way.

The write runs right there, on the main process's own thread: one short transaction on a
connection of its own (no pool: nothing idle is kept, and nothing crosses a fork) and one
Redis call, bounded by their connect and socket timeouts. Not on a thread: a terminate
makes billiard fork a replacement pool process at that very moment, and a fork while
another thread holds a lock (the Redis client's pool, the engine's) leaves the child
with that lock held forever - its first task hung on it (found by
tests/process/test_celery_revoke.py, about 1 run in 50).

That thread is the consumer's event loop (no acknowledgement, no delivery while it
waits), so the wait is bounded on this side too, not only by the server's
``statement_timeout``: a server that stops answering after the connect (frozen, or the
network dropped) would otherwise hold the loop until TCP gives up, which takes minutes.
The connection is psycopg2's asynchronous one, and each step waits for its socket with a
deadline (``poll``): each host of ``DATABASE_URL`` gets ``CONNECT_TIMEOUT_S`` to connect,
in order (libpq applies ``connect_timeout`` only to blocking connects), then the
transaction gets ``STATEMENT_TIMEOUT_S`` and ``ANSWER_MARGIN_S`` more. Past it the
connection is closed and the cancel has failed, as when PostgreSQL is away.
"""

from __future__ import annotations

import logging
import select
import time
import uuid
from typing import Any

import psycopg2
from celery import signals
from psycopg2 import extensions
from sqlalchemy.dialects.postgresql import psycopg2 as pg_dialect

from ledger import dispatch, service
from tasks import delivery, queueing
from teamdesk.config import get_settings
from teamdesk.db import libpq_url
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.worker")

# The worker's event loop waits this long at most for a connection (each host), and for
# the transaction: the server's bound on a statement, and a margin for the network.
CONNECT_TIMEOUT_S = 2
STATEMENT_TIMEOUT_S = 5.0
ANSWER_MARGIN_S = 1.0
APPLICATION_NAME = "teamdesk"
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


def _on_revoked(request: Any = None, terminated: bool = False, **_: Any) -> None:
    """Celery's ``task_revoked`` (the worker's main process, its own thread)."""
    try:
        message = delivery.parse(tuple(request.args or ()), dict(request.kwargs or {}))
    except (delivery.MessageRefused, AttributeError, TypeError):
        return  # not one of the dispatcher's messages: no run to cancel
    cancel_revoked(message, bool(terminated))


def cancel_revoked(message: delivery.Delivery, terminated: bool) -> None:
    """Cancel the run a revoked message named; never raises."""
    fields: dict[str, Any] = {
        "task_id": str(message.task_id),
        "run": message.run,
        "terminated": terminated,
    }
    # The message is gone either way: its marker must not hold the run back.
    queueing.message_started(message.task_id, message.run, message.stamp)
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
    wait bounded on this side (see the module's docstring). Raises NoAnswer, or the
    driver's error."""
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
    within CONNECT_TIMEOUT_S (libpq's list of hosts, tried in order, as libpq does)."""
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
