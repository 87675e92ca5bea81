"""The dispatcher's wake-up: ``LISTEN teamdesk_dispatch`` on a connection of its own, or
polling (docs/design.md, "Dispatch", wake-ups).

Autocommit, since a LISTEN in an open transaction takes effect only at commit; a periodic
``SELECT 1`` (:meth:`Listener.check`) finds a connection that died without a FIN.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from typing import Any, Protocol

import psycopg2
import psycopg2.extensions

from ledger.wake import WAKE_CHANNEL
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.dispatcher")

CONNECT_TIMEOUT_S = 5
RECONNECT_AFTER_S = 1.0  # a failed connect is retried no sooner than this
POLL_S = 0.25  # without LISTEN: how often the dispatcher looks at the ledger
APPLICATION_NAME = "teamdesk-dispatcher-listen"


class Wakeup(Protocol):
    def wait(self, timeout_s: float) -> bool: ...

    def check(self) -> None: ...

    def close(self) -> None: ...


class Listener:
    """A LISTEN connection; reconnects on its own, reporting a wake after each reconnect."""

    def __init__(self, url: str, clock: Any = time.monotonic) -> None:
        self.url = url.replace("postgresql+psycopg2://", "postgresql://", 1)
        self._clock = clock
        self._conn: psycopg2.extensions.connection | None = None
        self._next_connect = 0.0
        self._state: str | None = None  # what was last logged: "listening" or "polling"

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.closed == 0

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True when woken (a notification, or a (re)connect:
        what was notified before its LISTEN took effect was missed), False when the time
        ran out."""
        if not self.connected:
            if self._connect():
                return True  # the caller looks at the ledger once, from now on LISTENing
            time.sleep(max(0.0, min(timeout_s, POLL_S)))
            return True  # polling while LISTEN is down
        conn = self._conn
        assert conn is not None
        try:
            if not conn.notifies:  # a query may have pulled them in without a readable socket
                readable, _, _ = select.select([conn], [], [], max(0.0, timeout_s))
                if not readable:
                    return False
                conn.poll()
        except (psycopg2.Error, OSError, ValueError) as exc:
            self._lost(exc)
            return True
        woken = bool(conn.notifies)
        conn.notifies.clear()  # the content is irrelevant: one look covers them all
        return woken

    def check(self) -> None:
        """Prove the connection still answers (a dead network path wakes no select)."""
        if not self.connected:
            return
        assert self._conn is not None
        try:
            with self._conn.cursor() as cur:
                cur.execute("SELECT 1")
        except (psycopg2.Error, OSError) as exc:
            self._lost(exc)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg2.Error):
                self._conn.close()
            self._conn = None

    def _connect(self) -> bool:
        if self._clock() < self._next_connect:
            return False
        self._next_connect = self._clock() + RECONNECT_AFTER_S
        try:
            conn = psycopg2.connect(
                self.url,
                connect_timeout=CONNECT_TIMEOUT_S,
                application_name=APPLICATION_NAME,
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=3,
            )
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"LISTEN {WAKE_CHANNEL}")
        except (psycopg2.Error, OSError) as exc:
            self._say("polling", logging.WARNING, error=type(exc).__name__)
            return False
        self._conn = conn
        self._say("listening", logging.INFO)
        return True

    def _lost(self, exc: BaseException) -> None:
        self.close()
        self._say("polling", logging.WARNING, error=type(exc).__name__)

    def _say(self, state: str, level: int, **fields: object) -> None:
        """Log each change between listening and polling once."""
        if state != self._state:
            self._state = state
            log_event(log, "dispatcher.listen", level, state=state, **fields)


class Poller:
    """No LISTEN (``DISPATCH_LISTEN_URL=off``): look at the ledger every ``POLL_S``."""

    def wait(self, timeout_s: float) -> bool:
        time.sleep(max(0.0, min(timeout_s, POLL_S)))
        return True

    def check(self) -> None:
        return None

    def close(self) -> None:
        return None


def wakeup_for(listen_url: str | None) -> Wakeup:
    return Poller() if listen_url is None else Listener(listen_url)
