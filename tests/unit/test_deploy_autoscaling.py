"""The worker autoscaling manifests, checked offline (deploy/k8s/worker-autoscaling.yaml
for KEDA, worker-hpa.yaml for an HPA on an external metric): they scale the worker
Deployment that exists, on the backlog metric the dispatcher exports for exactly the
queues that Deployment consumes, from zero with KEDA, and never faster than a worker can
drain. KEDA's signal also counts the runs RUNNING on those queues (a busy fleet with no
backlog is not idle), and a missing signal is an error KEDA answers with its fallback,
never a 0 that scales the workers to zero; an alert says the signal is missing. A broken
copy of each point is caught (the checks can fail). With promtool installed (``make
lint`` installs it), the query itself is evaluated on made-up series: backlog plus
running, and no answer at all (not 0) when the dispatcher's series are gone."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dispatcher.ledger_gauges import backlog_families, families
from ledger.states import RUNNING, STATUSES
from tasks.names import QUEUE_OF_KIND
from tests.support.autoscaling import backlog_query, hpa, prometheus_trigger, scaled_object
from tests.support.deploy_files import (
    DEPLOY,
    DRAIN_S,
    argv,
    consumed_queues,
    default_of,
    find,
    k8s_documents,
    main_container,
    pod_spec,
)

BACKLOG_METRIC = "teamdesk_backlog"
TASKS_METRIC = "teamdesk_tasks"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERT_TESTS = DEPLOY / "prometheus" / "tests"
# The fallback behaviours that never shrink a busy fleet while the signal is missing
# (KEDA 2.17+; "static" and "currentReplicasIfLower" would take it down to `replicas`).
KEEPING_BEHAVIOURS = {"currentReplicas", "currentReplicasIfHigher"}


def worker_facts() -> tuple[str, set[str], float, float]:
    docs = k8s_documents()
    worker = find(docs, "Deployment", "teamdesk-worker")
    config = find(docs, "ConfigMap", "teamdesk-config")
    assert worker is not None and config is not None
    drain = default_of(config["data"].get("SHUTDOWN_TIMEOUT_S", DRAIN_S)) or DRAIN_S
    grace = float(pod_spec(worker).get("terminationGracePeriodSeconds", 30))
    return worker["metadata"]["name"], consumed_queues(argv(main_container(worker))), drain, grace


SIGNAL = re.compile(
    r'sum\(teamdesk_backlog\{queue=~"([a-z|]+)"\}\)'
    r' \+ sum\(teamdesk_tasks\{status="RUNNING",kind=~"([a-z|]+)"\}\)'
)


def query_queues(query: str) -> set[str]:
    """The queues whose backlog the query sums, when it adds the runs RUNNING of exactly
    the kinds those queues carry (tasks/names.py); else nothing."""
    match = SIGNAL.fullmatch(query)
    if not match:
        return set()
    queues, kinds = set(match.group(1).split("|")), set(match.group(2).split("|"))
    if kinds != {kind.lower() for kind, queue in QUEUE_OF_KIND.items() if queue in queues}:
        return set()
    return queues


def scaled_object_problems(doc: dict[str, Any]) -> list[str]:
    name, queues, drain, grace = worker_facts()
    spec, problems = doc["spec"], []
    if (doc["apiVersion"], doc["kind"]) != ("keda.sh/v1alpha1", "ScaledObject"):
        problems.append("not a KEDA ScaledObject")
    if spec["scaleTargetRef"].get("name") != name:
        problems.append("scales another Deployment than the worker")
    if spec.get("minReplicaCount") != 0:
        problems.append("cannot scale to zero")
    if not spec.get("maxReplicaCount", 0) >= 1:
        problems.append("no maxReplicaCount")
    if not spec.get("cooldownPeriod", 300) > drain:
        problems.append("cooldownPeriod not longer than the drain")
    if not grace >= drain:
        problems.append("terminationGracePeriodSeconds below the drain")
    down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    if not down["stabilizationWindowSeconds"] > drain:
        problems.append("scale-down window not longer than the drain")
    trigger = prometheus_trigger(doc)
    if query_queues(trigger["query"]) != queues:
        problems.append(f"query {trigger['query']!r} is not the backlog of {sorted(queues)}")
    if not float(trigger["threshold"]) > 0:
        problems.append("threshold not positive")
    if trigger.get("activationThreshold") != "0":
        problems.append("the first due run does not wake a fleet at zero")
    problems += missing_signal_problems(doc)
    return problems


def missing_signal_problems(doc: dict[str, Any]) -> list[str]:
    """A missing signal (no series: the dispatcher dead, its read failing) must be a
    scaler error answered by the fallback, never a 0 that scales the workers to zero."""
    spec, problems = doc["spec"], []
    trigger = prometheus_trigger(doc)
    if trigger.get("ignoreNullValues") != "false":
        problems.append('a missing backlog series reads as 0 (ignoreNullValues not "false")')
    (full,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
    if full.get("metricType", "AverageValue") != "AverageValue":
        problems.append("metricType not AverageValue: KEDA ignores the fallback")
    fallback = spec.get("fallback")
    if not fallback:
        return [*problems, "no fallback: a missing signal leaves the replicas to chance"]
    if not int(fallback.get("failureThreshold", 0)) >= 1:
        problems.append("fallback failureThreshold below 1")
    if not 1 <= int(fallback.get("replicas", 0)) <= spec.get("maxReplicaCount", 0):
        problems.append("fallback replicas not within 1..maxReplicaCount")
    if fallback.get("behavior", "static") not in KEEPING_BEHAVIOURS:
        problems.append("the fallback shrinks a busy fleet while the signal is missing")
    return problems


def hpa_problems(doc: dict[str, Any]) -> list[str]:
    name, queues, drain, _ = worker_facts()
    spec, problems = doc["spec"], []
    if (doc["apiVersion"], doc["kind"]) != ("autoscaling/v2", "HorizontalPodAutoscaler"):
        problems.append("not an autoscaling/v2 HPA")
    if spec["scaleTargetRef"] != {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}:
        problems.append("scales another Deployment than the worker")
    (metric,) = spec["metrics"]
    external = metric["external"]
    if metric["type"] != "External" or external["metric"]["name"] != BACKLOG_METRIC:
        problems.append("not the backlog metric")
    (selector,) = external["metric"]["selector"]["matchExpressions"]
    if (selector["key"], selector["operator"], set(selector["values"])) != ("queue", "In", queues):
        problems.append("not the worker's queues")
    if not float(external["target"]["averageValue"]) > 0:
        problems.append("target not positive")
    if not spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > drain:
        problems.append("scale-down window not longer than the drain")
    return problems


def test_the_scaled_object_scales_the_worker_on_its_queues_backlog() -> None:
    assert scaled_object_problems(scaled_object()) == []


def test_the_hpa_alternative_scales_the_worker_on_the_same_metric() -> None:
    assert hpa_problems(hpa()) == []


def test_the_query_names_a_metric_the_dispatcher_exports_for_every_queue() -> None:
    (size, _oldest) = backlog_families({})
    assert size.name == BACKLOG_METRIC
    exported_queues = {sample.labels["queue"] for sample in size.samples}
    assert query_queues(backlog_query()) == exported_queues
    # The running part: the tasks family, served by the same read, with a RUNNING series
    # for every kind (0 when none), so the sum is never absent while the backlog is there.
    (tasks,) = [f for f in families([]) if f.name == TASKS_METRIC]
    running = {s.labels["kind"] for s in tasks.samples if s.labels["status"] == RUNNING}
    assert RUNNING in STATUSES and running == {kind.lower() for kind in QUEUE_OF_KIND}
    match = SIGNAL.fullmatch(backlog_query())
    assert match is not None and set(match.group(2).split("|")) <= running


def signal_alerts() -> list[dict[str, Any]]:
    """The alert rules that fire when a series the ScaledObject's query reads is absent."""
    doc = yaml.safe_load(ALERTS.read_text())
    read = set(re.findall(r"\bteamdesk_[a-z_]+\b", backlog_query()))
    return [
        rule
        for group in doc["groups"]
        for rule in group["rules"]
        if "absent(" in rule["expr"]
        and read <= set(re.findall(r"\bteamdesk_[a-z_]+\b", rule["expr"]))
    ]


