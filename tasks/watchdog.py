"""A bound on silence: cancel a statement that has not reported for too long.

An export streams its CSV with one COPY and writes progress every batch; between two
writes its ledger row is silent, and a row silent for ``STALE_AFTER_S`` is taken back
(docs/design.md, "Lease"). ``statement_timeout`` bounds the whole read, not the silences
inside it, and no Python runs while psycopg2 waits for the next record. So a read under
:func:`watch` that goes ``limit_s`` without :meth:`Watch.touch` is cancelled (libpq's
cancel request, which PostgreSQL serves outside ``max_connections`` and PgBouncer
forwards): the COPY ends with ``QueryCanceled``, a failed attempt retried as usual,
before the silence could look like a stalled execution.

One daemon thread per process (started on first use; a forked child starts with a fresh
registry and lock, never one the parent's thread held at the fork) sleeps until the
earliest deadline. A cancel is sent only while its watch is *armed*, under the watch's
own lock, and the caller disarms it (:meth:`Watch.disarm`, also on leaving
:func:`watch`) under that lock as soon as its statement returns, before it sends the
next: a deadline that passes just as the statement ends sends nothing once the caller has
disarmed, and one being sent makes the disarm wait until it has been sent (libpq's cancel
returns once the server has it, and a server ignores a cancel that finds its session
idle). So no cancel of a watch is still on its way when the caller's next statement (an
export's completion) goes out.

Deadlines are this host's monotonic clock: a timeout of one process's own wait, like a
socket timeout, not a threshold other hosts compare against.
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
# When the thread wakes next on its own (monotonic): a new watch due later needs no wake-up
# (one thread switch per export saved), as it is looked at then.
_wake_at = 0.0


def _run() -> None:
    global _wake_at
    cond = _cond
    with cond:
        while True:
            now = time.monotonic()
            for expired in [w for w in _watches if w.deadline <= now]:
                _watches.discard(expired)
                # Sent without the registry's lock (a cancel may wait on the network):
                # other watches of the process go on meanwhile.
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


def _forget_in_child() -> None:
    global _cond, _watches, _thread_pid, _wake_at
    _cond, _watches, _thread_pid, _wake_at = threading.Condition(), set(), None, 0.0


os.register_at_fork(after_in_child=_forget_in_child)


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
