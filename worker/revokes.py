"""A revoked queue message cancels its run (docs/design.md, "Operating with Celery's tools").

``celery control revoke <task_id>-<run>`` (what Flower's revoke button sends) tells every
live worker to discard that message id; with ``--terminate`` a worker also kills the pool
process running it. Celery does either in the worker's main process and then sends
``task_revoked``. Left there, the ledger would never hear of it: the run would stay
WAITING and published (or RUNNING), be published again when its message was judged
lost, and be discarded again for as long as the workers remember the revoke.

So a revoke means what an operator expects: the run named by the message is CANCELLED
in the ledger (the fenced cancel of ``ledger.service.cancel_run``: only while WAITING or
RUNNING, only that run), its window and team slots are free at once, and a terminated
execution's lease is cleared with it (its process is gone anyway). The write runs on a
short-lived thread of its own, so the worker's event loop never waits for PostgreSQL. If
it fails (PostgreSQL away), the message is still gone: its queued marker is ended, so
the dispatcher publishes the run again, a worker discards it again, and the cancel is
tried again - the loop converges once the database answers. A terminated run whose
cancel failed is taken back by the staleness rule and ends the same way.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals

from ledger import service
from tasks import delivery, queueing
from teamdesk import db
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.worker")

_connected = False


def _on_revoked(request: Any = None, terminated: bool = False, **_: Any) -> None:
    """Celery's ``task_revoked`` (the worker's main process): cancel the run, off-loop."""
    try:
        message = delivery.parse(tuple(request.args or ()), dict(request.kwargs or {}))
    except (delivery.MessageRefused, AttributeError, TypeError):
        return  # not one of the dispatcher's messages: no run to cancel
    threading.Thread(
        target=cancel_revoked,
        args=(message, bool(terminated)),
        name="teamdesk-revoke",
        daemon=True,
    ).start()


def cancel_revoked(message: delivery.Delivery, terminated: bool) -> None:
    """Cancel the run a revoked message named; never raises."""
    fields: dict[str, Any] = {
        "task_id": str(message.task_id),
        "run": message.run,
        "terminated": terminated,
    }
    try:
        with db.get_engine().begin() as conn:
            cancelled = service.cancel_run(conn, message.task_id, message.run)
    except Exception as exc:
        queueing.message_started(message.task_id, message.run, message.stamp)
        log_event(
            log,
            "task.revoked",
            logging.WARNING,
            cancelled=False,
            error=type(exc).__name__,
            **fields,
        )
        return
    queueing.message_started(message.task_id, message.run, message.stamp)
    log_event(log, "task.revoked", cancelled=cancelled, **fields)


def connect() -> None:
    """Connect the receiver once per process."""
    global _connected
    if not _connected:
        signals.task_revoked.connect(_on_revoked, weak=False)
        _connected = True