def test_a_missing_signal_alerts_with_a_promtool_test() -> None:
    alerts = signal_alerts()
    assert alerts, "no alert fires when the autoscaling signal is absent"
    for rule in alerts:
        assert rule["labels"]["severity"] == "critical"
        assert (ALERT_TESTS / f"{rule['alert']}.test.yaml").is_file(), rule["alert"]


# The query on made-up series of the leading beat, 15 s apart, read at 1m: the backlog by
# queue, the runs RUNNING by kind (both from one read: they come and go together), and
# what KEDA reads (no sample at all: the query errors, and the fallback applies).
QUERY_CASES = {
    "busy, nothing due": (
        {"exports": "0x8", "reminders": "0x8"},
        {"export": "3x8", "reminder": "0x8"},
        [3.0],
    ),
    "due and running": (
        {"exports": "5x8", "reminders": "2x8"},
        {"export": "1x8", "reminder": "1x8"},
        [9.0],
    ),
    "idle": ({"exports": "0x8", "reminders": "0x8"}, {"export": "0x8", "reminder": "0x8"}, [0.0]),
    "the dispatcher gone at 30 s": (
        {"exports": "5 5 5 stale", "reminders": "0 0 0 stale"},
        {"export": "1 1 1 stale", "reminder": "0 0 0 stale"},
        [],
    ),
}


