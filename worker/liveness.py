"""A worker process's liveness in Redis: its heartbeat member and its messages' visibility.

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

Three things happen on every tick (about a quarter of ``HEARTBEAT_TTL_S``), each on its
own, so a failure of one never stops another (the broker may be another Redis, or
RabbitMQ, than the heartbeats):

- the heartbeat member (``teamdesk.heartbeat``) is renewed: it says "this process is
  alive", and so are the leases it holds. It needs Redis alone, never a new database
  connection: PostgreSQL at ``max_connections`` (or a pooler's limit, a DNS hiccup) must
  not make the dispatcher take back runs whose tasks go on working on their own
  connections. Never once shutdown began. :attr:`Liveness.registered` says whether the
  last renewal succeeded;
- the database is checked with a new connection (``SELECT 1``, bounded per transaction):
  :attr:`Liveness.database_ok`. A worker takes messages only while both hold
  (:attr:`Liveness.may_take_work`, worker/steps.py): every claim names this member, and
  every claim needs a connection;
- the visibility of this process's in-flight messages (Redis broker only). kombu keeps a
  delivered, unacknowledged message in ``unacked_index`` scored by its delivery time and
  hands it to another consumer once that is older than ``visibility_timeout`` (an hour,
  tasks/celery_app.py). Moving the score of every message this process holds to "now"
  on each tick keeps a task that runs longer than that from being handed out twice.

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

T = TypeVar("T")


class ForkGuard:
    """Held around the metric and log calls of this process's own threads (the renewal
    thread, the drain's), and by a fork: billiard forks pool processes from the main
    thread at any time (a replaced child), and a child must not inherit a lock one of
    those threads held at that moment - prometheus_client's multiprocess values share one
    lock, and a child that inherited it held would hang on its first task's metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        os.register_at_fork(
            before=self._acquire, after_in_parent=self._release, after_in_child=self._reset
        )

    def _acquire(self) -> None:
        self._lock.acquire()

    def _release(self) -> None:
        self._lock.release()

    def _reset(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


fork_guard = ForkGuard()


def renew_interval_s(settings: Settings) -> float:
    return max(0.1, min(settings.heartbeat_ttl_s, settings.stale_after_s) / 4)


class Liveness:
    """What the renewal thread renews for one worker process."""

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
        self.database_ok = False  # the last database check succeeded
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
    def may_take_work(self) -> bool:
        """The last renewal and the last database check both succeeded."""
        return self.registered and self.database_ok

    def tick(self) -> None:
        """One renewal of each kind and a database check; errors are logged and never
        raised."""
        self._attempt("visibility", self.keep_messages)
        if self.heartbeat.stopping:
            return
        self.registered = self._attempt("renew", self._renew) is True
        if self.heartbeat.stopping:
            return
        self.database_ok = self._attempt("database", self._check_database) is True

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

    def _check_database(self) -> bool:
        return select_one(
            self.settings.database_url,
            timeout_s=PING_TIMEOUT_S,
            application_name="teamdesk-worker-liveness",
        )

    def _attempt(self, stage: str, action: Callable[[], T]) -> T | None:
        """``action``'s result, or None when it raised; a failure is logged once per outage
        of that ``stage`` (which renewal or removal it was)."""
        try:
            result = action()
        except Exception as exc:
            with fork_guard:
                metrics.heartbeat_failed(stage)
                if stage not in self._failing:
                    error = type(exc).__name__
                    log_event(log, "heartbeat.failed", logging.WARNING, error=error, stage=stage)
            self._failing.add(stage)
            return None
        self._failing.discard(stage)
        return result

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
