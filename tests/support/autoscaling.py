"""The worker autoscaling manifests (deploy/k8s/worker-autoscaling.yaml, worker-hpa.yaml)
as the tests read them: the ScaledObject's Prometheus query is taken from the file itself,
so the query a real Prometheus evaluates in tests/process/test_autoscaling_backlog.py is
the one KEDA would run, character for character."""

from __future__ import annotations

from typing import Any

import yaml

from tests.support.deploy_files import K8S_DIR

SCALED_OBJECT_FILE = K8S_DIR / "worker-autoscaling.yaml"
HPA_FILE = K8S_DIR / "worker-hpa.yaml"


def scaled_object() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(SCALED_OBJECT_FILE.read_text()) if d]
    return dict(doc)


def hpa() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(HPA_FILE.read_text()) if d]
    return dict(doc)


def prometheus_trigger(doc: dict[str, Any]) -> dict[str, str]:
    (trigger,) = [t for t in doc["spec"]["triggers"] if t["type"] == "prometheus"]
    return dict(trigger["metadata"])


def backlog_query() -> str:
    """The ScaledObject's query, exactly as written in the manifest."""
    return prometheus_trigger(scaled_object())["query"]
