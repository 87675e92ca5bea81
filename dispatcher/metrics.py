"""The dispatcher's metrics: counters after each round, and the leader's clock gauges at
scrape time (docs/design.md, "Observe"). The clock is this host's monotonic one, never
compared with another host's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dispatcher.scan import ScanCounts
from dispatcher.window import FillCounts
from teamdesk import metrics
from teamdesk.config import Settings

SCAN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

SCAN_DURATION = Histogram(
    "teamdesk_dispatcher_scan_duration_seconds",
    "Successful scans (recover, re-publish, fill, purge), by duration.",
    buckets=SCAN_BUCKETS,
    registry=metrics.REGISTRY,
)
PUBLISHED = Counter(
    "teamdesk_dispatcher_published",
    "Task messages sent to the broker (fills and scans, re-published ones included).",
    registry=metrics.REGISTRY,
)
RECONCILED = Counter(
    "teamdesk_dispatcher_reconciled",
    "Published runs whose message was lost, stamped and published again.",
    registry=metrics.REGISTRY,
)
RECOVERED = Counter(
    "teamdesk_dispatcher_recovered",
    "RUNNING rows taken back from a dead or silent holder, by what they became.",
    ["outcome"],
    registry=metrics.REGISTRY,
)
PUBLISH_FAILED = Counter(
    "teamdesk_dispatcher_publish_failed",
    "Runs whose publish the broker refused or left uncertain.",
    registry=metrics.REGISTRY,
)
ROUNDS_FAILED = Counter(
    "teamdesk_dispatcher_scans_failed",
    "Scans or fills that could not reach a service (PostgreSQL, Redis).",
    ["service"],
    registry=metrics.REGISTRY,
)


class DispatchMetrics:
    """One loop's counters and clock; the loop calls it after each round."""

    def __init__(self, leading: Callable[[], bool], clock: Callable[[], float]) -> None:
        self.leading = leading
        self.clock = clock
        self.started = clock()
        self.last_scan: float | None = None
        self.last_purge: float | None = None

    def scanned(self, counts: ScanCounts, elapsed_s: float, purged: bool) -> None:
        RECOVERED.labels("waiting").inc(counts.recovered)
        RECOVERED.labels("failed").inc(counts.failed_recoveries)
        PUBLISHED.inc(counts.dispatched + counts.redispatched)
        RECONCILED.inc(counts.redispatched)
        PUBLISH_FAILED.inc(counts.publish_failed)
        if counts.redis_error:
            ROUNDS_FAILED.labels("Redis").inc()
            return
        SCAN_DURATION.observe(elapsed_s)
        self.last_scan = self.clock()
        if purged:
            self.last_purge = self.last_scan

    def filled(self, counts: FillCounts) -> None:
        PUBLISHED.inc(counts.dispatched)
        PUBLISH_FAILED.inc(counts.publish_failed)
        if counts.redis_error:
            ROUNDS_FAILED.labels("Redis").inc()

    def failed(self, service: str) -> None:
        ROUNDS_FAILED.labels(service).inc()

    def since(self, moment: float | None) -> float:
        """Seconds since ``moment``, or since this loop started when it never happened."""
        return self.clock() - (self.started if moment is None else moment)


class _LoopCollector(Collector):
    """The leader's clock readings, at scrape time, from the loop attached last."""

    def __init__(self) -> None:
        self.current: DispatchMetrics | None = None

    def collect(self) -> Iterable[Any]:
        loop = self.current
        leading = loop is not None and loop.leading()
        yield GaugeMetricFamily(
            "teamdesk_dispatcher_leader", "1 while this dispatcher holds the leader lock.", leading
        )
        if loop is None or not leading:
            return
        yield GaugeMetricFamily(
            "teamdesk_dispatcher_seconds_since_scan",
            "Seconds since the leader's last successful scan (since it started, before one).",
            loop.since(loop.last_scan),
        )
        yield GaugeMetricFamily(
            "teamdesk_dispatcher_seconds_since_purge",
            "Seconds since the leader's last successful purge of expired CSVs.",
            loop.since(loop.last_purge),
        )


LOOP = _LoopCollector()
metrics.REGISTRY.register(LOOP)

_served = threading.Lock()
_server: Any = None


def attach(loop_metrics: DispatchMetrics) -> None:
    LOOP.current = loop_metrics


def serve_once(settings: Settings, ledger: Collector) -> None:
    """Start this process's endpoint (once) with the ledger gauges, if METRICS_PORT is set."""
    global _server
    if not settings.metrics_port:
        return
    with _served:
        if _server is None:
            metrics.REGISTRY.register(ledger)
            _server = metrics.serve(settings.metrics_port, settings.metrics_host)
