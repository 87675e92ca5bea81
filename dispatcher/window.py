"""Filling the window: publish ready runs into the free room of each queue's window
(docs/design.md, "Dispatch"; why this size: docs/decisions.md, "Dispatch"). Ledger first:
a run is stamped and committed before its message exists; a refused publish is
un-stamped, an uncertain one keeps its stamp for the scan's lost-message check.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import redis

from dispatcher.context import Cluster, transaction
from ledger import dispatch
from ledger.dispatch import RunRef
from ledger.states import KINDS
from tasks import queueing
from tasks.names import QUEUE_OF_KIND, TASK_QUEUES
from teamdesk import hooks
from teamdesk.config import Settings
from teamdesk.heartbeat import slots_by_queue

WINDOW_PER_SLOT = 2  # messages waiting in the broker per live worker process, at least...
WINDOW_SPAN_S = 0.05  # ... or what the queue's workers take in this long at their rate
MAX_WINDOW_PER_SLOT = 4  # and never more than this many per live worker process
RATE_WEIGHT = 0.3  # weight of the newest observation in the moving consumption rate
CAPACITY_MAX_AGE_S = 1.0  # the heartbeats are read at most this often


@dataclass
class Published:
    """What one publish did: messages sent, refused (run ready again), or uncertain."""

    sent: int = 0
    refused: int = 0
    uncertain: int = 0
    error: str | None = None


@dataclass
class FillCounts:
    dispatched: int = 0
    publish_failed: int = 0
    redis_error: str | None = None
    next_due_s: float | None = None  # until the next scheduled run is ready (database clock)
    limits: dict[str, int] = field(default_factory=dict)


class Window:
    """What the dispatcher remembers between fills: the live worker processes per queue
    (read from the heartbeats at most once per ``CAPACITY_MAX_AGE_S``; a failed read keeps
    the last good one), how fast each queue's messages are taken (a moving rate, from how
    much of the window was claimed between two fills), and per kind the team the last
    round-robin turn ended with."""

    def __init__(self, cluster: Cluster, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self._clock = clock
        self._slots: dict[str, int] = {}
        self._read_at: float | None = None
        self.error: str | None = None
        self.cursors: dict[str, uuid.UUID] = dict.fromkeys(KINDS, dispatch.NO_TEAM)
        self.rates: dict[str, float] = dict.fromkeys(KINDS, 0.0)  # messages taken per second
        self._left: dict[str, tuple[int, float]] = {}  # kind -> (in the window, when)
        # Published runs the broker did not hold at the last scan's look, with their stamp
        # (dispatcher/scan.py: a run missing from two looks is published again).
        self.unseen: dict[tuple[uuid.UUID, int], datetime | None] = {}

    def observe(self, kind: str, queued: int) -> None:
        """``queued`` messages of ``kind`` are in the window now: what left it since the last
        fill was taken by workers."""
        now = self._clock()
        if kind in self._left:
            before, at = self._left[kind]
            if now > at:
                taken = max(0, before - queued) / (now - at)
                self.rates[kind] += RATE_WEIGHT * (taken - self.rates[kind])
        self._left[kind] = (queued, now)

    def stamped(self, kind: str, queued: int) -> None:
        """After the fill: ``queued`` messages of ``kind`` are in the window."""
        self._left[kind] = (queued, self._clock())

    def slots(self, refresh: bool = False) -> dict[str, int]:
        now = self._clock()
        if refresh or self._read_at is None or now - self._read_at >= CAPACITY_MAX_AGE_S:
            try:
                self._slots = slots_by_queue(
                    self.cluster.results, self.cluster.settings.queue_prefix
                )
                self.error = None
            except redis.RedisError as exc:
                self.error = type(exc).__name__
            self._read_at = now
        return dict(self._slots)


def limits_for(
    slots: dict[str, int], settings: Settings, rates: dict[str, float] | None = None
) -> dict[str, int]:
    """Each queue's window: messages published and not yet claimed."""
    if settings.dispatch_window > 0:
        return dict.fromkeys(TASK_QUEUES, settings.dispatch_window)
    rates = rates or {}
    limits = {}
    for kind, queue in QUEUE_OF_KIND.items():
        processes = slots.get(queue, 0)
        span = math.ceil(rates.get(kind, 0.0) * WINDOW_SPAN_S)
        limits[queue] = min(MAX_WINDOW_PER_SLOT * processes, max(WINDOW_PER_SLOT * processes, span))
    return limits


def fill(cluster: Cluster, window: Window) -> FillCounts:
    """Publish ready runs into the free room of each queue's window. Raises the database's
    errors (the caller reports them); a broker or Redis error is recorded in the counts."""
    slots = window.slots()
    counts = FillCounts(redis_error=window.error)
    with transaction(cluster.engine) as conn:
        state = dispatch.window_state(conn)
        for kind in KINDS:
            window.observe(kind, state.queued[kind])
        counts.limits = limits = limits_for(slots, cluster.settings, window.rates)
        stamped: list[RunRef] = []
        for kind in KINDS:
            room = limits[QUEUE_OF_KIND[kind]] - state.queued[kind]
            if kind in state.waiting and room > 0:
                turn = dispatch.stamp_ready(
                    conn,
                    kind=kind,
                    n=room,
                    team_cap=cluster.settings.team_max_running,
                    cursor=window.cursors[kind],
                )
                stamped += turn.refs
                window.cursors[kind] = turn.cursor
                window.stamped(kind, state.queued[kind] + len(turn.refs))
    counts.next_due_s = state.next_due_s
    outcome = publish(cluster, stamped)
    counts.dispatched = outcome.sent
    counts.publish_failed = outcome.refused + outcome.uncertain
    counts.redis_error = outcome.error or counts.redis_error
    return counts


def publish(cluster: Cluster, stamped: Sequence[RunRef]) -> Published:
    """Publish stamped runs; un-stamp what the broker refused."""
    if not stamped:
        return Published()
    hooks.fire("dispatcher.before_publish", refs=stamped)
    try:
        queueing.publish_batch(cluster.app, stamped)
    except queueing.PublishFailed as exc:
        if exc.uncertain:  # keep the stamps: the lost-message check decides later
            return Published(uncertain=len(stamped), error=exc.error)
        sent, refused = list(stamped[: exc.sent]), list(stamped[exc.sent :])
        with transaction(cluster.engine) as conn:
            dispatch.unstamp(conn, refused)
        return Published(sent=len(sent), refused=len(refused), error=exc.error)
    return Published(sent=len(stamped))
