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

Every task also pauses a little where a fault hurts most, so that faults find work in
flight: an export ``SOAK_EXPORT_PAUSE_S`` after each batch read (its read transaction
open, the progress not yet written), a reminder ``SOAK_REMINDER_PAUSE_S`` after its
side effects were written and before its completion (one open transaction).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

from sqlalchemy import text

from teamdesk import hooks
from teamdesk.config import get_settings
from teamdesk.db import get_engine

SLOW_S = 2.0
EXPORT_PAUSE_ENV = "SOAK_EXPORT_PAUSE_S"
REMINDER_PAUSE_ENV = "SOAK_REMINDER_PAUSE_S"
EXPORT_PAUSE_S = float(os.environ.get(EXPORT_PAUSE_ENV, "0"))
REMINDER_PAUSE_S = float(os.environ.get(REMINDER_PAUSE_ENV, "0"))

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


def on_export_read(claim: Any, done: int = 0, **_: Any) -> None:
    if done <= get_settings().export_batch_size:  # the first batch
        _slow_once(claim)
        _fail_run_0(claim)
    time.sleep(EXPORT_PAUSE_S)


def on_reminder_lease_read(claim: Any, **_: Any) -> None:
    _slow_once(claim)


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
