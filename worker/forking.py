"""Everything that must hold across a fork of the worker's main process (billiard forks
pool processes, and replacements at any time, from the main thread): the one module that
says what a child starts with (docs/design.md, "Heartbeats").

- :data:`fork_guard`: held around the metric and log calls of the main process's own
  threads, and across the fork, so no child inherits a lock held at that moment
  (prometheus_client's multiprocess values share one: the child hung on its first task's
  metrics). The child gets a new one.
- The export watchdog's thread and watches are the parent's: a child starts with none
  (tasks/watchdog.py).
- The SQLAlchemy engines are the parent's (shared sockets): a child's first use builds
  its own (``worker_process_init``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from celery import signals

from tasks import watchdog
from teamdesk import db


class ForkGuard:
    """A lock held across every fork of this process (see the module's docstring).
    Re-entrant: the SIGTERM handler logs under it on the main thread, and may interrupt
    that thread while it holds the guard (the intake's first decision, or the fork's
    ``before`` hook)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        os.register_at_fork(
            before=self._acquire, after_in_parent=self._release, after_in_child=self._reset
        )

    def _acquire(self) -> None:
        self._lock.acquire()

    def _release(self) -> None:
        self._lock.release()

    def _reset(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


fork_guard = ForkGuard()
os.register_at_fork(after_in_child=watchdog.forget_in_child)


def _on_child_init(**_: Any) -> None:
    db.reset_engine(dispose=True)  # a pool child must not reuse the parent's connections


def connect() -> None:
    """Connect the pool child's start (once per process: worker/lifecycle.py)."""
    signals.worker_process_init.connect(_on_child_init, weak=False)
