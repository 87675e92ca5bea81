"""The soak's own database work and a ``pgrestart`` never overlap.

The soak's users create, cancel and retry tasks on the soak's own connections. A restart
of PostgreSQL in the middle of one of those would be the soak's failure, not the
cluster's: a create whose commit was acknowledged by nobody may or may not exist, and a
retried cancel reads as "too late". So every soak transaction holds the gate *shared*, and
a restart holds it *exclusive*: it waits for the soak's transactions in flight (each well
under a second) and keeps new ones waiting until PostgreSQL answers again. The cluster's
own processes never see the gate.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXCLUSIVE_WAIT_S = 30.0  # a restart waits this long for the soak's transactions to end


class DbGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Yields False when the soak's transactions did not end in time (the caller skips)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            drained = self._cond.wait_for(lambda: self._shared == 0, timeout=EXCLUSIVE_WAIT_S)
        try:
            yield drained
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
