"""deploy/k8s/networkpolicy.yaml: the API's port 8000 admits the ingress controller's
namespace only (issue "Security, round four", finding 7). FORWARDED_ALLOW_IPS trusts the
pod range (deploy/k8s/api.yaml), so a pod that reached the API directly could write its
own X-Forwarded-For; only the ingress may. The namespace is the one line to adapt, and
the manifest says so. The rest of the network checks: test_deploy_network.py; every check
here is shown to fail on a broken copy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.deploy_files import K8S_DIR, find, of_kind, pod_labels, selects

API_PORT = 8000
INGRESS_NAMESPACE = {"kubernetes.io/metadata.name": "ingress-nginx"}


def _api_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    api = find(docs, "Deployment", "teamdesk-api")
    assert api is not None
    return pod_labels(api)


def _admits_port(rule: dict[str, Any]) -> bool:
    ports = rule.get("ports") or []
    return not ports or any(p.get("port") in (API_PORT, "http") for p in ports)


def api_port_sources(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every peer of every ingress rule that opens the API's port (no ``from``: a peer of
    ``{}``, from anywhere)."""
    labels = _api_labels(docs)
    peers: list[dict[str, Any]] = []
    for policy in of_kind(docs, "NetworkPolicy"):
        spec = policy["spec"]
        if not selects(spec.get("podSelector") or {}, labels):
            continue
        for rule in spec.get("ingress") or []:
            if _admits_port(rule):
                peers.extend(rule.get("from") or [{}])
    return peers


def api_ingress_problems(docs: list[dict[str, Any]]) -> list[str]:
    peers = api_port_sources(docs)
    if not peers:
        return ["nothing may reach the API's port"]
    problems = []
    for peer in peers:
        namespaces = peer.get("namespaceSelector")
        if "ipBlock" in peer or namespaces is None:
            problems.append(f"the API's port from outside the ingress namespace: {peer}")
        elif namespaces != {"matchLabels": INGRESS_NAMESPACE}:
            problems.append(f"the API's port from other namespaces: {namespaces}")
    return problems


def test_only_the_ingress_namespace_reaches_the_api(k8s_docs: list[dict[str, Any]]) -> None:
    assert api_ingress_problems(k8s_docs) == []


def test_the_manifest_says_which_line_to_adapt() -> None:
    lines = (K8S_DIR / "networkpolicy.yaml").read_text().splitlines()
    (at,) = [
        n
        for n, line in enumerate(lines)
        if line.strip() == "- namespaceSelector:  # ADAPT: your ingress controller's namespace"
    ]
    assert lines[at + 2].strip() == "kubernetes.io/metadata.name: ingress-nginx"


def _api_rule(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[Any]], None]:
    def mutate(docs: list[dict[str, Any]]) -> None:
        policy = find(docs, "NetworkPolicy", "teamdesk-api-ingress")
        assert policy is not None
        edit(policy["spec"]["ingress"][0])

    return mutate


def _extra_policy(docs: list[dict[str, Any]]) -> None:
    docs.append(
        {
            "kind": "NetworkPolicy",
            "metadata": {"name": "debug"},
            "spec": {
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "api"}},
                "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": API_PORT}]}],
            },
        }
    )


BREAKS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    (
        "every namespace",
        _api_rule(lambda r: r.__setitem__("from", [{"namespaceSelector": {}}])),
        "other namespaces",
    ),
    ("from anywhere", _api_rule(lambda r: r.pop("from")), "outside the ingress namespace"),
    (
        "an address block",
        _api_rule(lambda r: r.__setitem__("from", [{"ipBlock": {"cidr": "10.0.0.0/8"}}])),
        "outside the ingress namespace",
    ),
    (
        "another namespace",
        _api_rule(
            lambda r: r["from"][0]["namespaceSelector"]["matchLabels"].__setitem__(
                "kubernetes.io/metadata.name", "default"
            )
        ),
        "other namespaces",
    ),
    ("another policy opens the port", _extra_policy, "outside the ingress namespace"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [(m, e) for _, m, e in BREAKS], ids=[n for n, _, _ in BREAKS]
)
def test_the_check_catches_a_broken_policy(
    k8s_docs: list[dict[str, Any]], mutate: Callable[[list[dict[str, Any]]], None], expected: str
) -> None:
    broken = copy.deepcopy(k8s_docs)
    mutate(broken)
    assert any(expected in p for p in api_ingress_problems(broken)), api_ingress_problems(broken)
