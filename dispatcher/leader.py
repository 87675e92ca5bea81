"""One active dispatcher: a Redis lock with a time to live, extended while its holder works
(docs/design.md, "Dispatch", one leader).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable

import redis
from redis.exceptions import LockError

from teamdesk.config import Settings
from teamdesk.logs import log_event
from teamdesk.version import version

log = logging.getLogger("teamdesk.dispatcher")

TTL_LOOPS = 5  # the lock outlives this many scan intervals without an extension...
MIN_TTL_S = 2  # ... and never less (the lock's TTL is set in whole seconds)
MAX_LOOP_S = 5.0  # the scan interval counted above, at most


def leader_key(prefix: str) -> str:
    return f"{prefix}:dispatcher:leader"


def leader_ttl_s(settings: Settings) -> int:
    """How long the lock outlives a leader that stopped extending it."""
    return max(MIN_TTL_S, math.ceil(TTL_LOOPS * min(settings.scan_interval_s, MAX_LOOP_S)))


class Leadership:
    """This process's claim on the leader lock."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        ttl_s: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lock = client.lock(key, timeout=ttl_s, thread_local=False)
        self.ttl_s = ttl_s
        self._clock = clock
        self._confirmed_until: float | None = None  # when our last confirmed hold runs out
        self._said_standby = False

    @property
    def leading(self) -> bool:
        return self._confirmed_until is not None and self._clock() < self._confirmed_until

    def ensure(self) -> bool:
        """Take or extend the lock; True while this process may dispatch. Never raises."""
        was_leading = self._confirmed_until is not None
        started = self._clock()
        try:
            held = self._extend() if was_leading else self._acquire()
        except redis.RedisError as exc:
            # Cannot tell: lead on until what we last confirmed runs out, then stand down.
            if not self.leading and was_leading:
                self._stand_down("lost", error=type(exc).__name__)
            return self.leading
        if held:
            self._confirmed_until = started + self.ttl_s
            if not was_leading:
                self._said_standby = False
                self._announce("leader")
        elif was_leading:
            self._stand_down("lost")
        elif not self._said_standby:
            self._said_standby = True
            self._announce("standby")
        return held

    def release(self) -> None:
        """Give the lock up (a clean stop): a standby takes over at its next try."""
        if self._confirmed_until is None:
            return
        self._confirmed_until = None
        with contextlib.suppress(LockError, redis.RedisError):  # expired or unreachable:
            self.lock.release()  # it lapses on its own

    def _acquire(self) -> bool:
        return bool(self.lock.acquire(blocking=False))

    def _extend(self) -> bool:
        """Reset the lock's time to live; if it is no longer ours (it expired, or Redis
        restarted empty), try to take it afresh."""
        try:
            self.lock.reacquire()
            return True
        except LockError:
            return self._acquire()

    def _announce(self, role: str) -> None:
        """Taking the lock or standing by: a beat's first line, whichever it does, so it
        also says the running version."""
        log_event(log, "dispatcher.leader", role=role, ttl_s=self.ttl_s, version=version())

    def _stand_down(self, role: str, **fields: object) -> None:
        self._confirmed_until = None
        log_event(log, "dispatcher.leader", logging.WARNING, role=role, **fields)
