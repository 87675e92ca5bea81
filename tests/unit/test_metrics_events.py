"""The workers' metrics come from the events they log (teamdesk/metrics.py): each outcome
event ends the execution's clock with its outcome; claims and lease losses are counted."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from teamdesk import metrics
from teamdesk.config import ConfigError, load_settings
from teamdesk.logs import log_event

log = logging.getLogger("test.metrics")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[CollectorRegistry]:
    fresh = CollectorRegistry()
    monkeypatch.setattr(metrics, "_task_metrics", metrics.TaskMetrics(fresh))
    yield fresh
    metrics._current.kind = metrics._current.start = None


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def run(events: list[tuple[str, dict[str, object]]], kind: str = "EXPORT") -> None:
    metrics.task_began(kind)
    for event, fields in events:
        log_event(log, event, logging.DEBUG, **fields)  # counted whatever the level


def test_outcomes_end_the_clock_with_their_label(registry: CollectorRegistry) -> None:
    log.setLevel(logging.ERROR)
    run([("task.started", {"kind": "EXPORT"}), ("task.completed", {})])
    run([("task.skipped", {})], kind="REMINDER")
    run([("task.started", {"kind": "EXPORT"}), ("task.lease_lost", {})])
    run([("task.started", {"kind": "EXPORT"}), ("task.cancelled", {})])
    run([("task.started", {"kind": "EXPORT"}), ("task.attempt_failed", {"exhausted": False})])
    run([("task.started", {"kind": "REMINDER"}), ("task.failed", {"exhausted": True})], "REMINDER")
    count = "teamdesk_task_duration_seconds_count"
    assert value(registry, count, kind="export", outcome="completed") == 1
    assert value(registry, count, kind="reminder", outcome="skipped") == 1
    assert value(registry, count, kind="export", outcome="lease_lost") == 1
    assert value(registry, count, kind="export", outcome="cancelled") == 1
    assert value(registry, count, kind="export", outcome="retried") == 1
    assert value(registry, count, kind="reminder", outcome="failed") == 1
    assert value(registry, "teamdesk_task_claims_total", kind="export") == 4
    assert value(registry, "teamdesk_task_claims_total", kind="reminder") == 1
    assert value(registry, "teamdesk_task_lease_lost_total", kind="export") == 1
    assert value(registry, "teamdesk_task_cancelled_total", kind="export") == 1
    assert (
        value(registry, "teamdesk_task_duration_seconds_sum", kind="export", outcome="completed")
        >= 0
    )


def test_a_queue_failure_callback_is_no_second_outcome(registry: CollectorRegistry) -> None:
    run([("task.started", {"kind": "EXPORT"}), ("task.failed", {"source": "queue"})])
    total = sum(
        value(registry, "teamdesk_task_duration_seconds_count", kind="export", outcome=o)
        for o in metrics.OUTCOMES
    )
    assert total == 0


def test_draining_and_heartbeat_failures(registry: CollectorRegistry) -> None:
    assert value(registry, "teamdesk_worker_draining") == 0
    log_event(log, "worker.stopping", signal="SIGTERM", budget_s=75)
    metrics.heartbeat_failed("renew")
    metrics.heartbeat_failed("renew")
    assert value(registry, "teamdesk_worker_draining") == 1
    assert value(registry, "teamdesk_heartbeat_renewals_failed_total", stage="renew") == 2


def test_metrics_port_and_host_are_read_and_checked() -> None:
    default = load_settings({})
    assert (default.metrics_port, default.metrics_host) == (0, "127.0.0.1")
    set_ = load_settings({"METRICS_PORT": "9540", "METRICS_HOST": "0.0.0.0"})
    assert (set_.metrics_port, set_.metrics_host) == (9540, "0.0.0.0")
    for bad in ("70000", "-1", "x"):
        with pytest.raises(ConfigError, match="METRICS_PORT"):
            load_settings({"METRICS_PORT": bad})


def test_a_lost_pool_process_is_counted_by_what_the_worker_wrote(
    registry: CollectorRegistry,
) -> None:
    for outcome in ("retry", "retry", "failed"):
        log_event(log, "task.process_lost", logging.DEBUG, outcome=outcome, task_id="x")
    assert value(registry, "teamdesk_pool_processes_lost_total", outcome="retry") == 2
    assert value(registry, "teamdesk_pool_processes_lost_total", outcome="failed") == 1
