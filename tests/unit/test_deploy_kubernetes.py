"""deploy/k8s/: the Kubernetes manifests, checked offline (no cluster is needed).

Every document is validated with kubernetes-validate (strict: an unknown field is an
error) against the Kubernetes schemas that package ships. ``k8s_problems`` checks the
operational points (non-root, exec-form commands, one beat Deployment with a hot standby
and no ``-S`` replacing the dispatcher, every task queue consumed by some worker
Deployment and none naming another, the 90 s grace above the 75 s drain, exec health
probes, Services that match their pods, Flower auth built from the Secret, the metrics of
api, worker and beat: a container port named ``metrics``, METRICS_PORT on it, METRICS_HOST
the pod's IP, ``prometheus.io/*`` annotations that agree, and no Service or host port
carrying it), and every check is shown to fail on a copy of the manifests broken in
exactly that point.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from tests.support.deploy_files import (
    BEAT_REPLICAS,
    COMPONENTS,
    DRAIN_S,
    HEALTH_CMD,
    HEALTH_HARD_CAP_S,
    K8S_DIR,
    WORKER_GRACE_S,
    argv,
    beat_scheduler_problem,
    containers,
    default_of,
    find,
    flag_value,
    is_exec_form,
    main_container,
    migrate_app_role,
    pod_spec,
    runs_celery,
    runs_embedded_beat,
    unconsumed_queues,
    unknown_queues,
)

# Oldest Kubernetes minor the manifests are written for; kubernetes-validate ships its schemas.
K8S_VERSION = "1.31.0"

# Each component serving /metrics (docs/observability.md; deploy/operations.md, "Metrics").
METRICS_DEPLOYMENTS = ("teamdesk-api", "teamdesk-worker", "teamdesk-beat")

# Each component's own Secret (deploy/security.md, "Who gets which secret").
SECRETS = [("Secret", f"teamdesk-{component}") for component in COMPONENTS]


def k8s_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    wanted = [
        ("Deployment", "teamdesk-worker"),
        ("Deployment", "teamdesk-beat"),
        ("Deployment", "teamdesk-api"),
        ("Service", "teamdesk-api"),
        ("Deployment", "teamdesk-flower"),
        ("Service", "teamdesk-flower"),
        ("Job", "teamdesk-migrate"),
        ("ConfigMap", "teamdesk-config"),
        *SECRETS,
    ]
    missing = [w for w in wanted if find(docs, *w) is None]
    if missing:
        return [f"manifests missing: {missing}"]
    worker = find(docs, "Deployment", "teamdesk-worker")
    beat = find(docs, "Deployment", "teamdesk-beat")
    api = find(docs, "Deployment", "teamdesk-api")
    flower = find(docs, "Deployment", "teamdesk-flower")
    migrate = find(docs, "Job", "teamdesk-migrate")
    config = find(docs, "ConfigMap", "teamdesk-config")
    assert worker and beat and api and flower and migrate and config

    workloads = [d for d in docs if d.get("kind") in ("Deployment", "Job")]
    for w in workloads:
        name = w["metadata"]["name"]
        pod_sc = pod_spec(w).get("securityContext") or {}
        for c in containers(w):
            c_sc = c.get("securityContext") or {}
            if c_sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
                problems.append(f"{name}/{c['name']}: runAsNonRoot not true")
            if c_sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
                problems.append(f"{name}/{c['name']}: runAsUser 0")
            if not is_exec_form(argv(c)):
                problems.append(f"{name}/{c['name']}: command is not exec form")

    # worker
    wspec = pod_spec(worker)
    grace = wspec.get("terminationGracePeriodSeconds", 30)
    if grace != WORKER_GRACE_S:
        problems.append(f"worker: terminationGracePeriodSeconds is {grace}, not 90")
    drain = default_of(config.get("data", {}).get("SHUTDOWN_TIMEOUT_S", DRAIN_S))
    if drain is None or not drain < grace:
        problems.append("worker: SHUTDOWN_TIMEOUT_S is not below the grace period")
    wc = main_container(worker)
    wargv = argv(wc)
    if not (runs_celery(wargv, "worker") and flag_value(wargv, "-A", "--app") == "tasks"):
        problems.append("worker: command is not celery -A tasks worker")
    for probe in ("livenessProbe", "readinessProbe"):
        p = wc.get(probe) or {}
        if (p.get("exec") or {}).get("command") != HEALTH_CMD:
            problems.append(f"worker: {probe} is not exec teamdesk-tasks health")
        if not p.get("timeoutSeconds", 1) > HEALTH_HARD_CAP_S:
            problems.append(f"worker: {probe} timeoutSeconds not above the 4 s cap")
    instance = [e for e in wc.get("env") or [] if e.get("name") == "WORKER_INSTANCE_ID"]
    field = (
        ((instance[0].get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if instance
        else None
    )
    if field != "metadata.name":
        problems.append("worker: WORKER_INSTANCE_ID is not the pod name (downward API)")

    # exactly one beat
    beat_deployments = [
        d["metadata"]["name"]
        for d in docs
        if d.get("kind") == "Deployment"
        and any(runs_celery(argv(c), "beat") or runs_embedded_beat(argv(c)) for c in containers(d))
    ]
    if beat_deployments != ["teamdesk-beat"]:
        problems.append(f"not exactly one beat Deployment: {beat_deployments}")
    if beat["spec"].get("replicas", 1) < BEAT_REPLICAS:
        problems.append("beat: replicas below 2, no hot standby")
    strategy = beat["spec"].get("strategy") or {}
    max_unavailable = (strategy.get("rollingUpdate") or {}).get("maxUnavailable")
    if strategy.get("type") != "RollingUpdate" or max_unavailable != 0:
        problems.append("beat: strategy is not RollingUpdate with maxUnavailable 0")
    if scheduler_problem := beat_scheduler_problem("beat", argv(main_container(beat))):
        problems.append(scheduler_problem)

    # every task queue has a consumer among the worker Deployments, and none names another
    k8s_worker_commands = [
        argv(c)
        for d in docs
        if d.get("kind") == "Deployment"
        for c in containers(d)
        if runs_celery(argv(c), "worker")
    ]
    if unconsumed := unconsumed_queues(k8s_worker_commands):
        problems.append(f"no worker Deployment consumes queue(s) {unconsumed}")
    for command in k8s_worker_commands:
        if unknown := unknown_queues(command):
            problems.append(f"a worker Deployment names undeclared queue(s) {unknown}")

    # api
    ac = main_container(api)
    if (((ac.get("readinessProbe") or {}).get("httpGet") or {}).get("path")) != "/api/health":
        problems.append("api: readinessProbe is not GET /api/health")
    problems.extend(_service_problems(docs, "teamdesk-api", api))

    # flower
    fc = main_container(flower)
    if not runs_celery(argv(fc), "flower"):
        problems.append("flower: command is not celery ... flower")
    fenv = {e["name"]: e for e in fc.get("env") or []}
    auth = (fenv.get("FLOWER_BASIC_AUTH") or {}).get("value")
    from_secret = all(
        ((fenv.get(n) or {}).get("valueFrom") or {}).get("secretKeyRef")
        for n in ("FLOWER_USER", "FLOWER_PASSWORD")
    )
    if auth != "$(FLOWER_USER):$(FLOWER_PASSWORD)" or not from_secret:
        problems.append("flower: basic auth is not built from the Secret's FLOWER_USER/PASSWORD")
    problems.extend(_service_problems(docs, "teamdesk-flower", flower))
    fsvc = find(docs, "Service", "teamdesk-flower") or {}
    if fsvc.get("spec", {}).get("type", "ClusterIP") != "ClusterIP":
        problems.append("flower: Service exposed beyond the cluster")

    for name in METRICS_DEPLOYMENTS:
        deployment = find(docs, "Deployment", name)
        assert deployment is not None
        problems.extend(_metrics_problems(docs, name, deployment))

    # migrate
    mc = main_container(migrate)
    if argv(mc)[:2] != ["teamdesk-tasks", "migrate"] or not migrate_app_role(argv(mc)):
        problems.append("migrate: command is not teamdesk-tasks migrate --app-role NAME")
    if pod_spec(migrate).get("restartPolicy") not in ("Never", "OnFailure"):
        problems.append("migrate: restartPolicy must be Never or OnFailure")
    return problems


def _metrics_problems(
    docs: list[dict[str, Any]], name: str, deployment: dict[str, Any]
) -> list[str]:
    """/metrics on the pod's address, announced by the annotations, never published."""
    container = main_container(deployment)
    ports = [p for p in container.get("ports") or [] if p.get("name") == "metrics"]
    if not ports:
        return [f"{name}: no container port named metrics"]
    port = ports[0]["containerPort"]
    problems = []
    if "hostPort" in ports[0]:
        problems.append(f"{name}: the metrics port is published on the node (hostPort)")
    env = {e["name"]: e for e in container.get("env") or []}
    if (env.get("METRICS_PORT") or {}).get("value") != str(port):
        problems.append(f"{name}: METRICS_PORT is not the metrics container port {port}")
    host = ((env.get("METRICS_HOST") or {}).get("valueFrom") or {}).get("fieldRef") or {}
    if host.get("fieldPath") != "status.podIP":
        problems.append(f"{name}: METRICS_HOST is not the pod's IP (downward API)")
    annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
    wanted = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    if any(annotations.get(k) != v for k, v in wanted.items()):
        problems.append(f"{name}: prometheus.io annotations do not announce /metrics on {port}")
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    for svc in docs:
        if svc.get("kind") != "Service":
            continue
        selector = svc["spec"].get("selector") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            continue
        for svc_port in svc["spec"].get("ports", []):
            if svc_port.get("targetPort", svc_port.get("port")) in ("metrics", port):
                problems.append(f"{name}: Service {svc['metadata']['name']} carries /metrics")
    return problems


