"""Prometheus metrics: the one registry, the workers' task metrics (multiprocess mode,
fed by logged events), the scrape endpoint (docs/design.md, "Observe").
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector

# Never prometheus_client's global registry, which libraries such as Flower fill.
REGISTRY = CollectorRegistry(auto_describe=True)

OUTCOMES = ("completed", "skipped", "refused", "cancelled", "lease_lost", "retried", "failed")
# Exports take from milliseconds (a few rows) to a minute (10,000 rows, slow database).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
UNKNOWN_KIND = "unknown"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class TaskMetrics:
    """The worker-side instruments (created after :func:`use_multiprocess`, if at all)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.duration = Histogram(
            "teamdesk_task_duration_seconds",
            "Executions by kind and outcome, from the message's start to its outcome.",
            ["kind", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.claims = Counter(
            "teamdesk_task_claims",
            "Runs claimed by a worker (RUNNING).",
            ["kind"],
            registry=registry,
        )
        self.lease_lost = Counter(
            "teamdesk_task_lease_lost",
            "Executions that found their lease taken (a newer execution, a recovery).",
            ["kind"],
            registry=registry,
        )
        self.cancelled = Counter(
            "teamdesk_task_cancelled",
            "Executions stopped by a cancel of their run (the API, the CLI, a revoke).",
            ["kind"],
            registry=registry,
        )
        self.processes_lost = Counter(
            "teamdesk_pool_processes_lost",
            "Pool processes lost while running a task (the OOM killer, a crash, kill -9), by "
            "what the worker wrote: retry, failed, not_held, unreported.",
            ["outcome"],
            registry=registry,
        )
        self.heartbeat_failures = Counter(
            "teamdesk_heartbeat_renewals_failed",
            "Heartbeat renewals or removals that raised, by stage.",
            ["stage"],
            registry=registry,
        )
        self.draining = Gauge(
            "teamdesk_worker_draining",
            "1 while this worker drains after SIGTERM.",
            registry=registry,
            multiprocess_mode="livemax",
        )


_lock = threading.Lock()
_task_metrics: TaskMetrics | None = None
_multiprocess_dir: Path | None = None
_current = threading.local()  # the execution this thread runs: kind, start


def task_metrics() -> TaskMetrics:
    global _task_metrics
    with _lock:
        if _task_metrics is None:
            # In multiprocess mode the files are the registry: register nowhere.
            _task_metrics = TaskMetrics(None if _multiprocess_dir else REGISTRY)
        return _task_metrics


def declare_task_families(kinds: list[str]) -> None:
    """Create every series at zero: a family without a sample is not served, and an alert
    cannot tell "nothing happened" from "no such metric"."""
    instruments = task_metrics()
    for kind in (k.lower() for k in kinds):
        instruments.claims.labels(kind)
        instruments.lease_lost.labels(kind)
        instruments.cancelled.labels(kind)
        for outcome in OUTCOMES:
            instruments.duration.labels(kind, outcome)
    instruments.draining.set(0)


def use_multiprocess(directory: str | None = None) -> Path:
    """Switch this process and its later children to multiprocess mode, emptying the
    directory; RuntimeError once a task metric exists (call it in ``celeryd_init``)."""
    global _multiprocess_dir
    if _task_metrics is not None:
        raise RuntimeError("task metrics already exist; switch to multiprocess mode first")
    path = Path(directory or os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix="td-prom-"))
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.db"):
        old.unlink()
    os.environ[MULTIPROC_ENV] = str(path)  # children read it when they write
    prometheus_values.ValueClass = prometheus_values.MultiProcessValue()
    _multiprocess_dir = path
    return path


def scrape_registry() -> CollectorRegistry:
    """What this process's endpoint serves: the sum of all processes' files in
    multiprocess mode, else :data:`REGISTRY`."""
    if _multiprocess_dir is None:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(_multiprocess_dir))
    return registry


def serve(port: int, host: str, registry: CollectorRegistry | None = None) -> Any:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the server."""
    server, _thread = start_http_server(port, addr=host, registry=registry or scrape_registry())
    return server


def task_began(kind: str) -> None:
    """A message starts executing on this thread (Celery's ``task_prerun``)."""
    _current.kind, _current.start = kind, time.perf_counter()


def _finish(outcome: str, fields: Mapping[str, Any]) -> None:
    kind = getattr(_current, "kind", None) or fields.get("kind") or UNKNOWN_KIND
    start = getattr(_current, "start", None)
    _current.kind = _current.start = None
    if start is not None:
        task_metrics().duration.labels(kind.lower(), outcome).observe(time.perf_counter() - start)


def _started(fields: Mapping[str, Any]) -> None:
    kind = str(fields.get("kind") or UNKNOWN_KIND)
    if getattr(_current, "start", None) is None:
        task_began(kind)
    _current.kind = kind
    task_metrics().claims.labels(kind.lower()).inc()


def _lease_lost(fields: Mapping[str, Any]) -> None:
    kind = getattr(_current, "kind", None) or UNKNOWN_KIND
    task_metrics().lease_lost.labels(kind.lower()).inc()
    _finish("lease_lost", fields)


def _cancelled(fields: Mapping[str, Any]) -> None:
    kind = getattr(_current, "kind", None) or UNKNOWN_KIND
    task_metrics().cancelled.labels(kind.lower()).inc()
    _finish("cancelled", fields)


def _failed(fields: Mapping[str, Any]) -> None:
    # source=queue: Celery's failure callback in the main process; not an execution's outcome.
    if fields.get("source") != "queue":
        _finish("failed", fields)


_ON_EVENT = {
    "task.started": _started,
    "task.completed": lambda fields: _finish("completed", fields),
    "task.skipped": lambda fields: _finish("skipped", fields),
    "task.refused": lambda fields: _finish("refused", fields),
    "task.lease_lost": _lease_lost,
    "task.cancelled": _cancelled,
    "task.attempt_failed": lambda fields: _finish("retried", fields),
    "task.failed": _failed,
    "worker.stopping": lambda fields: task_metrics().draining.set(1),
    "task.process_lost": lambda fields: (
        task_metrics().processes_lost.labels(str(fields.get("outcome"))).inc()
    ),
}


def on_event(event: str, fields: Mapping[str, Any]) -> None:
    """Count one logged event (whatever the log level). A dictionary lookup for the rest."""
    handler = _ON_EVENT.get(event)
    if handler is not None:
        handler(fields)


def heartbeat_failed(stage: str) -> None:
    task_metrics().heartbeat_failures.labels(stage).inc()
