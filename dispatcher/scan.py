"""The dispatcher's periodic scan, every ``SCAN_INTERVAL_S``: statistics, recover,
re-publish lost messages, fill, purge (docs/design.md, "Dispatch"). The safety net that
needs no notification.

A Redis error ends the queue steps of this scan (:attr:`ScanCounts.redis_error`); recovery
and purge need only PostgreSQL and still run. A PostgreSQL error raises
:class:`ScanUnavailable`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import redis
from celery import Celery

from dispatcher.context import Cluster, error_class, transaction
from dispatcher.errors import ScanUnavailable
from dispatcher.objects import purge_objects_quietly
from dispatcher.window import Published, Window, fill, publish
from ledger import dispatch, idempotency, lease
from ledger.dispatch import RunRef
from ledger.retention import Retention, purge_retired
from ledger.states import KINDS
from tasks import broker_view, queueing
from tasks.names import QUEUE_OF_KIND
from teamdesk.config import Settings, get_settings
from teamdesk.db import DATABASE_ERRORS
from teamdesk.heartbeat import read_lease_holders
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.dispatcher")

RECOVER_BATCH = 200  # RUNNING rows taken back per scan
LOST_BATCH = 2000  # published rows checked per scan (a window is far smaller)
PURGE_BATCH = 500  # CSVs cleared per scan
RETENTION_BATCH = 1000  # finished tasks, and audit rows, removed per transaction
RETENTION_BUDGET_S = 0.5  # the purge's retention batches stop after this long
PUBLISH_GRACE_S = 5.0  # a run stamped this recently may still be on its way to the broker
# Where the broker cannot list its messages: a run published this many STALE_AFTER_S ago
# (at least LOST_AFTER_MIN_S) is published again, its old message refused by its claim.
LOST_AFTER_FACTOR = 5
LOST_AFTER_MIN_S = 60.0


@dataclass
class ScanCounts:
    """What one scan did.

    ``redis_error``: the class of the Redis or broker error this scan ran into (heartbeat
    read, a look at the broker or a publish), else None. ``no_consumers``: queues with
    ready runs that no live worker consumes.
    """

    recovered: int = 0
    failed_recoveries: int = 0
    redispatched: int = 0
    missing_from_broker: int = 0  # of those judged lost, missing from two looks at the broker
    overdue: int = 0  # of those judged lost, past LOST_AFTER where the broker cannot list
    dispatched: int = 0
    publish_failed: int = 0
    purged: int = 0
    retired_tasks: int = 0  # finished tasks removed past their retention
    retired_audit: int = 0  # audit rows removed past their retention
    forgotten_keys: int = 0  # idempotency keys removed past their 24 hours
    heartbeat_rule: bool = False
    redis_error: str | None = None
    no_consumers: list[str] = field(default_factory=list)
    next_due_s: float | None = None  # until the next scheduled run is ready (database clock)
    analyzed: bool = False  # the ledger's planner statistics were refreshed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def of_note(self) -> bool:
        """Worth a line at info: work beyond routine publishing, which logs at debug."""
        work = ("recovered", "failed_recoveries", "redispatched", "purged")
        return any(getattr(self, name) for name in work) or bool(
            self.publish_failed or self.redis_error
        )

    @property
    def did_something(self) -> bool:
        return self.of_note or bool(self.dispatched)

    def summary(self) -> str:
        text = (
            f"recovered {self.recovered} (failed {self.failed_recoveries}), "
            f"re-published {self.redispatched} (missing from the broker "
            f"{self.missing_from_broker}, overdue {self.overdue}), "
            f"dispatched {self.dispatched}, "
            f"publish failed {self.publish_failed}, purged {self.purged}; "
            f"heartbeat rule {'on' if self.heartbeat_rule else 'off'}"
        )
        if self.no_consumers:
            text += f"; no live worker consumes {', '.join(self.no_consumers)}"
        return text + (f"; Redis unreachable ({self.redis_error})" if self.redis_error else "")


@dataclass(frozen=True)
class HeartbeatView:
    """The live heartbeat members, and whether "absent" may be read as "dead"."""

    live: frozenset[str]
    trusted: bool
    error: str | None = None


Uptime = Callable[[redis.Redis], float]


def read_heartbeats(
    client: redis.Redis, prefix: str, ttl_s: float, uptime: Uptime | None = None
) -> HeartbeatView:
    """Trusted only when the read worked and the holders' record is older than one TTL
    (docs/design.md, "Heartbeats"). ``uptime`` stands in for the record's age (tests
    inject one); it is read after the holders. Never raises."""
    try:
        holders = read_lease_holders(client, prefix)
        age_s = holders.record_age_s if uptime is None else uptime(client)
    except redis.RedisError as exc:
        return HeartbeatView(frozenset(), trusted=False, error=type(exc).__name__)
    return HeartbeatView(holders.members, trusted=age_s is not None and age_s > ttl_s)


def scan(
    cluster: Cluster, window: Window, *, purge: bool = False, uptime: Uptime | None = None
) -> ScanCounts:
    """One scan. Raises :class:`ScanUnavailable` when PostgreSQL cannot be reached.
    ``uptime`` stands in for the heartbeat record's age (tests inject one)."""
    counts = ScanCounts()
    try:
        with transaction(cluster.engine) as conn:
            counts.analyzed = dispatch.refresh_statistics(conn)
        _recover(cluster, counts, uptime)
        _queue_steps(cluster, window, counts)
        if purge:
            _purge(cluster, counts)
    except DATABASE_ERRORS as exc:
        raise ScanUnavailable("PostgreSQL", error_class(exc)) from exc
    return counts


