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
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa
from celery import signals
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from ledger import dispatch, service
from tasks import delivery, queueing
from teamdesk.config import get_settings
from teamdesk.db import sqlalchemy_url
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.worker")

# The worker's event loop waits this long at most for a connection, and for a statement.
CONNECT_TIMEOUT_S = 2
STATEMENT_TIMEOUT_S = 5.0
_connected = False
_revoke_engine: Engine | None = None


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
        with _engine().begin() as conn:
            dispatch.limit_statement_time(conn, STATEMENT_TIMEOUT_S)
            cancelled = service.cancel_run(conn, message.task_id, message.run)
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


def _engine() -> Engine:
    """The main process's engine for cancels: no pool (see the module's docstring)."""
    global _revoke_engine
    if _revoke_engine is None:
        _revoke_engine = sa.create_engine(
            sqlalchemy_url(get_settings().database_url),
            poolclass=NullPool,
            connect_args={"connect_timeout": CONNECT_TIMEOUT_S, "application_name": "teamdesk"},
        )
    return _revoke_engine


def connect() -> None:
    """Connect the receiver once per process."""
    global _connected
    if not _connected:
        signals.task_revoked.connect(_on_revoked, weak=False)
        _connected = True
