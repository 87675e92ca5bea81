"""The dispatcher loop: lead or stand by; while leading, a round is a scan when one is due,
else a fill when woken or a scheduled run is due (docs/design.md, "Dispatch").

:meth:`DispatchLoop.run_for` returns after a bounded time, so beat can stop between calls
(dispatcher/beat_host.py). Failures never end the loop: the next round comes after
``ERROR_BACKOFF_S``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dispatcher.context import Cluster, error_class
from dispatcher.errors import ScanUnavailable
from dispatcher.leader import Leadership, leader_key, leader_ttl_s
from dispatcher.listener import Wakeup, wakeup_for
from dispatcher.metrics import DispatchMetrics, attach
from dispatcher.monitor import FailureLog
from dispatcher.scan import ScanCounts, scan
from dispatcher.window import FillCounts, Window, fill
from teamdesk.db import DATABASE_ERRORS
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.dispatcher")

STANDBY_RETRY_S = 1.0  # a standby asks for the leader lock this often
PURGE_INTERVAL_S = 60.0  # CSVs are kept 24 h; a minute late is nothing
LISTEN_CHECK_S = 10.0  # SELECT 1 on the LISTEN connection this often
ERROR_BACKOFF_S = 1.0  # after a failed round, the next one no sooner than this
DUE_SLACK_S = 0.002  # wake this much after a run_at, so the database sees it as due
# Under load one fill serves this long's completions; the window holds at least
# WINDOW_SPAN_S of work (dispatcher/window.py), longer than this.
MIN_FILL_GAP_S = 0.02
# A slower fill means statistics far behind: bring the scan (which refreshes them) forward.
SLOW_FILL_S = 0.05
SLOW_FILL_RESCAN_S = 0.5
NO_CONSUMERS_LOG_S = 30.0  # dispatcher.no_consumers at most this often per queue


class DispatchLoop:
    """One process's dispatcher; :meth:`close` releases the lock and the connections."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        wakeup: Callable[[str | None], Wakeup] = wakeup_for,
        monitor: FailureLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        settings = cluster.settings
        self.cluster = cluster
        self.leadership = Leadership(
            cluster.results, leader_key(settings.queue_prefix), leader_ttl_s(settings), clock
        )
        self.window = Window(cluster, clock)
        self.monitor = monitor or FailureLog(log, clock=clock)
        self._make_wakeup = wakeup
        self._wakeup: Wakeup | None = None
        self._clock = clock
        self._next_scan = self._next_purge = self._next_check = 0.0
        self._next_due: float | None = None
        self._last_fill = float("-inf")
        self._fill_pending = False
        self._not_before = 0.0
        self._woken = True
        self._warned: dict[str, float] = {}
        self.last_scan: ScanCounts | None = None
        self.metrics = DispatchMetrics(lambda: self.leadership.leading, clock)
        attach(self.metrics)

    def run_for(self, budget_s: float) -> float:
        """Work for about ``budget_s``; returns how long the caller may wait before the
        next call (0 while leading)."""
        if not self.leadership.ensure():
            self._close_wakeup()
            return STANDBY_RETRY_S
        if self._wakeup is None:  # just became the leader: look at everything now
            self._wakeup = self._make_wakeup(self.cluster.settings.listen_url)
            self._next_scan = self._next_purge = 0.0
            self._woken = True
        deadline = self._clock() + budget_s
        while True:
            self._round()
            remaining = deadline - self._clock()
            if remaining <= 0:
                return 0.0
            self._woken = self._wakeup.wait(self._timeout(remaining))

    def close(self) -> None:
        self._close_wakeup()
        self.leadership.release()
        self.cluster.close()

    def _round(self) -> None:
        now = self._clock()
        if now < self._not_before:  # backing off after a failure; remember the wake
            self._fill_pending = self._fill_pending or self._woken
            return
        if now >= self._next_check and self._wakeup is not None:
            self._next_check = now + LISTEN_CHECK_S
            self._wakeup.check()
        try:
            if now >= self._next_scan:
                self._scan(now)
            elif self._woken or self._fill_pending or self._due(now):
                if now - self._last_fill < MIN_FILL_GAP_S:
                    self._fill_pending = True  # served by the next fill, moments away
                else:
                    self._fill(now)
        except ScanUnavailable as exc:
            self._failed(now, exc.service, exc.error)
        except DATABASE_ERRORS as exc:
            self._failed(now, "PostgreSQL", error_class(exc))

    def _due(self, now: float) -> bool:
        return self._next_due is not None and now >= self._next_due

    def _scan(self, now: float) -> None:
        purge = now >= self._next_purge
        self._last_fill, self._fill_pending = now, False
        counts = scan(self.cluster, self.window, purge=purge)
        self.metrics.scanned(counts, self._clock() - now, purge)
        self._next_scan = now + self.cluster.settings.scan_interval_s
        if purge:
            self._next_purge = now + PURGE_INTERVAL_S
        self.last_scan = counts
        self._report(counts.redis_error)
        level = logging.INFO if counts.of_note else logging.DEBUG
        log_event(log, "dispatcher.scan", level, **counts.as_dict())
        for queue in counts.no_consumers:
            self._warn_no_consumers(now, queue)
        self._next_due = None if counts.next_due_s is None else now + counts.next_due_s

    def _fill(self, now: float) -> None:
        self._last_fill, self._fill_pending = now, False
        counts: FillCounts = fill(self.cluster, self.window)
        self.metrics.filled(counts)
        if self._clock() - now > SLOW_FILL_S:
            self._next_scan = min(self._next_scan, now + SLOW_FILL_RESCAN_S)
        self._next_due = None if counts.next_due_s is None else now + counts.next_due_s
        self._report(counts.redis_error)
        if counts.dispatched:
            log_event(log, "dispatcher.scan", logging.DEBUG, dispatched=counts.dispatched)

    def _report(self, redis_error: str | None) -> None:
        if redis_error:
            self.monitor.failed("Redis", redis_error)
            self._not_before = self._clock() + ERROR_BACKOFF_S
        else:
            self.monitor.succeeded()

    def _failed(self, now: float, service: str, error: str) -> None:
        self.metrics.failed(service)
        self.monitor.failed(service, error)
        self._not_before = now + ERROR_BACKOFF_S

    def _warn_no_consumers(self, now: float, queue: str) -> None:
        last = self._warned.get(queue)
        if last is not None and now - last < NO_CONSUMERS_LOG_S:
            return
        self._warned[queue] = now
        log_event(
            log,
            "dispatcher.no_consumers",
            logging.WARNING,
            queue=queue,
            reason=f"tasks are ready but no live worker consumes the {queue} queue",
        )

    def _timeout(self, remaining: float) -> float:
        now = self._clock()
        until = [remaining, self._next_scan - now, self._next_check - now]
        if self._next_due is not None:
            until.append(self._next_due - now + DUE_SLACK_S)
        if self._fill_pending:
            until.append(self._last_fill + MIN_FILL_GAP_S - now)
        if self._not_before > now:
            until = [max(t, self._not_before - now) for t in until]
        return max(0.0, min(min(until), remaining))

    def _close_wakeup(self) -> None:
        if self._wakeup is not None:
            self._wakeup.close()
            self._wakeup = None