def _purge(cluster: Cluster, counts: ScanCounts) -> None:
    """Step 4: expired CSVs and idempotency keys, then retention, one short transaction
    per batch, until a batch comes back short or ``RETENTION_BUDGET_S`` is spent."""
    with transaction(cluster.engine) as conn:
        counts.purged = dispatch.purge_expired(conn, batch=PURGE_BATCH)
        counts.forgotten_keys = idempotency.purge_expired(conn, batch=PURGE_BATCH)
    cluster.object_purges.poke(lambda: purge_objects_quietly(cluster))  # its own thread
    keep = Retention.of(cluster.settings)
    deadline = time.monotonic() + RETENTION_BUDGET_S
    while True:
        with transaction(cluster.engine) as conn:
            done = purge_retired(conn, keep, batch=RETENTION_BATCH)
        counts.retired_tasks += done.tasks
        counts.retired_audit += done.audit
        full = RETENTION_BATCH in (done.tasks, done.audit)
        if not full or time.monotonic() >= deadline:
            return


def run_once(
    app: Celery, settings: Settings | None = None, uptime: Uptime | None = None
) -> ScanCounts:
    """One scan with purge, on handles of its own (the ``scan`` command, tests)."""
    cluster = Cluster(app, settings or get_settings())
    try:
        return scan(cluster, Window(cluster), purge=True, uptime=uptime)
    finally:
        cluster.close()


def _recover(cluster: Cluster, counts: ScanCounts, uptime: Uptime | None) -> None:
    """Step 1. The members are read inside the transaction, after the database clock was
    read, so a process that registers and claims later is not taken for dead."""
    settings = cluster.settings
    with transaction(cluster.engine) as conn:
        seen_at = dispatch.database_now(conn)
        view = read_heartbeats(
            cluster.results, settings.queue_prefix, settings.heartbeat_ttl_s, uptime
        )
        refs = lease.recover_stale(
            conn,
            stale_after_s=settings.stale_after_s,
            live_members=view.live,
            use_heartbeats=view.trusted,
            holders_seen_at=seen_at,
            max_recoveries=settings.max_recoveries,
            batch=RECOVER_BATCH,
        )
    counts.heartbeat_rule = view.trusted
    counts.redis_error = view.error
    for ref in refs:
        failed = ref.status == "FAILED"
        counts.failed_recoveries += failed
        counts.recovered += not failed
        log_event(
            log,
            "task.stalled",
            logging.WARNING,
            task_id=str(ref.task_id),
            run=ref.run,
            outcome=ref.status,
        )


