"""A worker process's liveness in Redis: its heartbeat member and its messages' visibility,
and the database check that decides whether it takes new messages.

Mechanism: a worker bootstep (worker/steps.py) whose thread renews in the worker's
MainProcess. A beat-scheduled task on a kombu Broadcast queue was tried for heartbeats and
ran zero times on the Redis transport (Celery does not declare the fanout exchange when
sending, so the message went to lists nobody reads); a beat task would also stop when beat
stops, which says nothing about the workers. A renewal in each worker's own main process
renews exactly that process's member, needs neither beat nor the broker, and is stopped
by the worker's own shutdown. It runs on a thread of its own, not on Celery's event loop:
that loop stands still while the consumer re-establishes a lost broker connection (kombu
pauses 2, 4, 6 ... s between attempts), and the pool's processes go on executing all the
while, so their leases must stay alive (found by the soak: a live export taken back after
a Redis failover).

Two things happen on every renewal tick (about a quarter of ``HEARTBEAT_TTL_S``), each on
its own, so a failure of one never stops the other (the broker may be another Redis, or
RabbitMQ, than the heartbeats); the tick waits on Redis alone, with short timeouts:

- the heartbeat member (``teamdesk.heartbeat``) is renewed: it says "this process is
  alive", and so are the leases it holds. Never once shutdown began.
  :attr:`Liveness.registered` says whether the last renewal succeeded;
- the visibility of this process's in-flight messages (Redis broker only). kombu keeps a
  delivered, unacknowledged message in ``unacked_index`` scored by its delivery time and
  hands it to another consumer once that is older than ``visibility_timeout`` (an hour,
  tasks/celery_app.py). Moving the score of every message this process holds to "now"
  on each tick keeps a task that runs longer than that from being handed out twice.

The database is checked on a thread of its own (:meth:`Liveness.check_database`, as
often): a new connection and a bounded ``SELECT 1``. Never on the renewal's thread:
nothing on the client side bounds that check as a whole. libpq's ``connect_timeout``
leaves out DNS (``getaddrinfo``) and counts per host of a multi-host URL, and behind
PgBouncer in transaction pooling the connection succeeds at once while ``SELECT 1`` waits
in the pooler's queue (``query_wait_timeout``, 120 s by default) whenever the server pool
is full. A renewal that waited for it let the member expire, and the dispatcher took back
every live run of the worker (issue 34). The renewal needs Redis alone and never a new
database connection: PostgreSQL at ``max_connections``, a full pool, a DNS hiccup must
not make the dispatcher take back runs whose tasks go on working on their own
connections.

The check's only effect is on intake: a worker takes messages only while its last renewal
succeeded and a check succeeded within :func:`database_bound_s` (two renewal intervals and
``PING_TIMEOUT_S``; :attr:`Liveness.may_take_work`, worker/steps.py): every claim names
this member, and every claim needs a connection. So a check that fails, and one that hangs
(in DNS, in a pooler's queue), both pause intake, the hung one once the bound has passed;
neither delays a renewal. The renewal tick notices a check under way past its bound and
counts it as failed (``heartbeat.failed``, stage ``database``, error ``CheckOverdue``).

Each kind of failure is logged once per outage (``heartbeat.failed`` with its ``stage``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from celery.worker import state

from teamdesk import metrics
from teamdesk.config import Settings, is_redis_url
from teamdesk.db import select_one
from teamdesk.heartbeat import Heartbeat, WorkerSlots
from teamdesk.logs import log_event
from teamdesk.redis_client import redis_client

log = logging.getLogger("teamdesk.worker")

UNACKED_INDEX = "unacked_index"  # kombu's default transport option unacked_index_key
PING_TIMEOUT_S = 2
RENEW_TIMEOUT_S = 1.0  # fail fast: a slow renewal delays the next one and a stop
# What a database check takes at most when libpq keeps its own bounds (one host: the
# connection, then the statement); a hung one takes longer, and nothing waits for it.
CHECK_S = 2 * PING_TIMEOUT_S

T = TypeVar("T")


class ForkGuard:
    """Held around the metric and log calls of this process's own threads (the renewal
    thread, the database check's, the drain's), and by a fork: billiard forks pool
    processes from the main thread at any time (a replaced child), and a child must not
    inherit a lock one of those threads held at that moment - prometheus_client's
    multiprocess values share one lock, and a child that inherited it held would hang on
    its first task's metrics.

    Re-entrant: the worker's SIGTERM handler runs on the main thread (Celery's
    ``worker_shutting_down``, worker/lifecycle.py) and logs under this guard, and it may
    interrupt that same thread while it holds the guard (``Intake.follow(at_once=True)``,
    the fork's ``before`` hook); a plain lock would wait for itself there for ever. The
    child gets a new, free one."""

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


def renew_interval_s(settings: Settings) -> float:
    """How often the heartbeat is renewed, and the database checked."""
    return max(0.1, min(settings.heartbeat_ttl_s, settings.stale_after_s) / 4)


def database_bound_s(settings: Settings) -> float:
    """How old the last successful database check may be while the worker takes messages:
    one renewal interval (the wait between two checks) and the next check's own time, at
    most another interval and ``PING_TIMEOUT_S``. Past it the check under way has hung."""
    return 2 * renew_interval_s(settings) + PING_TIMEOUT_S


def check_overdue_s(settings: Settings) -> float:
    """How long a check may be under way before it counts as failed (logged): a check
    starts one interval after the last one ended, so one this old has let the last
    success age past :func:`database_bound_s`."""
    return renew_interval_s(settings) + PING_TIMEOUT_S


class Liveness:
    """What the renewal thread renews for one worker process, and what its database check
    (on a thread of its own) last found."""

    def __init__(
        self,
        settings: Settings,
        delivery_tags: Callable[[], Iterable[str]],
        renew_visibility: bool = True,
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
        self.delivery_tags = delivery_tags
        self.broker = (
            redis_client(settings, settings.broker_url, RENEW_TIMEOUT_S)
            if is_redis_url(settings.broker_url)
            else None
        )
        self.renew_visibility = renew_visibility and self.broker is not None
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
        # Makes stop()'s flags and removal one step: stop may run in a signal handler
        # that interrupted a stop on the same (main) thread, hence re-entrant. Renewals
        # never take it: one under way when the stop begins is settled by the heartbeat's
        # tombstone (teamdesk/heartbeat.py), so a stop never waits for Redis to answer a
        # renewal (before, on the renewal thread, a slow renewal held the SIGTERM handler).
        self._lock = threading.RLock()

    @property
    def member(self) -> str:
        return self.heartbeat.member

    @property
    def stopping(self) -> bool:
        return self.heartbeat.stopping

    @property
    def database_ok(self) -> bool:
        """The last database check that ended succeeded, at most ``database_bound_s``
        ago: a check that hangs counts as failed once that has passed."""
        at = self._database_ok_at
        return at is not None and self.clock() - at <= self.database_bound_s

    @property
    def may_take_work(self) -> bool:
        """The last renewal succeeded, and a database check recently enough."""
        return self.registered and self.database_ok

    def tick(self) -> None:
        """One renewal of each kind (Redis alone: nothing here waits on the database);
        errors are logged and never raised."""
        self._attempt("visibility", self.keep_messages)
        if self.heartbeat.stopping:
            return
        self.registered = self._attempt("renew", self._renew) is True
        if not self.heartbeat.stopping:
            self._note_overdue_check()

    def offer_now(self) -> None:
        """Renew at once, with what the worker consumes now: after intake resumed, so the
        dispatcher sees this worker's queues within a scan instead of one renewal interval
        later (meanwhile it would size the window at nothing and warn of no consumers)."""
        if not self.heartbeat.stopping:
            self.registered = self._attempt("renew", self._renew) is True

    def _renew(self) -> bool:
        if self.offer is not None:
            self.heartbeat.consumes = self.offer()
        return self.heartbeat.renew()

    def check_database(self) -> None:
        """One database check (on the check's own thread, worker/steps.py; never on the
        renewal's): a new connection and a bounded ``SELECT 1``. Nothing once shutdown
        began: a check that ends after that changes and logs nothing."""
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
        """On the renewal thread: a check under way for longer than ``check_overdue_s``
        has hung (DNS, a pooler's queue). It is counted as failed, once; intake pauses by
        ``database_ok``'s bound alone, and the check may still end either way."""
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
        """``action``'s result, or None when it raised; a failure is logged once per outage
        of that ``stage`` (which renewal or removal it was)."""
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

    def keep_messages(self) -> None:
        """Move this process's unacknowledged messages' delivery time to now."""
        if not self.renew_visibility or self.broker is None:
            return
        tags = list(self.delivery_tags())
        if tags:
            key = f"{self.settings.queue_prefix}:{UNACKED_INDEX}"
            now = time.time()
            self.broker.zadd(key, dict.fromkeys(tags, now), xx=True)

    def stop(self, draining: bool = False) -> None:
        """Remove only this process's member from the active sets, once; later renewals
        cannot re-register it (the heartbeat's tombstone refuses them). With
        ``draining`` the member stays a lease holder, so the dispatcher keeps treating
        this process's leases as alive while its in-flight tasks finish. Once a drain
        began, a plain stop (the bootstep's, during the drain) leaves it alone: should
        the removal at SIGTERM have failed, the drain's next renewal does it."""
        with self._lock:
            self._draining = self._draining or draining
            if self._removed or (self._draining and not draining):
                return
            removed = self._attempt("remove", lambda: self.heartbeat.remove(draining=draining))
            self._removed = removed is not None

    def drain_tick(self) -> None:
        """While draining: keep the in-flight messages and the lease holder alive (each on
        its own; never raises)."""
        self._attempt("visibility", self.keep_messages)
        self._attempt("drain", self.heartbeat.renew_draining)

    def finish(self) -> None:
        """The drain is over: nothing of this process is alive any more."""
        self._attempt("finish", self.heartbeat.finish)


def held_delivery_tags() -> list[str]:
    """Delivery tags of the messages this worker has received and not yet acknowledged."""

    tags: list[str] = []
    for request in list(state.active_requests) + list(state.reserved_requests):
        message: Any = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag:
            tags.append(str(tag))
    return tags
