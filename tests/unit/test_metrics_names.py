"""Every expression of the Grafana dashboard and of the alert rules names a metric the code
exports (with a sample suffix its type has), and no label set holds an id."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from api import metrics as api_metrics  # noqa: F401 - registers the API's metrics
from dispatcher import metrics as dispatcher_metrics
from dispatcher.ledger_gauges import READ_ERRORS, backlog_families, families
from teamdesk import metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "teamdesk.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
}
ID_LABELS = {"task_id", "team_id", "user_id", "owner_id", "execution_id", "id", "team", "user"}


def exported() -> dict[str, tuple[str, list[str]]]:
    """Family name -> (type, label names) of every metric a process of ours can serve."""
    worker = CollectorRegistry()
    metrics.TaskMetrics(worker)
    dispatcher_metrics.LOOP.current = dispatcher_metrics.DispatchMetrics(lambda: True, lambda: 0)
    out: dict[str, tuple[str, list[str]]] = {}
    for registry in (worker, metrics.REGISTRY):
        for family in registry.collect():
            labels = sorted({k for s in family.samples for k in s.labels} - {"le"})
            out[family.name] = (family.type, labels)
    for family in [*families([]), *backlog_families({})]:
        out[family.name] = (family.type, sorted(family.samples[0].labels))
    out["teamdesk_workers_live"] = ("gauge", [])
    out[READ_ERRORS._name] = ("counter", [])
    dispatcher_metrics.LOOP.current = None
    return out


def sample_names() -> set[str]:
    return {name + suffix for name, (kind, _) in exported().items() for suffix in SUFFIXES[kind]}


def dashboard_exprs() -> list[str]:
    def walk(node: Any) -> list[str]:
        if isinstance(node, dict):
            found = [node["expr"]] if isinstance(node.get("expr"), str) else []
            return found + [e for value in node.values() for e in walk(value)]
        if isinstance(node, list):
            return [e for item in node for e in walk(item)]
        return []

    return walk(json.loads(DASHBOARD.read_text()))


def alert_exprs() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bteamdesk_[a-z_]+\b", expr))


def test_every_dashboard_expression_names_an_exported_metric() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 14
    known = sample_names()
    for expr in exprs:
        named = names_in(expr)
        assert named, expr
        assert named <= known, (expr, named - known)


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    text = " ".join(dashboard_exprs())
    for metric in (
        "teamdesk_task_duration_seconds_count",  # throughput by kind
        "teamdesk_tasks_oldest_waiting_seconds",  # start latency, oldest waiting
        "teamdesk_dispatcher_recovered_total",
        "teamdesk_task_lease_lost_total",
        "teamdesk_dispatcher_scan_duration_seconds_bucket",
        "teamdesk_workers_live",
    ):
        assert metric in text


def test_every_alert_expression_names_an_exported_metric() -> None:
    exprs = alert_exprs()
    assert len(exprs) == 9
    known = sample_names()
    for expr in exprs:
        named = names_in(expr)
        assert named and named <= known, (expr, named - known)


def test_no_metric_has_an_id_as_a_label() -> None:
    for name, (_kind, labels) in exported().items():
        assert not set(labels) & ID_LABELS, name
