"""The ledger's gauges, read by the leading dispatcher only, with one bounded statement
cached for :data:`CACHE_S` (docs/design.md, "Observe"). A failed read serves none of
them and counts ``teamdesk_ledger_read_errors_total``: alerts see the gauges absent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
import sqlalchemy as sa
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError

from dispatcher.context import Cluster, transaction
from ledger.states import KINDS, STATUSES
from ledger.waiting import backlog_by_kind
from tasks.names import QUEUE_OF_KIND
from teamdesk import metrics
from teamdesk.heartbeat import live_members

CACHE_S = 5.0

# One round trip; every part uses a partial index of the dispatcher's but the status
# count, which retention bounds.
_READ = sa.text(
    """
    SELECT 'tasks' AS part, kind, status, count(*)::float8 AS value
      FROM background_tasks GROUP BY kind, status
    UNION ALL
    SELECT 'silent', kind, NULL, count(*)::float8
      FROM background_tasks
     WHERE status = 'RUNNING' AND updated_at < now() - make_interval(secs => :half_stale_s)
     GROUP BY kind
    UNION ALL
    SELECT 'window', kind, NULL, count(*)::float8
      FROM background_tasks WHERE status = 'WAITING' AND dispatched_at IS NOT NULL
     GROUP BY kind
    """
)

READ_ERRORS = Counter(
    "teamdesk_ledger_read_errors",
    "Reads of the ledger gauges that failed (the gauges were left out of that scrape).",
    registry=metrics.REGISTRY,
)


class LedgerGauges(Collector):
    """Collects on the scrape thread; reads at most once per :data:`CACHE_S`."""

    def __init__(
        self,
        cluster: Cluster,
        leading: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.leading = leading
        self.clock = clock
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._families: list[GaugeMetricFamily] = []

    def collect(self) -> Iterable[Any]:
        if not self.leading():
            return []
        with self._lock:
            if self.clock() - self._read_at >= CACHE_S:
                self._families = self._read()
                self._read_at = self.clock()
            return list(self._families)

    def _read(self) -> list[GaugeMetricFamily]:
        try:
            with transaction(self.cluster.engine) as conn:
                rows = conn.execute(
                    _READ, {"half_stale_s": self.cluster.settings.stale_after_s / 2}
                ).all()
                backlog = backlog_by_kind(conn)
            live = len(live_members(self.cluster.results, self.cluster.settings.queue_prefix))
        except (SQLAlchemyError, redis.RedisError):
            READ_ERRORS.inc()
            return []
        return [*families(rows, backlog), *backlog_families(backlog), _live(live)]


def families(
    rows: Sequence[Any], backlog: dict[str, tuple[int, float]] | None = None
) -> list[GaugeMetricFamily]:
    """The gauges from the statement's rows, with a zero for every kind (and status). The
    oldest due WAITING task is the backlog's oldest, read once for both gauges."""
    got = {(row.part, row.kind, row.status): row.value for row in rows}
    for kind, (_count, age) in (backlog or {}).items():
        got[("oldest", kind, None)] = age
    tasks = GaugeMetricFamily(
        "teamdesk_tasks", "Tasks by kind and status.", labels=["kind", "status"]
    )
    for kind in KINDS:
        for status in STATUSES:
            tasks.add_metric([kind.lower(), status], got.get(("tasks", kind, status), 0.0))
    out = [tasks]
    for part, name, text in (
        ("oldest", "teamdesk_tasks_oldest_waiting_seconds", "Age of the oldest due WAITING task."),
        ("silent", "teamdesk_tasks_running_silent", "RUNNING rows silent > STALE_AFTER_S/2."),
        ("window", "teamdesk_dispatch_window_depth", "Runs published, not yet claimed."),
    ):
        family = GaugeMetricFamily(name, text, labels=["kind"])
        for kind in KINDS:
            family.add_metric([kind.lower()], got.get((part, kind, None), 0.0))
        out.append(family)
    return out


def backlog_families(backlog: dict[str, tuple[int, float]]) -> list[GaugeMetricFamily]:
    """The backlog gauges, by queue (what a worker Deployment consumes): every queue, 0
    when nothing is due."""
    size = GaugeMetricFamily(
        "teamdesk_backlog",
        "Runs due now (database clock) and not yet claimed, by queue; each part capped.",
        labels=["queue"],
    )
    oldest = GaugeMetricFamily(
        "teamdesk_backlog_oldest_seconds",
        "Age of the oldest run due and not yet claimed, by queue (0 when none).",
        labels=["queue"],
    )
    for kind, queue in QUEUE_OF_KIND.items():
        count, age = backlog.get(kind, (0, 0.0))
        size.add_metric([queue], float(count))
        oldest.add_metric([queue], age)
    return [size, oldest]


def _live(count: int) -> GaugeMetricFamily:
    return GaugeMetricFamily("teamdesk_workers_live", "Live worker heartbeat members.", count)