def test_the_query_adds_running_work_and_is_empty_without_the_dispatcher(
    tmp_path: Path,
) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (make lint installs it)")
    tests = []
    for name, (backlog, running, expected) in QUERY_CASES.items():
        series = [
            {"series": f'teamdesk_backlog{{job="beat",queue="{queue}"}}', "values": values}
            for queue, values in backlog.items()
        ] + [
            {"series": f'teamdesk_tasks{{job="beat",kind="{kind}",status="RUNNING"}}', "values": v}
            for kind, v in running.items()
        ]
        check = {
            "expr": backlog_query(),
            "eval_time": "1m",
            "exp_samples": [{"labels": "{}", "value": value} for value in expected],
        }
        tests.append(
            {"name": name, "interval": "15s", "input_series": series, "promql_expr_test": [check]}
        )
    spec = tmp_path / "query.test.yaml"
    spec.write_text(yaml.safe_dump({"evaluation_interval": "15s", "tests": tests}))
    result = subprocess.run(
        [promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _query(query: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["triggers"][0]["metadata"]["query"] = query

    return edit


def _trigger(key: str, value: str | None) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        metadata = doc["spec"]["triggers"][0]["metadata"]
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value

    return edit


def _set_trigger(key: str, value: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["triggers"][0][key] = value

    return edit


def _drop(path: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1], None)

    return edit


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (_set(("spec", "minReplicaCount"), 1), "cannot scale to zero"),
        (_set(("spec", "cooldownPeriod"), 60), "cooldownPeriod"),
        (_set(("spec", "scaleTargetRef", "name"), "teamdesk-api"), "another Deployment"),
        (_query('sum(teamdesk_backlog{queue=~"exports"})'), "is not the backlog of"),
        (_query("sum(redis_list_length)"), "is not the backlog of"),
        # The backlog alone: a fleet busy with long exports reads as idle.
        (_query('sum(teamdesk_backlog{queue=~"exports|reminders"})'), "is not the backlog of"),
        (
            _query(
                'sum(teamdesk_backlog{queue=~"exports|reminders"})'
                ' + sum(teamdesk_tasks{status="RUNNING",kind=~"export"})'
            ),
            "is not the backlog of",
        ),
        (_trigger("ignoreNullValues", "true"), "reads as 0"),
        (_trigger("ignoreNullValues", None), "reads as 0"),  # KEDA's default is "true"
        (_set_trigger("metricType", "Value"), "metricType"),
        (_drop(("spec", "fallback")), "no fallback"),
        (_set(("spec", "fallback", "replicas"), 0), "fallback replicas"),
        (_set(("spec", "fallback", "replicas"), 21), "fallback replicas"),
        (_set(("spec", "fallback", "failureThreshold"), 0), "failureThreshold"),
        (_set(("spec", "fallback", "behavior"), "static"), "shrinks a busy fleet"),
        (_drop(("spec", "fallback", "behavior")), "shrinks a busy fleet"),  # static
    ],
)
def test_a_broken_scaled_object_is_caught(
    edit: Callable[[dict[str, Any]], None], problem: str
) -> None:
    doc = copy.deepcopy(scaled_object())
    edit(doc)
    assert any(problem in p for p in scaled_object_problems(doc)), scaled_object_problems(doc)