def _service_problems(
    docs: list[dict[str, Any]], name: str, deployment: dict[str, Any]
) -> list[str]:
    svc = find(docs, "Service", name)
    if svc is None:
        return [f"{name}: no Service"]
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    selector = svc["spec"].get("selector", {})
    problems = []
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        problems.append(f"{name}: Service selector does not match the pods")
    port_names = {p.get("name") for c in containers(deployment) for p in c.get("ports", [])}
    port_numbers = {
        p.get("containerPort") for c in containers(deployment) for p in c.get("ports", [])
    }
    for port in svc["spec"].get("ports", []):
        target = port.get("targetPort", port.get("port"))
        if target not in port_names and target not in port_numbers:
            problems.append(f"{name}: Service targetPort {target} is no container port")
    return problems


# --------------------------------------------------------------------------- Kubernetes tests


def test_k8s_manifests_are_present_and_parse(k8s_docs: list[dict[str, Any]]) -> None:
    assert len(list(K8S_DIR.glob("*.yaml"))) >= 5
    assert all("apiVersion" in d and "kind" in d for d in k8s_docs)


# Custom resources have no schema in kubernetes-validate: KEDA's ScaledObject is checked
# field by field in test_deploy_autoscaling.py.
CUSTOM_API_GROUPS = ("keda.sh/",)


