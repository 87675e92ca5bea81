"""Cancel a statement that has not reported for too long: an export's silences, which
``statement_timeout`` does not bound (docs/design.md, "Exports").

A cancel is sent only while its watch is armed, under the watch's lock, and the caller
disarms under that lock as soon as its statement returns: so no cancel is still on its way
when the next statement (the completion) goes out. One daemon thread per process (a forked
child gets a fresh registry and lock); deadlines are this host's monotonic clock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, Protocol

from teamdesk import hooks


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Watch:
    """One watched statement: its connection and when it must have reported by."""

    __slots__ = ("armed", "conn", "deadline", "fired", "limit_s", "lock")

    def __init__(self, conn: Cancellable, limit_s: float) -> None:
        self.conn, self.limit_s = conn, limit_s
        self.deadline = time.monotonic() + limit_s
        self.armed = True  # the statement runs: a cancel may be sent
        self.fired = False  # a cancel was sent (the deadline passed while it ran)
        self.lock = threading.Lock()  # held while a cancel is sent, and to disarm

    def touch(self) -> None:
        """The statement reported (its row was written): the silence starts again."""
        self.deadline = time.monotonic() + self.limit_s

    def disarm(self) -> bool:
        """The statement has returned: no cancel is sent from now on, and one being sent
        has been sent when this returns. Whether one was sent (``fired``)."""
        with self.lock:
            self.armed = False
            return self.fired


_cond = threading.Condition()
_watches: set[Watch] = set()
_thread_pid: int | None = None
# When the thread wakes next on its own: a new watch due later needs no wake-up.
_wake_at = 0.0


def _run() -> None:
    global _wake_at
    cond = _cond
    with cond:
        while True:
            now = time.monotonic()
            for expired in [w for w in _watches if w.deadline <= now]:
                _watches.discard(expired)
                # Without the registry's lock: a cancel may wait on the network.
                cond.release()
                try:
                    _cancel(expired)
                finally:
                    cond.acquire()
            wait = max(min((w.deadline for w in _watches), default=now + 3600) - now, 0.01)
            _wake_at = now + wait
            cond.wait(timeout=wait)


def _cancel(expired: Watch) -> None:
    """Cancel the watch's statement if it still runs (its watch armed)."""
    hooks.fire("watchdog.before_cancel", watch=expired)
    with expired.lock:
        if not expired.armed:
            return  # the statement returned meanwhile: its connection may run the next
        expired.fired = True
        with suppress(Exception):  # a lost connection fails its read anyway
            expired.conn.cancel()


def forget_in_child() -> None:
    """A forked child starts with no watches and no thread (worker/forking.py calls this)."""
    global _cond, _watches, _thread_pid, _wake_at
    _cond, _watches, _thread_pid, _wake_at = threading.Condition(), set(), None, 0.0


def _ensure_thread() -> None:
    global _thread_pid
    if _thread_pid != os.getpid():
        _thread_pid = os.getpid()
        threading.Thread(target=_run, name="teamdesk-watchdog", daemon=True).start()


@contextmanager
def watch(conn: Any, limit_s: float) -> Iterator[Watch]:
    """Cancel ``conn``'s statement (a DB-API connection with ``cancel()``, psycopg2's)
    when ``limit_s`` pass without :meth:`Watch.touch`; ``Watch.fired`` says it did. The
    caller disarms the watch as soon as the statement returns (leaving disarms it too)."""
    entry = Watch(conn, limit_s)
    with _cond:
        _ensure_thread()
        _watches.add(entry)
        if entry.deadline < _wake_at or not _wake_at:
            _cond.notify()
    try:
        yield entry
    finally:
        entry.disarm()
        with _cond:
            _watches.discard(entry)
