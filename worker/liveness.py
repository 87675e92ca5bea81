"""A worker process's liveness: its heartbeat member and the database check that gates
intake (docs/design.md, "Heartbeats"; why a thread of the main
process and not beat or Celery's timer: docs/decisions.md, "Workers").

The check never runs on the renewal's thread, because nothing bounds it as a whole:
libpq's ``connect_timeout`` leaves out DNS and counts per host, and behind PgBouncer
``SELECT 1`` waits in the pooler's queue (``query_wait_timeout``, 120 s) while its server
pool is full. A renewal that waited for it let the member expire (issue 34).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from teamdesk import metrics
from teamdesk.config import Settings
from teamdesk.db import select_one
from teamdesk.heartbeat import Heartbeat, WorkerSlots
from teamdesk.logs import log_event
from teamdesk.redis_client import redis_client
from worker.forking import fork_guard

log = logging.getLogger("teamdesk.worker")

PING_TIMEOUT_S = 2
RENEW_TIMEOUT_S = 1.0  # fail fast: a slow renewal delays the next one and a stop
# What a database check takes at most when libpq keeps its own bounds (one host: the
# connection, then the statement); a hung one takes longer, and nothing waits for it.
CHECK_S = 2 * PING_TIMEOUT_S

T = TypeVar("T")


def renew_interval_s(settings: Settings) -> float:
    """How often the heartbeat is renewed, and the database checked."""
    return max(0.1, min(settings.heartbeat_ttl_s, settings.stale_after_s) / 4)


def database_bound_s(settings: Settings) -> float:
    """How old the last successful database check may be while the worker takes messages:
    the wait between two checks, plus the next check's own time (at most another interval
    and ``PING_TIMEOUT_S``). Past it the check under way has hung."""
    return 2 * renew_interval_s(settings) + PING_TIMEOUT_S


def check_overdue_s(settings: Settings) -> float:
    """How long a check may be under way before it counts as failed: a check starts one
    interval after the last ended, so by then the last success is past
    :func:`database_bound_s`."""
    return renew_interval_s(settings) + PING_TIMEOUT_S


class Liveness:
    """What the renewal thread renews for one worker process, and what its database check
    (on a thread of its own) last found."""

    def __init__(
        self,
        settings: Settings,
        consumes: WorkerSlots | None = None,
        offer: Callable[[], WorkerSlots] | None = None,
    ) -> None:
        self.settings = settings
        self.offer = offer  # what the process consumes now, read at every renewal
        self.client = redis_client(settings, settings.redis_url, RENEW_TIMEOUT_S)
        self.heartbeat = Heartbeat(
            self.client,
            settings.queue_prefix,
            settings.worker_instance_id,
            settings.heartbeat_ttl_s,
            consumes,
        )
        self.registered = False  # the last heartbeat renewal succeeded
        self.clock: Callable[[], float] = time.monotonic  # for the database check's bound
        self.database_bound_s = database_bound_s(settings)
        self.check_overdue_s = check_overdue_s(settings)
        self.checked = threading.Event()  # set whenever a database check ended
        self._database_ok_at: float | None = None  # when the last check succeeded
        self._checking_since: float | None = None  # when the check under way began
        self._overdue_since: float | None = None  # the hung check already counted failed
        self._failing: set[str] = set()  # stages failing now (each logged once per outage)
        self._removed = False
        self._draining = False
        # stop()'s flags and removal in one step; re-entrant, as a signal handler may run a
        # stop inside a stop on the main thread. Renewals never take it (the tombstone
        # settles one under way): a slow renewal once held up the SIGTERM handler.
        self._lock = threading.RLock()

    @property
    def member(self) -> str:
        return self.heartbeat.member

    @property
    def stopping(self) -> bool:
        return self.heartbeat.stopping

    @property
    def database_ok(self) -> bool:
        """The last database check succeeded at most ``database_bound_s`` ago."""
        at = self._database_ok_at
        return at is not None and self.clock() - at <= self.database_bound_s

    @property
    def may_take_work(self) -> bool:
        """The last renewal succeeded, and a database check recently enough."""
        return self.registered and self.database_ok

    def tick(self) -> None:
        """One renewal (Redis alone: nothing here waits on the database); errors are
        logged and never raised."""
        if self.heartbeat.stopping:
            return
        self.registered = self._attempt("renew", self._renew) is True
        if not self.heartbeat.stopping:
            self._note_overdue_check()

    def offer_now(self) -> None:
        """Renew at once with what the worker consumes now (after intake resumed): else
        for one interval the dispatcher sizes the window at nothing and warns of no
        consumers."""
        if not self.heartbeat.stopping:
            self.registered = self._attempt("renew", self._renew) is True

    def _renew(self) -> bool:
        if self.offer is not None:
            self.heartbeat.consumes = self.offer()
        return self.heartbeat.renew()

    def check_database(self) -> None:
        """One database check, on the check's own thread: a new connection and a bounded
        ``SELECT 1``. One that ends after shutdown began changes and logs nothing."""
        if self.heartbeat.stopping:
            return
        self._checking_since = self.clock()
        error: str | None = None
        try:
            ok = self._check_database()
        except Exception as exc:
            ok, error = False, type(exc).__name__
        with fork_guard:  # one step with the renewal thread's overdue note
            self._checking_since = None
            if self.heartbeat.stopping:
                return
            self._database_ok_at = self.clock() if ok else None
            if ok:
                self._failing.discard("database")
            elif error is not None:
                self._failed("database", error)
        self.checked.set()

    def _check_database(self) -> bool:
        return select_one(
            self.settings.database_url,
            timeout_s=PING_TIMEOUT_S,
            application_name="teamdesk-worker-liveness",
        )

    def _note_overdue_check(self) -> None:
        """On the renewal thread: count a check under way past ``check_overdue_s`` as
        failed, once (intake pauses by ``database_ok``'s bound alone)."""
        since = self._checking_since
        if since is None or since == self._overdue_since:
            return
        if self.clock() - since <= self.check_overdue_s:
            return
        with fork_guard:  # one step with the check's end
            if self._checking_since != since:
                return  # it ended meanwhile, and said how
            self._overdue_since = since
            self._failed("database", "CheckOverdue")

    def _attempt(self, stage: str, action: Callable[[], T]) -> T | None:
        """``action``'s result, or None when it raised (logged once per outage of
        ``stage``)."""
        try:
            result = action()
        except Exception as exc:
            self._failed(stage, type(exc).__name__)
            return None
        self._failing.discard(stage)
        return result

    def _failed(self, stage: str, error: str) -> None:
        """Count a failure of ``stage``; log it once per outage."""
        with fork_guard:
            metrics.heartbeat_failed(stage)
            if stage not in self._failing:
                log_event(log, "heartbeat.failed", logging.WARNING, error=error, stage=stage)
            self._failing.add(stage)

    def stop(self, draining: bool = False) -> None:
        """Remove this process's member from the active sets, once (``draining``: it stays
        a lease holder). Once a drain began, a plain stop (the bootstep's) leaves it
        alone: should the removal at SIGTERM have failed, the drain's next renewal does
        it."""
        with self._lock:
            self._draining = self._draining or draining
            if self._removed or (self._draining and not draining):
                return
            removed = self._attempt("remove", lambda: self.heartbeat.remove(draining=draining))
            self._removed = removed is not None

    def drain_tick(self) -> None:
        """While draining: renew the holder (never raises)."""
        self._attempt("drain", self.heartbeat.renew_draining)

    def finish(self) -> None:
        """The drain is over: nothing of this process is alive any more."""
        self._attempt("finish", self.heartbeat.finish)
