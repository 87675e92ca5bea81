"""The worker autoscaling manifests, checked offline (deploy/k8s/worker-autoscaling.yaml
for KEDA, worker-hpa.yaml for an HPA on an external metric): they scale the worker
Deployment that exists, on the backlog metric the dispatcher exports for exactly the
queues that Deployment consumes, from zero with KEDA, and never faster than a worker can
drain. A broken copy of each point is caught (the checks can fail)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from dispatcher.ledger_gauges import backlog_families
from tests.support.autoscaling import backlog_query, hpa, prometheus_trigger, scaled_object
from tests.support.deploy_files import (
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


def worker_facts() -> tuple[str, set[str], float, float]:
    docs = k8s_documents()
    worker = find(docs, "Deployment", "teamdesk-worker")
    config = find(docs, "ConfigMap", "teamdesk-config")
    assert worker is not None and config is not None
    drain = default_of(config["data"].get("SHUTDOWN_TIMEOUT_S", DRAIN_S)) or DRAIN_S
    grace = float(pod_spec(worker).get("terminationGracePeriodSeconds", 30))
    return worker["metadata"]["name"], consumed_queues(argv(main_container(worker))), drain, grace


def query_queues(query: str) -> set[str]:
    match = re.fullmatch(r'sum\(teamdesk_backlog\{queue=~"([a-z|]+)"\}\)', query)
    return set(match.group(1).split("|")) if match else set()


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


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (_set(("spec", "minReplicaCount"), 1), "cannot scale to zero"),
        (_set(("spec", "cooldownPeriod"), 60), "cooldownPeriod"),
        (_set(("spec", "scaleTargetRef", "name"), "teamdesk-api"), "another Deployment"),
        (_query('sum(teamdesk_backlog{queue=~"exports"})'), "is not the backlog of"),
        (_query("sum(redis_list_length)"), "is not the backlog of"),
    ],
)
def test_a_broken_scaled_object_is_caught(
    edit: Callable[[dict[str, Any]], None], problem: str
) -> None:
    doc = copy.deepcopy(scaled_object())
    edit(doc)
    assert any(problem in p for p in scaled_object_problems(doc)), scaled_object_problems(doc)
