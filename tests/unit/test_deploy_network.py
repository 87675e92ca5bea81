"""deploy/k8s/networkpolicy.yaml: what each TeamDesk pod may receive and send, computed
from the NetworkPolicies that select its pod template (deploy/security.md, "Network
policies"), checked offline.

- A default deny selects every TeamDesk pod, both ways; every workload is isolated.
- Ingress: the API on 8000, Flower on 5555, the metrics port (named ``metrics``) of the
  API, the workers and beat; nothing else reaches any pod. Flower and the metrics ports only
  from inside the cluster: every such rule names its sources by selector (never an
  ``ipBlock``, never "from anywhere"): both answer without authentication.
- Egress: DNS for every pod; PostgreSQL (5432) for migrate, api, worker and beat; Redis
  (6379) for api, worker, beat and flower; nothing else. Every egress rule names its
  destinations and ports.

The policies pass kubernetes-validate with the other manifests
(test_deploy_kubernetes.py). Every check is shown to fail on a broken copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.deploy_files import find, of_kind, pod_labels, selects

Port = tuple[str, object]  # (protocol, port); ("*", "*") for a rule without ports

DNS: set[Port] = {("UDP", 53), ("TCP", 53)}
POSTGRES: Port = ("TCP", 5432)
REDIS: Port = ("TCP", 6379)
METRICS: Port = ("TCP", "metrics")  # the container port named `metrics` (docs/observability.md)
INGRESS: dict[str, set[Port]] = {
    "migrate": set(),
    "api": {("TCP", 8000), METRICS},
    "worker": {METRICS},
    "beat": {METRICS},
    "flower": {("TCP", 5555)},
}
EGRESS: dict[str, set[Port]] = {
    "migrate": DNS | {POSTGRES},
    "api": DNS | {POSTGRES, REDIS},
    "worker": DNS | {POSTGRES, REDIS},
    "beat": DNS | {POSTGRES, REDIS},
    "flower": DNS | {REDIS},
}
ANYWHERE = {"0.0.0.0/0", "::/0"}
TEAMDESK = {"app.kubernetes.io/name": "teamdesk"}


def _types(policy: dict[str, Any]) -> set[str]:
    spec = policy["spec"]
    default = ["Ingress", *(["Egress"] if "egress" in spec else [])]
    return set(spec.get("policyTypes") or default)


def _rules(policies: list[dict[str, Any]], direction: str) -> list[dict[str, Any]]:
    key = direction.lower()
    return [rule for p in policies if direction in _types(p) for rule in p["spec"].get(key) or []]


def _ports(rules: list[dict[str, Any]]) -> set[Port]:
    ports: set[Port] = set()
    for rule in rules:
        if not rule.get("ports"):
            ports.add(("*", "*"))
        for port in rule.get("ports") or []:
            ports.add((port.get("protocol", "TCP"), port.get("port", "*")))
    return ports


def _default_deny(policies: list[dict[str, Any]], workloads: list[dict[str, Any]]) -> bool:
    return any(
        {"Ingress", "Egress"} <= _types(p)
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
        and all(selects(p["spec"].get("podSelector") or {}, pod_labels(w)) for w in workloads)
        for p in policies
    )


def network_problems(docs: list[dict[str, Any]]) -> list[str]:
    policies = of_kind(docs, "NetworkPolicy")
    workloads = [
        w
        for w in of_kind(docs, "Deployment", "Job", "StatefulSet", "DaemonSet")
        if selects({"matchLabels": TEAMDESK}, pod_labels(w))
    ]
    problems = []
    if not _default_deny(policies, workloads):
        problems.append("no default-deny policy (Ingress and Egress) selects every TeamDesk pod")
    for workload in workloads:
        problems.extend(_workload_problems(workload, policies))
    return problems


def _workload_problems(workload: dict[str, Any], policies: list[dict[str, Any]]) -> list[str]:
    name = workload["metadata"]["name"]
    component = pod_labels(workload).get("app.kubernetes.io/component", "")
    if component not in EGRESS:
        return [f"{name}: component {component!r} has no expected network access"]
    mine = [
        p for p in policies if selects(p["spec"].get("podSelector") or {}, pod_labels(workload))
    ]
    problems = []
    for direction in ("Ingress", "Egress"):
        if not any(direction in _types(p) for p in mine):
            problems.append(f"{name}: not isolated for {direction}")
    ingress, egress = _rules(mine, "Ingress"), _rules(mine, "Egress")
    if (got := _ports(ingress)) != INGRESS[component]:
        problems.append(f"{name}: ingress ports {sorted(map(str, got))}")
    if (got := _ports(egress)) != EGRESS[component]:
        problems.append(f"{name}: egress ports {sorted(map(str, got))}")
    for rule in egress:
        peers = rule.get("to") or []
        if not peers or any((p.get("ipBlock") or {}).get("cidr") in ANYWHERE for p in peers):
            problems.append(f"{name}: egress to any address")
    for rule in ingress:
        if component != "flower" and METRICS not in _ports([rule]):
            continue  # the API's own port: the ingress controller's namespace only
        peers = rule.get("from") or []
        if not peers or any("ipBlock" in peer for peer in peers):
            problems.append(f"{name}: ingress from outside the cluster")
    return problems


# --------------------------------------------------------------------------- tests


def test_network_policies(k8s_docs: list[dict[str, Any]]) -> None:
    assert network_problems(k8s_docs) == []


def _policy(name: str, edit: Callable[[dict[str, Any]], None]) -> Callable[[list[Any]], None]:
    def mutate(docs: list[dict[str, Any]]) -> None:
        policy = find(docs, "NetworkPolicy", name)
        assert policy is not None
        edit(policy["spec"])

    return mutate


def _drop_policy(name: str) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(docs: list[dict[str, Any]]) -> None:
        policy = find(docs, "NetworkPolicy", name)
        assert policy is not None
        docs.remove(policy)

    return mutate


def _components(name: str, change: Callable[[list[str]], None]) -> Callable[[list[Any]], None]:
    return _policy(name, lambda spec: change(spec["podSelector"]["matchExpressions"][0]["values"]))


def _worker_ingress(docs: list[dict[str, Any]]) -> None:
    docs.append(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "debug"},
            "spec": {
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}},
                "ingress": [{"ports": [{"port": 9000}]}],
            },
        }
    )


def _flower_from(peer: dict[str, Any] | None) -> Callable[[list[Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        rule = spec["ingress"][0]
        if peer is None:
            rule.pop("from")
        else:
            rule["from"] = [peer]

    return _policy("teamdesk-flower-ingress", edit)


def _metrics_from(peer: dict[str, Any] | None) -> Callable[[list[Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        rule = spec["ingress"][0]
        if peer is None:
            rule.pop("from")
        else:
            rule["from"] = [peer]

    return _policy("teamdesk-metrics-ingress", edit)


NETWORK_BREAKS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("no default deny", _drop_policy("teamdesk-default-deny"), "no default-deny"),
    (
        "default deny for ingress only",
        _policy("teamdesk-default-deny", lambda s: s.__setitem__("policyTypes", ["Ingress"])),
        "no default-deny",
    ),
    ("flower from anywhere", _flower_from(None), "teamdesk-flower: ingress from outside"),
    (
        "flower from an address block",
        _flower_from({"ipBlock": {"cidr": "203.0.113.0/24"}}),
        "teamdesk-flower: ingress from outside",
    ),
    (
        "api on another port too",
        _policy("teamdesk-api-ingress", lambda s: s["ingress"][0]["ports"].append({"port": 9090})),
        "teamdesk-api: ingress ports",
    ),
    ("worker reachable", _worker_ingress, "teamdesk-worker: ingress ports"),
    ("metrics from anywhere", _metrics_from(None), "teamdesk-worker: ingress from outside"),
    (
        "metrics from an address block",
        _metrics_from({"ipBlock": {"cidr": "0.0.0.0/0"}}),
        "teamdesk-beat: ingress from outside",
    ),
    (
        "metrics rule on every port",
        _policy("teamdesk-metrics-ingress", lambda s: s["ingress"][0].pop("ports")),
        "teamdesk-api: ingress ports",
    ),
    (
        "no metrics policy",
        _drop_policy("teamdesk-metrics-ingress"),
        "teamdesk-worker: ingress ports",
    ),
    (
        "flower's metrics policy",
        _components("teamdesk-metrics-ingress", lambda v: v.append("flower")),
        "teamdesk-flower: ingress ports",
    ),
    (
        "flower may reach PostgreSQL",
        _components("teamdesk-postgres-egress", lambda v: v.append("flower")),
        "teamdesk-flower: egress ports",
    ),
    (
        "migrate may not reach PostgreSQL",
        _components("teamdesk-postgres-egress", lambda v: v.remove("migrate")),
        "teamdesk-migrate: egress ports",
    ),
    (
        "migrate may reach Redis",
        _components("teamdesk-redis-egress", lambda v: v.append("migrate")),
        "teamdesk-migrate: egress ports",
    ),
    (
        "redis rule on every port",
        _policy("teamdesk-redis-egress", lambda s: s["egress"][0].pop("ports")),
        "teamdesk-api: egress ports",
    ),
    (
        "postgres rule to any address",
        _policy("teamdesk-postgres-egress", lambda s: s["egress"][0].pop("to")),
        "teamdesk-worker: egress to any address",
    ),
    (
        "redis rule to 0.0.0.0/0",
        _policy(
            "teamdesk-redis-egress",
            lambda s: s["egress"][0].__setitem__("to", [{"ipBlock": {"cidr": "0.0.0.0/0"}}]),
        ),
        "teamdesk-beat: egress to any address",
    ),
    ("no dns", _drop_policy("teamdesk-dns"), "teamdesk-beat: egress ports"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [(m, e) for _, m, e in NETWORK_BREAKS],
    ids=[name for name, _, _ in NETWORK_BREAKS],
)
def test_network_checks_catch_a_broken_policy(
    k8s_docs: list[dict[str, Any]], mutate: Callable[[list[dict[str, Any]]], None], expected: str
) -> None:
    broken = copy.deepcopy(k8s_docs)
    mutate(broken)
    problems = network_problems(broken)
    assert any(expected in p for p in problems), problems