def _queue_steps(cluster: Cluster, window: Window, counts: ScanCounts) -> None:
    """Steps 2 and 3; a Redis error ends them for this scan (recorded, not raised)."""
    try:
        slots = window.slots(refresh=True)
        lost = _republish_lost(cluster, window, slots, counts)
        if lost.refused:  # the broker is refusing: filling would only add timeouts
            return
        filled = fill(cluster, window)
    except redis.RedisError as exc:
        counts.redis_error = type(exc).__name__
        return
    counts.dispatched = filled.dispatched
    counts.next_due_s = filled.next_due_s
    counts.publish_failed += filled.publish_failed
    counts.redis_error = counts.redis_error or filled.redis_error
    if window.error is None:
        counts.no_consumers = _unconsumed(cluster, slots)


def _republish_lost(
    cluster: Cluster, window: Window, slots: dict[str, int], counts: ScanCounts
) -> Published:
    """Step 2: published runs on a consumed queue whose message the broker no longer holds."""
    overdue_s = max(LOST_AFTER_MIN_S, LOST_AFTER_FACTOR * cluster.settings.stale_after_s)
    with transaction(cluster.engine) as conn:
        published = dispatch.published_before(
            conn, grace_s=PUBLISH_GRACE_S, overdue_s=overdue_s, batch=LOST_BATCH
        )
    consumed = [(ref, old) for ref, old in published if slots.get(QUEUE_OF_KIND[ref.kind], 0) > 0]
    missing, overdue = _missing_from_broker(cluster, window, consumed)
    counts.missing_from_broker, counts.overdue = len(missing), len(overdue)
    restamped: list[RunRef] = []
    if missing or overdue:
        with transaction(cluster.engine) as conn:
            restamped = dispatch.restamp(conn, missing + overdue)
    outcome = publish(cluster, restamped)
    counts.redispatched = outcome.sent
    counts.publish_failed += outcome.refused + outcome.uncertain
    counts.redis_error = counts.redis_error or outcome.error
    return outcome


def _missing_from_broker(
    cluster: Cluster, window: Window, published: list[tuple[RunRef, bool]]
) -> tuple[list[RunRef], list[RunRef]]:
    """The runs among ``published`` whose message the broker held in neither of the last
    two looks, a scan apart; and those overdue (stamped past LOST_AFTER) where the broker
    cannot say the message is still to come: it can only count (or cannot tell) and holds
    messages, or it holds the message only as taken by a consumer, which never claimed the
    run (it may have died with it: kombu gives the message back after an hour)."""
    if not published:
        window.unseen = {}
        return [], []
    queues = {QUEUE_OF_KIND[ref.kind] for ref, _ in published}
    views = broker_view.look(cluster.app, cluster.broker, cluster.settings.queue_prefix, queues)
    unseen: dict[tuple[uuid.UUID, int], datetime | None] = {}
    overdue: list[RunRef] = []
    for ref, old in published:
        view = views.get(QUEUE_OF_KIND[ref.kind])
        if view is None or (view.listed is None and view.ready > 0):
            if old:  # cannot say which message is missing: the stamp's age decides
                overdue.append(ref)
            continue
        message, stamp = queueing.message_id(ref.task_id, ref.run), queueing.stamp_text(ref)
        if not view.holds(message, stamp):
            unseen[(ref.task_id, ref.run)] = ref.stamp
        elif old and view.only_delivered(message, stamp):
            overdue.append(ref)
    earlier, window.unseen = window.unseen, unseen
    missing = [
        ref
        for ref, _ in published
        if (ref.task_id, ref.run) in unseen
        and earlier.get((ref.task_id, ref.run), False) == ref.stamp
    ]
    return missing, overdue


def _unconsumed(cluster: Cluster, slots: dict[str, int]) -> list[str]:
    """Queues with ready runs and no live worker consuming them."""
    starving = [kind for kind in KINDS if slots.get(QUEUE_OF_KIND[kind], 0) == 0]
    if not starving:
        return []
    with transaction(cluster.engine) as conn:
        ready = dispatch.ready_kinds(conn, starving)
    return sorted(QUEUE_OF_KIND[kind] for kind in ready)
