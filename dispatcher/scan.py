"""The dispatcher's periodic scan, every ``SCAN_INTERVAL_S`` (docs/design.md, "Dispatch"):
recover, re-publish lost messages, fill the window, purge.

Notifications start work at once (dispatcher/loop.py); the scan is the safety net that
needs none of them:

0. **Keep the planner's statistics current** (:func:`ledger.dispatch.refresh_statistics`):
   the dispatcher's statements choose their indexes from them.
1. **Recover**: RUNNING rows silent for ``STALE_AFTER_S`` by the database's clock, or held
   by a process whose heartbeat member is gone, go back to WAITING (FAILED past
   ``MAX_RECOVERIES``). The heartbeat rule applies only when the holders were read and
   their record has been kept unbroken for more than one ``HEARTBEAT_TTL_S`` (its epoch,
   docs/design.md "Heartbeats"): "cannot tell" is never "dead".
2. **Re-publish lost messages**: a published run still WAITING whose queued marker is
   missing or carries another publish's stamp (tasks/queueing.py) lost its message - a
   Redis restart, a dispatcher killed between its stamp and its send, a refused batch -
   and so did one whose message the broker itself no longer holds, in two looks a scan
   apart (tasks/broker_view.py: ``celery purge``, a broker that lost its data; the marker
   cannot know). It is stamped anew and published again, unless no live worker consumes
   its queue (then its message may simply be waiting). Runs stamped less than
   ``PUBLISH_GRACE_S`` ago are left alone: their publish may still be under way. The
   window bounds how many runs are published at once, so this looks at all of them, not
   the oldest few.
3. **Fill** the window (dispatcher/window.py).
4. **Purge** CSVs past ``expires_at``, then finished tasks and audit rows past their
   retention (:mod:`ledger.retention`), in short batches for at most
   ``RETENTION_BUDGET_S`` (the loop asks for it every ``PURGE_INTERVAL_S``).

A Redis error ends the queue steps of this scan and is reported in
:attr:`ScanCounts.redis_error`; recovery and purge need only PostgreSQL and still run. A
PostgreSQL error ends the scan with :class:`ScanUnavailable`.
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
from ledger import dispatch, idempotency
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


@dataclass
class ScanCounts:
    """What one scan did.

    ``redis_error``: the class of the Redis or broker error this scan ran into (heartbeat
    read, markers or a publish), else None. ``no_consumers``: queues with ready runs that
    no live worker consumes.
    """

    recovered: int = 0
    failed_recoveries: int = 0
    redispatched: int = 0
    missing_from_broker: int = 0  # of those judged lost, found missing by looking at the broker
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
        """Worth a line at info: work beyond routine publishing (a recovery, a lost message
        published again, a purge, a failure). Publishing due runs is the dispatcher's
        steady state and logs at debug, as a fill does."""
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
            f"{self.missing_from_broker}), dispatched {self.dispatched}, "
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
    """Trusted only when the read worked and the holders' record has been kept unbroken
    for more than one TTL: after a flush, an eviction, a restart or a failover it has a
    new epoch, and live workers need one TTL to renew into it. ``uptime`` stands in for
    the record's age (tests inject one); it is read after the holders. Never raises."""
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
    """Step 4: expired CSVs and idempotency keys, then what is past its retention, one
    short transaction per batch, until a batch comes back short or the budget is spent."""
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
        refs = dispatch.recover_stale(
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
    """Step 2: published runs on a consumed queue whose marker is gone or stale, or whose
    message the broker no longer holds."""
    with transaction(cluster.engine) as conn:
        published = dispatch.published_before(conn, grace_s=PUBLISH_GRACE_S, batch=LOST_BATCH)
    consumed = [ref for ref in published if slots.get(QUEUE_OF_KIND[ref.kind], 0) > 0]
    matches = queueing.marker_matches(consumed, cluster.settings)
    lost = [ref for ref, ok in zip(consumed, matches, strict=True) if not ok]
    marked = [ref for ref, ok in zip(consumed, matches, strict=True) if ok]
    missing = _missing_from_broker(cluster, window, marked)
    counts.missing_from_broker = len(missing)
    lost += missing
    restamped: list[RunRef] = []
    if lost:
        with transaction(cluster.engine) as conn:
            restamped = dispatch.restamp(conn, lost)
    outcome = publish(cluster, restamped)
    counts.redispatched = outcome.sent
    counts.publish_failed += outcome.refused + outcome.uncertain
    counts.redis_error = counts.redis_error or outcome.error
    return outcome


def _missing_from_broker(cluster: Cluster, window: Window, refs: list[RunRef]) -> list[RunRef]:
    """The runs among ``refs`` (published, marker standing) whose message the broker held
    in neither of the last two looks, a scan apart (tasks/broker_view.py): purged, lost
    with the broker's data, discarded by hand. One look can miss a message in transit."""
    if not refs:
        window.unseen = {}
        return []
    queues = {QUEUE_OF_KIND[ref.kind] for ref in refs}
    views = broker_view.look(
        cluster.app, queueing.marker_redis(), cluster.settings.queue_prefix, queues
    )
    unseen: dict[tuple[uuid.UUID, int], datetime | None] = {}
    for ref in refs:
        view = views.get(QUEUE_OF_KIND[ref.kind])
        message = queueing.message_id(ref.task_id, ref.run)
        if view is not None and not view.holds(message, queueing.stamp_text(ref)):
            unseen[(ref.task_id, ref.run)] = ref.stamp
    earlier, window.unseen = window.unseen, unseen
    return [
        ref
        for ref in refs
        if (ref.task_id, ref.run) in unseen
        and earlier.get((ref.task_id, ref.run), False) == ref.stamp
    ]


def _unconsumed(cluster: Cluster, slots: dict[str, int]) -> list[str]:
    """Queues with ready runs and no live worker consuming them."""
    starving = [kind for kind in KINDS if slots.get(QUEUE_OF_KIND[kind], 0) == 0]
    if not starving:
        return []
    with transaction(cluster.engine) as conn:
        ready = dispatch.ready_kinds(conn, starving)
    return sorted(QUEUE_OF_KIND[kind] for kind in ready)
