"""Failures and delays the soak injects inside worker processes.

Loaded by ``TEAMDESK_TEST_HOOKS=soak.hooks`` (the worker imports it at start; production
never does). Which tasks are affected is decided by the soak's own table ``soak_marks``
(in the soak's database, written in the same transaction as the task it marks, so a
worker that sees the task sees its mark):

- ``fail``: every attempt of run 0 raises :class:`InjectedFailure` (a retryable error),
  so run 0 ends FAILED on its last attempt; the soak then retries it by hand and run 1
  must complete. An export fails after its first read; a reminder after its
  notification, version bump and event were written, so they must roll back.
- ``slow``: the execution pauses ``SLOW_S`` once (an export after its first read, a
  reminder after its lease check) so the soak can cancel it while it is RUNNING.
- ``freeze`` (the ``txfreeze`` fault): the first execution to reach
  ``reminder.after_lease_read`` - inside the reminder's transaction, the team's advisory
  lock held - lights the beacon ``freeze-<task>`` (soak/beacons.py) and waits there
  ``FREEZE_WAIT_S`` for the soak to SIGSTOP it.
- ``long`` (the ``longterm`` fault): the export takes ``SOAK_LONG_EXPORT_S`` (52 s; 26 s short),
  spread evenly over its batches so that its progress writes stay closer together than
  half of ``STALE_AFTER_S`` (the longest silence an execution may keep: tasks/watchdog.py);
  each execution lights ``long-<task>-<execution>`` at its first batch.

Every task also pauses a little where a fault hurts most, so that faults find work in
flight: an export ``SOAK_EXPORT_PAUSE_S`` after each batch read (its read transaction
open, the progress not yet written), a reminder ``SOAK_REMINDER_PAUSE_S`` after its
side effects and its completion were written, before they commit (one open transaction).
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from typing import Any

from sqlalchemy import text

from soak import beacons
from teamdesk import hooks
from teamdesk.config import get_settings
from teamdesk.db import get_engine

SLOW_S = 2.0
FREEZE_WAIT_S = 2.0  # the soak stops the process within this (it polls every 50 ms)
EXPORT_PAUSE_ENV = "SOAK_EXPORT_PAUSE_S"
REMINDER_PAUSE_ENV = "SOAK_REMINDER_PAUSE_S"
LONG_EXPORT_ENV = "SOAK_LONG_EXPORT_S"
EXPORT_PAUSE_S = float(os.environ.get(EXPORT_PAUSE_ENV, "0"))
REMINDER_PAUSE_S = float(os.environ.get(REMINDER_PAUSE_ENV, "0"))
LONG_EXPORT_S = float(os.environ.get(LONG_EXPORT_ENV, "0"))
BEACON_DIR = os.environ.get(beacons.BEACON_DIR_ENV, "")

MARK = text("SELECT mode FROM soak_marks WHERE task_id = :task_id")

_modes: dict[uuid.UUID, str | None] = {}
_lock = threading.Lock()


class InjectedFailure(Exception):
    """A failure the soak injects on purpose."""


def mode_of(task_id: uuid.UUID) -> str | None:
    """The task's mark (cached per process: a mark never changes once written)."""
    with _lock:
        if task_id in _modes:
            return _modes[task_id]
    with get_engine().connect() as conn:
        mode = conn.execute(MARK, {"task_id": task_id}).scalar_one_or_none()
    with _lock:
        _modes[task_id] = mode
    return mode


def _fail_run_0(claim: Any) -> None:
    if claim.lease.run == 0 and mode_of(claim.lease.task_id) == "fail":
        raise InjectedFailure("soak: injected failure")


def _slow_once(claim: Any) -> None:
    if mode_of(claim.lease.task_id) == "slow":
        time.sleep(SLOW_S)


def long_pause_s(total: int, batch_size: int) -> float:
    """A long export's pause after each batch: ``LONG_EXPORT_S`` over its batches."""
    return LONG_EXPORT_S / max(1, math.ceil(total / batch_size))


def _execution(claim: Any) -> str:
    return str(claim.lease.execution_id)[:8]


def on_export_read(claim: Any, done: int = 0, total: int = 0, **_: Any) -> None:
    batch_size = get_settings().export_batch_size
    first = done <= batch_size
    if first:
        _slow_once(claim)
        _fail_run_0(claim)
    if mode_of(claim.lease.task_id) != "long":
        time.sleep(EXPORT_PAUSE_S)
        return
    if first:
        task = claim.lease.task_id
        beacons.light(BEACON_DIR, f"long-{task}-{_execution(claim)}", task_id=str(task))
    time.sleep(long_pause_s(total, batch_size))


def on_reminder_lease_read(claim: Any, **_: Any) -> None:
    _slow_once(claim)
    task = claim.lease.task_id
    if mode_of(task) == "freeze" and beacons.light(
        BEACON_DIR, f"freeze-{task}", task_id=str(task), execution=_execution(claim)
    ):
        time.sleep(FREEZE_WAIT_S)  # inside the transaction, the team's lock held


def on_reminder_event_insert(claim: Any, **_: Any) -> None:
    time.sleep(REMINDER_PAUSE_S)
    _fail_run_0(claim)


def install() -> None:
    hooks.install("export.after_read", on_export_read)
    hooks.install("reminder.after_lease_read", on_reminder_lease_read)
    hooks.install("reminder.after_event_insert", on_reminder_event_insert)


# Installed only in a process started with TEAMDESK_TEST_HOOKS=soak.hooks (a soak worker);
# the soak itself imports this module for its constants and installs nothing.
if os.environ.get(hooks.TEST_HOOKS_ENV) == __name__:
    install()
