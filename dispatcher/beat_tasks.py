"""The Celery tasks beat sends: ``teamdesk.scan`` (steps 1-4) and ``teamdesk.purge`` (step 5).

Both stay thin: they call :func:`dispatcher.scan.run_once` / :func:`purge_once` and
report through the process's :class:`FailureLog`. They go to their own queue,
``maintenance``: a backlog of exports or reminders must not hold back the scan that
recovers them, and Flower shows the queue's length on its own. Every worker consumes it
by default (``-Q exports,reminders,maintenance``); a deployment may instead give it one
small dedicated worker.

Two scans may overlap (a slow scan and the next one, on two workers): the scan is safe
for that by design. A scan message that waited too long is dropped by the worker
(``expires`` in the schedule), so a busy cluster never runs a pile of old scans one
after another. Results are ignored and the message is acknowledged on
receipt: a lost scan costs nothing, the next one comes an interval later.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from celery import Celery

from beat_schedule import MAINTENANCE_QUEUE, PURGE_TASK, SCAN_TASK
from dispatcher.errors import ScanUnavailable
from dispatcher.monitor import FailureLog
from dispatcher.scan import ScanCounts, purge_once, run_once
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.dispatcher")

__all__ = ["MAINTENANCE_QUEUE", "PURGE_TASK", "SCAN_TASK", "register"]

TASK_OPTIONS: dict[str, Any] = {
    "shared": False,  # registered on each app explicitly (tests build several)
    "ignore_result": True,
    "acks_late": False,
}

failures = FailureLog(log)

_registered: weakref.WeakSet[Celery] = weakref.WeakSet()


def scan_and_report(app: Celery, monitor: FailureLog = failures) -> ScanCounts | None:
    """One scan for beat: failures go to the throttled log, never into the queue."""
    try:
        counts = run_once(app, purge=False)
    except ScanUnavailable as exc:
        monitor.failed(exc.service, exc.error)
        return None
    if counts.redis_error:
        monitor.failed("Redis", counts.redis_error)
    else:
        monitor.succeeded()
    level = logging.INFO if counts.did_something else logging.DEBUG
    log_event(log, "dispatcher.scan", level, **counts.as_dict())
    return counts


def purge_and_report(monitor: FailureLog = failures) -> int | None:
    try:
        purged = purge_once()
    except ScanUnavailable as exc:
        monitor.failed(exc.service, exc.error)
        return None
    if purged:
        log_event(log, "dispatcher.scan", purged=purged)
    return purged


def register(app: Celery) -> None:
    """Register both tasks on ``app`` (idempotent); ``tasks.celery_app`` routes them."""
    if app in _registered:
        return
    _registered.add(app)

    def scan() -> None:
        scan_and_report(app)

    def purge() -> None:
        purge_and_report()

    app.task(name=SCAN_TASK, **TASK_OPTIONS)(scan)
    app.task(name=PURGE_TASK, **TASK_OPTIONS)(purge)