def test_k8s_manifests_match_the_kubernetes_schemas(k8s_docs: list[dict[str, Any]]) -> None:
    failures = []
    for doc in k8s_docs:
        if doc["apiVersion"].startswith(CUSTOM_API_GROUPS):
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert failures == []


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type"])
def test_k8s_schema_check_rejects_an_invalid_manifest(
    k8s_docs: list[dict[str, Any]], breakage: str
) -> None:
    worker = copy.deepcopy(find(k8s_docs, "Deployment", "teamdesk-worker"))
    assert worker is not None
    if breakage == "unknown field":
        pod_spec(worker)["terminationGracePeriodSecond"] = 90
    else:
        worker["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


def test_k8s_points(k8s_docs: list[dict[str, Any]]) -> None:
    assert k8s_problems(k8s_docs) == []


def _k8s_edit(
    kind: str, name: str, edit: Callable[[dict[str, Any]], None]
) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(docs: list[dict[str, Any]]) -> None:
        doc = find(docs, kind, name)
        assert doc is not None
        edit(doc)

    return mutate


def _worker_container(
    edit: Callable[[dict[str, Any]], None],
) -> Callable[[list[dict[str, Any]]], None]:
    return _k8s_edit("Deployment", "teamdesk-worker", lambda d: edit(main_container(d)))


def _set_worker_instance(container: dict[str, Any]) -> None:
    container["env"] = [{"name": "WORKER_INSTANCE_ID", "value": "worker"}]


def _k8s_second_beat(docs: list[dict[str, Any]]) -> None:
    beat = copy.deepcopy(find(docs, "Deployment", "teamdesk-beat"))
    assert beat is not None
    beat["metadata"]["name"] = "teamdesk-beat-2"
    docs.append(beat)


def _k8s_drain(docs: list[dict[str, Any]]) -> None:
    config = find(docs, "ConfigMap", "teamdesk-config")
    assert config is not None
    config["data"]["SHUTDOWN_TIMEOUT_S"] = "120"


def _k8s_drop_configmap(docs: list[dict[str, Any]]) -> None:
    config = find(docs, "ConfigMap", "teamdesk-config")
    assert config is not None
    docs.remove(config)


def _k8s_root(doc: dict[str, Any]) -> None:
    pod_spec(doc)["securityContext"] = {"runAsUser": 0}


def _k8s_flower_literal(doc: dict[str, Any]) -> None:
    main_container(doc)["env"] = [{"name": "FLOWER_BASIC_AUTH", "value": "admin:secret"}]


def _env_entry(deployment: dict[str, Any], var: str) -> dict[str, Any]:
    return next(e for e in main_container(deployment)["env"] if e["name"] == var)


def _annotations(deployment: dict[str, Any]) -> dict[str, str]:
    annotations: dict[str, str] = deployment["spec"]["template"]["metadata"]["annotations"]
    return annotations


K8S_BREAKS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    (
        "worker grace default",
        _k8s_edit(
            "Deployment",
            "teamdesk-worker",
            lambda d: pod_spec(d).pop("terminationGracePeriodSeconds"),
        ),
        "terminationGracePeriodSeconds is 30",
    ),
    ("drain above grace", _k8s_drain, "SHUTDOWN_TIMEOUT_S"),
    ("no liveness", _worker_container(lambda c: c.pop("livenessProbe")), "livenessProbe"),
    (
        "readiness http",
        _worker_container(
            lambda c: c.__setitem__("readinessProbe", {"httpGet": {"path": "/", "port": 80}})
        ),
        "readinessProbe is not exec",
    ),
    (
        "probe timeout default",
        _worker_container(lambda c: c["livenessProbe"].pop("timeoutSeconds")),
        "timeoutSeconds",
    ),
    ("instance id fixed", _worker_container(_set_worker_instance), "WORKER_INSTANCE_ID"),
    (
        "worker shell",
        _worker_container(
            lambda c: c.__setitem__("command", ["/bin/sh", "-c", "celery -A tasks worker"])
        ),
        "teamdesk-worker/worker: command is not exec form",
    ),
    ("worker as root", _k8s_edit("Deployment", "teamdesk-worker", _k8s_root), "runAsNonRoot"),
    (
        "beat one replica",
        _k8s_edit("Deployment", "teamdesk-beat", lambda d: d["spec"].__setitem__("replicas", 1)),
        "beat: replicas below 2",
    ),
    (
        "beat recreate",
        _k8s_edit(
            "Deployment",
            "teamdesk-beat",
            lambda d: d["spec"].__setitem__("strategy", {"type": "Recreate"}),
        ),
        "beat: strategy",
    ),
    (
        "beat rollout may stop the standby",
        _k8s_edit(
            "Deployment",
            "teamdesk-beat",
            lambda d: d["spec"]["strategy"]["rollingUpdate"].__setitem__("maxUnavailable", 1),
        ),
        "beat: strategy",
    ),
    ("second beat", _k8s_second_beat, "not exactly one beat"),
    (
        "beat scheduler replaced",
        _k8s_edit(
            "Deployment",
            "teamdesk-beat",
            lambda d: main_container(d).__setitem__(
                "command", ["celery", "-A", "tasks", "beat", "--scheduler=celery.beat.Scheduler"]
            ),
        ),
        "replaces the app's dispatcher scheduler",
    ),
    (
        "worker without exports",
        _worker_container(
            lambda c: c.__setitem__(
                "command", ["celery", "-A", "tasks", "worker", "-Q", "reminders"]
            )
        ),
        "no worker Deployment consumes queue(s) ['exports']",
    ),
    (
        "worker with the old maintenance queue",
        _worker_container(
            lambda c: c.__setitem__(
                "command",
                ["celery", "-A", "tasks", "worker", "-Q", "exports,reminders,maintenance"],
            )
        ),
        "names undeclared queue(s) ['maintenance']",
    ),
    (
        "api readiness",
        _k8s_edit("Deployment", "teamdesk-api", lambda d: main_container(d).pop("readinessProbe")),
        "api: readinessProbe",
    ),
    (
        "api service selector",
        _k8s_edit(
            "Service", "teamdesk-api", lambda s: s["spec"].__setitem__("selector", {"x": "y"})
        ),
        "selector",
    ),
    (
        "api service port",
        _k8s_edit(
            "Service",
            "teamdesk-api",
            lambda s: s["spec"]["ports"][0].__setitem__("targetPort", 9999),
        ),
        "targetPort",
    ),
    (
        "flower literal auth",
        _k8s_edit("Deployment", "teamdesk-flower", _k8s_flower_literal),
        "flower: basic auth",
    ),
    (
        "flower public",
        _k8s_edit(
            "Service", "teamdesk-flower", lambda s: s["spec"].__setitem__("type", "LoadBalancer")
        ),
        "beyond the cluster",
    ),
    (
        "migrate command",
        _k8s_edit(
            "Job",
            "teamdesk-migrate",
            lambda j: main_container(j).__setitem__("command", ["teamdesk-tasks"]),
        ),
        "migrate: command",
    ),
    ("no configmap", _k8s_drop_configmap, "manifests missing"),
    (
        "worker metrics on every interface",
        _k8s_edit(
            "Deployment",
            "teamdesk-worker",
            lambda d: _env_entry(d, "METRICS_HOST").update(valueFrom=None, value="0.0.0.0"),
        ),
        "teamdesk-worker: METRICS_HOST is not the pod's IP",
    ),
    (
        "beat metrics port differs from the container port",
        _k8s_edit(
            "Deployment",
            "teamdesk-beat",
            lambda d: _env_entry(d, "METRICS_PORT").__setitem__("value", "9999"),
        ),
        "teamdesk-beat: METRICS_PORT",
    ),
    (
        "beat not annotated",
        _k8s_edit(
            "Deployment",
            "teamdesk-beat",
            lambda d: d["spec"]["template"]["metadata"].pop("annotations"),
        ),
        "teamdesk-beat: prometheus.io annotations",
    ),
    (
        "api annotation names the API's port",
        _k8s_edit(
            "Deployment",
            "teamdesk-api",
            lambda d: _annotations(d).__setitem__("prometheus.io/port", "8000"),
        ),
        "teamdesk-api: prometheus.io annotations",
    ),
    (
        "worker without a metrics port",
        _k8s_edit("Deployment", "teamdesk-worker", lambda d: main_container(d).pop("ports")),
        "teamdesk-worker: no container port named metrics",
    ),
    (
        "worker metrics on the node",
        _k8s_edit(
            "Deployment",
            "teamdesk-worker",
            lambda d: main_container(d)["ports"][0].__setitem__("hostPort", 9101),
        ),
        "teamdesk-worker: the metrics port is published on the node",
    ),
    (
        "api Service carries metrics",
        _k8s_edit(
            "Service",
            "teamdesk-api",
            lambda s: s["spec"]["ports"].append(
                {"name": "metrics", "port": 9103, "targetPort": "metrics"}
            ),
        ),
        "teamdesk-api: Service teamdesk-api carries /metrics",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [(m, e) for _, m, e in K8S_BREAKS],
    ids=[name for name, _, _ in K8S_BREAKS],
)
def test_k8s_checks_catch_a_broken_manifest(
    k8s_docs: list[dict[str, Any]], mutate: Callable[[list[dict[str, Any]]], None], expected: str
) -> None:
    broken = copy.deepcopy(k8s_docs)
    mutate(broken)
    problems = k8s_problems(broken)
    assert any(expected in p for p in problems), problems
