"""deploy/: the Dockerfile, compose.yaml and the Kubernetes manifests, checked offline.

No Docker engine runs here, so nothing is built or started. Instead:

- ``deploy/compose.yaml`` is validated against the Compose Specification JSON schema that
  check-jsonschema vendors (``--builtin-schema vendor.compose-spec``; no download);
- every document under ``deploy/k8s/`` is validated with kubernetes-validate (strict: an
  unknown field is an error) against the Kubernetes schemas that package ships;
- the operational points (non-root image, exec-form commands, one beat service or
  Deployment with a hot standby and no ``-S`` replacing the dispatcher, every task queue
  consumed by some worker and no worker naming another queue, the 90 s grace above the
  75 s drain, health checks, log rotation, Flower auth from the environment) are checked
  on the parsed files by ``*_problems`` functions, and every check is shown to fail on a
  copy of the file broken in exactly that point;
- when the ``docker`` CLI has the compose plugin, ``docker compose config -q`` also
  validates the file (no engine needed); otherwise that one test is skipped.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dispatcher.beat_host import SCHEDULER, beat_config
from tasks.names import TASK_QUEUES as DECLARED_QUEUES
from teamdesk.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE_FILE = DEPLOY / "compose.yaml"
K8S_DIR = DEPLOY / "k8s"

# Oldest Kubernetes minor the manifests are written for; kubernetes-validate ships its schemas.
K8S_VERSION = "1.31.0"
DRAIN_S = 75.0  # SHUTDOWN_TIMEOUT_S default
WORKER_GRACE_S = 90.0  # the orchestrator's grace the drain is sized for
HEALTH_HARD_CAP_S = 4.0  # `teamdesk-tasks health` hard cap
BEAT_REPLICAS = 2  # the leader and a hot standby (deploy/README.md, "The dispatcher")

TEAMDESK_SERVICES = ("migrate", "api", "worker", "beat", "flower")
COMPOSE_SERVICES = ("postgres", "redis", *TEAMDESK_SERVICES)
EXPECTED_LOGGING = {"driver": "json-file", "options": {"max-size": "10m", "max-file": "3"}}
HEALTH_CMD = ["teamdesk-tasks", "health"]
SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash", "dash", "/bin/dash"}
# The task queues (exports, reminders): the dispatcher publishes nothing to a queue no live
# worker consumes, so each needs a consumer somewhere in the deployment; and a worker
# naming any other queue (the old `maintenance`) fails at start.
TASK_QUEUES = frozenset(DECLARED_QUEUES)
FLOWER_AUTH_RE = re.compile(r"^\$\{FLOWER_USER:\?[^}]*\}:\$\{FLOWER_PASSWORD:\?[^}]*\}$")


# --------------------------------------------------------------------------- helpers


def _duration_s(value: Any) -> float:
    """A Compose duration ("90s", "1m30s", "500ms") in seconds; NaN when unparsable."""
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return float("nan")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(n) * scale[u] for n, u in parts)


def _env_map(environment: Any) -> dict[str, Any]:
    """Compose `environment` as a dict, from either its map or its list form."""
    if environment is None:
        return {}
    if isinstance(environment, dict):
        return dict(environment)
    result: dict[str, Any] = {}
    for item in environment:
        name, _, value = str(item).partition("=")
        result[name] = value if "=" in str(item) else None
    return result


def _default_of(value: Any) -> float | None:
    """The number in a "${VAR:-75}" interpolation (or a plain number), else None."""
    match = re.fullmatch(r"\$\{[A-Z0-9_]+:?-([0-9.]+)\}|([0-9.]+)", str(value).strip())
    if not match:
        return None
    return float(match.group(1) or match.group(2))


def _is_exec_form(command: Any) -> bool:
    """A list of strings that does not start a shell wrapper (`sh -c ...`)."""
    if not isinstance(command, list) or not command:
        return False
    if not all(isinstance(part, str) for part in command):
        return False
    return command[0] not in SHELLS


def _runs_celery(command: Any, sub: str) -> bool:
    """Whether an exec-form command is `celery ... <sub> ...` (worker, beat, flower)."""
    if not isinstance(command, list) or not command:
        return False
    return command[0] == "celery" and sub in command


def _flag_value(command: list[str], *flags: str) -> str | None:
    for i, part in enumerate(command):
        for flag in flags:
            if part == flag and i + 1 < len(command):
                return command[i + 1]
            if part.startswith(flag + "="):
                return part.split("=", 1)[1]
    return None


def _runs_embedded_beat(command: list[str]) -> bool:
    return "-B" in command or "--beat" in command


def _consumed_queues(command: list[str]) -> set[str]:
    """The queues a `celery worker` command consumes: its -Q list, or every declared
    queue when it has none (Celery's default with `task_queues` set)."""
    value = _flag_value(command, "-Q", "--queues")
    if value is None:
        return set(TASK_QUEUES)
    return {q.strip() for q in value.split(",") if q.strip()}


def _unconsumed(worker_commands: list[list[str]]) -> list[str]:
    consumed: set[str] = set()
    for command in worker_commands:
        consumed |= _consumed_queues(command)
    return sorted(TASK_QUEUES - consumed)


def _unknown_queues(command: list[str]) -> list[str]:
    """Queues in a worker's -Q that the app does not declare: Celery refuses to start."""
    return sorted(_consumed_queues(command) - TASK_QUEUES)


def _beat_scheduler_problem(where: str, command: list[str]) -> str | None:
    """The app sets beat's scheduler to the dispatcher; `-S`/`--scheduler` on the command
    line would replace it (nothing dispatched), and even naming the dispatcher there is a
    copy that goes stale when the app's choice changes."""
    scheduler = _flag_value(command, "-S", "--scheduler")
    if scheduler is not None:
        return f"{where}: --scheduler {scheduler} replaces the app's dispatcher scheduler"
    return None


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    result: list[tuple[str, str]] = []
    buffer = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buffer):
            continue
        if line.endswith("\\"):
            buffer += line[:-1].strip() + " "
            continue
        buffer += line
        keyword, _, args = buffer.strip().partition(" ")
        result.append((keyword.upper(), args.strip()))
        buffer = ""
    return result


def _exec_form(args: str) -> list[str] | None:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None


def dockerfile_problems(text: str) -> list[str]:
    problems: list[str] = []
    instructions = dockerfile_instructions(text)
    froms = [i for i, (kw, _) in enumerate(instructions) if kw == "FROM"]
    if not froms:
        return ["no FROM"]
    for i in froms:
        image = instructions[i][1].split()[0]
        if image != "python:3.11-slim":
            problems.append(f"FROM {image}: expected python:3.11-slim")
    final = instructions[froms[-1] :]

    users = [args for kw, args in final if kw == "USER"]
    if not users:
        problems.append("final stage has no USER (runs as root)")
    elif users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"final stage runs as USER {users[-1]}")

    cmds = [args for kw, args in final if kw == "CMD"]
    entrypoints = [args for kw, args in final if kw == "ENTRYPOINT"]
    if not cmds:
        problems.append("no CMD")
    else:
        cmd = _exec_form(cmds[-1])
        if cmd is None or not _is_exec_form(cmd):
            problems.append(f"CMD is not exec form: {cmds[-1]}")
        elif not (_runs_celery(cmd, "worker") and _flag_value(cmd, "-A", "--app") == "tasks"):
            problems.append(f"default CMD is not the worker: {cmd}")
        elif unconsumed := _unconsumed([cmd]):
            problems.append(f"default CMD does not consume queue(s) {unconsumed}")
        elif unknown := _unknown_queues(cmd):
            problems.append(f"default CMD names undeclared queue(s) {unknown}")
    if entrypoints:
        entry = _exec_form(entrypoints[-1])
        if entry is None or (entry and not _is_exec_form(entry)):
            problems.append(f"ENTRYPOINT is not exec form: {entrypoints[-1]}")

    stops = [args for kw, args in final if kw == "STOPSIGNAL"]
    if not stops or stops[-1] not in ("SIGTERM", "15"):
        problems.append("STOPSIGNAL SIGTERM missing")

    runs = " ".join(args for kw, args in instructions if kw == "RUN")
    if not re.search(r"pip install (?:[^&;|]* )?\.(?:\s|$)", runs):
        problems.append("the project is not installed with `pip install .`")
    return problems


def dockerignore_problems(text: str) -> list[str]:
    patterns = {
        line.strip().rstrip("/")
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    }
    return [
        f".dockerignore does not exclude {p}"
        for p in (".git", ".venv", ".env")
        if p not in patterns
    ]


# --------------------------------------------------------------------------- compose


def compose_problems(doc: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    services: dict[str, Any] = doc.get("services") or {}
    missing = [name for name in COMPOSE_SERVICES if name not in services]
    if missing:
        return [f"services missing: {missing}"]

    if doc.get("x-logging") != EXPECTED_LOGGING:
        problems.append("x-logging extension is not json-file 10m x 3")
    for name, svc in services.items():
        if svc.get("logging") != EXPECTED_LOGGING:
            problems.append(f"{name}: logging is not json-file max-size 10m max-file '3'")
        if name != "migrate":
            if svc.get("restart") != "unless-stopped":
                problems.append(f"{name}: restart is not unless-stopped")
            if "stop_grace_period" not in svc:
                problems.append(f"{name}: no stop_grace_period")

    for name in TEAMDESK_SERVICES:
        command = services[name].get("command")
        if not _is_exec_form(command):
            problems.append(f"{name}: command is not exec form: {command!r}")
        if "entrypoint" in services[name]:
            problems.append(f"{name}: overrides the image entrypoint")
        if "build" not in services[name] and "image" not in services[name]:
            problems.append(f"{name}: no image")

    migrate = services["migrate"]
    if migrate.get("command") != ["teamdesk-tasks", "migrate"]:
        problems.append("migrate: command is not teamdesk-tasks migrate")
    if migrate.get("restart", "no") not in ("no", "on-failure"):
        problems.append("migrate: a one-shot must not restart after success")
    for name in ("api", "worker", "beat", "flower"):
        cond = ((services[name].get("depends_on") or {}).get("migrate") or {}).get("condition")
        if cond != "service_completed_successfully":
            problems.append(f"{name}: does not wait for migrate to complete")

    for name in ("postgres", "redis", "api", "worker", "flower"):
        if not (services[name].get("healthcheck") or {}).get("test"):
            problems.append(f"{name}: no health check")

    api_test = (services["api"].get("healthcheck") or {}).get("test") or []
    if "/api/health" not in " ".join(map(str, api_test)):
        problems.append("api: health check does not call /api/health")

    worker = services["worker"]
    wcmd = worker.get("command") or []
    if not (_runs_celery(wcmd, "worker") and _flag_value(wcmd, "-A", "--app") == "tasks"):
        problems.append("worker: command is not celery -A tasks worker")
    if not _flag_value(wcmd, "-Q", "--queues"):
        problems.append("worker: no -Q queue list")
    worker_commands = [
        s["command"]
        for s in services.values()
        if _runs_celery(s.get("command"), "worker") and isinstance(s.get("command"), list)
    ]
    if unconsumed := _unconsumed(worker_commands):
        problems.append(f"no worker service consumes queue(s) {unconsumed}")
    for name, svc in services.items():
        command = svc.get("command")
        if _runs_celery(command, "worker") and (unknown := _unknown_queues(command)):
            problems.append(f"{name}: names undeclared queue(s) {unknown}")
    worker_health = worker.get("healthcheck") or {}
    if worker_health.get("test") != ["CMD", *HEALTH_CMD]:
        problems.append("worker: health check is not [CMD, teamdesk-tasks, health]")
    if not _duration_s(worker_health.get("timeout", "30s")) > HEALTH_HARD_CAP_S:
        problems.append("worker: health check timeout not above the probe's 4 s cap")
    grace = _duration_s(worker.get("stop_grace_period", "10s"))
    if grace != WORKER_GRACE_S:
        problems.append(f"worker: stop_grace_period is not 90s: {worker.get('stop_grace_period')}")
    if worker.get("stop_signal", "SIGTERM") != "SIGTERM":
        problems.append("worker: stop_signal is not SIGTERM")
    env = _env_map(worker.get("environment"))
    if "WORKER_INSTANCE_ID" in env:
        problems.append("worker: WORKER_INSTANCE_ID set for every replica (must be unique)")
    for key in ("hostname", "container_name"):
        if key in worker:
            problems.append(f"worker: {key} is fixed, replicas would share one heartbeat scope")
    drain = _default_of(env.get("SHUTDOWN_TIMEOUT_S", DRAIN_S))
    if drain is None or not drain < grace:
        problems.append(
            f"worker: SHUTDOWN_TIMEOUT_S {env.get('SHUTDOWN_TIMEOUT_S')!r} "
            "is not below the stop grace period"
        )

    beats = [
        n
        for n, s in services.items()
        if _runs_celery(s.get("command"), "beat")
        or (isinstance(s.get("command"), list) and _runs_embedded_beat(s["command"]))
    ]
    if beats != ["beat"]:
        problems.append(f"not exactly one beat: {beats}")
    beat = services["beat"]
    replicas = beat.get("scale", (beat.get("deploy") or {}).get("replicas", 1))
    if replicas < BEAT_REPLICAS:
        problems.append(f"beat: {replicas} replica(s), no hot standby")
    if "container_name" in beat:
        problems.append("beat: container_name is fixed, a second replica cannot start")
    if scheduler_problem := _beat_scheduler_problem("beat", beat.get("command") or []):
        problems.append(scheduler_problem)

    flower = services["flower"]
    fcmd = flower.get("command") or []
    if not _runs_celery(fcmd, "flower"):
        problems.append("flower: command is not celery ... flower")
    auth_env = _env_map(flower.get("environment")).get("FLOWER_BASIC_AUTH")
    auth_arg = _flag_value(fcmd, "--basic-auth", "--basic_auth") if fcmd else None
    if not any(FLOWER_AUTH_RE.match(str(v)) for v in (auth_env, auth_arg) if v):
        problems.append("flower: basic auth is not ${FLOWER_USER:?}:${FLOWER_PASSWORD:?}")
    for port in flower.get("ports") or []:
        if not str(port).startswith("127.0.0.1:"):
            problems.append(f"flower: port {port} published beyond loopback")
    return problems


# --------------------------------------------------------------------------- Kubernetes


def _k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    for doc in docs:
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name:
            return doc
    return None


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from _pod_spec(workload).get("containers", [])


def _main_container(workload: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = _pod_spec(workload)["containers"][0]
    return container


def _argv(container: dict[str, Any]) -> list[str]:
    return [*(container.get("command") or []), *(container.get("args") or [])]


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
        ("Secret", "teamdesk-secrets"),
    ]
    missing = [w for w in wanted if _find(docs, *w) is None]
    if missing:
        return [f"manifests missing: {missing}"]
    worker = _find(docs, "Deployment", "teamdesk-worker")
    beat = _find(docs, "Deployment", "teamdesk-beat")
    api = _find(docs, "Deployment", "teamdesk-api")
    flower = _find(docs, "Deployment", "teamdesk-flower")
    migrate = _find(docs, "Job", "teamdesk-migrate")
    config = _find(docs, "ConfigMap", "teamdesk-config")
    assert worker and beat and api and flower and migrate and config

    workloads = [d for d in docs if d.get("kind") in ("Deployment", "Job")]
    for w in workloads:
        name = w["metadata"]["name"]
        pod_sc = _pod_spec(w).get("securityContext") or {}
        for c in _containers(w):
            c_sc = c.get("securityContext") or {}
            if c_sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
                problems.append(f"{name}/{c['name']}: runAsNonRoot not true")
            if c_sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
                problems.append(f"{name}/{c['name']}: runAsUser 0")
            if not _is_exec_form(_argv(c)):
                problems.append(f"{name}/{c['name']}: command is not exec form")

    # worker
    wspec = _pod_spec(worker)
    grace = wspec.get("terminationGracePeriodSeconds", 30)
    if grace != WORKER_GRACE_S:
        problems.append(f"worker: terminationGracePeriodSeconds is {grace}, not 90")
    drain = _default_of(config.get("data", {}).get("SHUTDOWN_TIMEOUT_S", DRAIN_S))
    if drain is None or not drain < grace:
        problems.append("worker: SHUTDOWN_TIMEOUT_S is not below the grace period")
    wc = _main_container(worker)
    wargv = _argv(wc)
    if not (_runs_celery(wargv, "worker") and _flag_value(wargv, "-A", "--app") == "tasks"):
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
        and any(
            _runs_celery(_argv(c), "beat") or _runs_embedded_beat(_argv(c)) for c in _containers(d)
        )
    ]
    if beat_deployments != ["teamdesk-beat"]:
        problems.append(f"not exactly one beat Deployment: {beat_deployments}")
    if beat["spec"].get("replicas", 1) < BEAT_REPLICAS:
        problems.append("beat: replicas below 2, no hot standby")
    strategy = beat["spec"].get("strategy") or {}
    max_unavailable = (strategy.get("rollingUpdate") or {}).get("maxUnavailable")
    if strategy.get("type") != "RollingUpdate" or max_unavailable != 0:
        problems.append("beat: strategy is not RollingUpdate with maxUnavailable 0")
    if scheduler_problem := _beat_scheduler_problem("beat", _argv(_main_container(beat))):
        problems.append(scheduler_problem)

    # every task queue has a consumer among the worker Deployments, and none names another
    k8s_worker_commands = [
        _argv(c)
        for d in docs
        if d.get("kind") == "Deployment"
        for c in _containers(d)
        if _runs_celery(_argv(c), "worker")
    ]
    if unconsumed := _unconsumed(k8s_worker_commands):
        problems.append(f"no worker Deployment consumes queue(s) {unconsumed}")
    for command in k8s_worker_commands:
        if unknown := _unknown_queues(command):
            problems.append(f"a worker Deployment names undeclared queue(s) {unknown}")

    # api
    ac = _main_container(api)
    if (((ac.get("readinessProbe") or {}).get("httpGet") or {}).get("path")) != "/api/health":
        problems.append("api: readinessProbe is not GET /api/health")
    problems.extend(_service_problems(docs, "teamdesk-api", api))

    # flower
    fc = _main_container(flower)
    if not _runs_celery(_argv(fc), "flower"):
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
    fsvc = _find(docs, "Service", "teamdesk-flower") or {}
    if fsvc.get("spec", {}).get("type", "ClusterIP") != "ClusterIP":
        problems.append("flower: Service exposed beyond the cluster")

    # migrate
    mc = _main_container(migrate)
    if _argv(mc) != ["teamdesk-tasks", "migrate"]:
        problems.append("migrate: command is not teamdesk-tasks migrate")
    if _pod_spec(migrate).get("restartPolicy") not in ("Never", "OnFailure"):
        problems.append("migrate: restartPolicy must be Never or OnFailure")
    return problems


def _service_problems(
    docs: list[dict[str, Any]], name: str, deployment: dict[str, Any]
) -> list[str]:
    svc = _find(docs, "Service", name)
    if svc is None:
        return [f"{name}: no Service"]
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    selector = svc["spec"].get("selector", {})
    problems = []
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        problems.append(f"{name}: Service selector does not match the pods")
    port_names = {p.get("name") for c in _containers(deployment) for p in c.get("ports", [])}
    port_numbers = {
        p.get("containerPort") for c in _containers(deployment) for p in c.get("ports", [])
    }
    for port in svc["spec"].get("ports", []):
        target = port.get("targetPort", port.get("port"))
        if target not in port_names and target not in port_numbers:
            problems.append(f"{name}: Service targetPort {target} is no container port")
    return problems


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def compose_doc() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict[str, Any]]:
    return _k8s_docs()


# --------------------------------------------------------------------------- beat


def test_plain_celery_beat_runs_the_dispatcher() -> None:
    # Why every beat command is bare `celery -A tasks beat`: the app itself sets the
    # dispatcher as beat's scheduler, and beat schedules no Celery task.
    config = beat_config(Settings())
    assert config["beat_scheduler"] == SCHEDULER
    assert config["beat_schedule"] == {}


# --------------------------------------------------------------------------- Dockerfile tests


def test_dockerfile_points(dockerfile_text: str) -> None:
    assert dockerfile_problems(dockerfile_text) == []


def test_dockerignore_keeps_secrets_and_local_state_out() -> None:
    assert dockerignore_problems(DOCKERIGNORE.read_text()) == []


DOCKERFILE_BREAKS: list[tuple[str, Callable[[str], str], str]] = [
    ("no USER", lambda t: re.sub(r"(?m)^USER .*$", "", t), "no USER"),
    ("USER root", lambda t: re.sub(r"(?m)^USER .*$", "USER root", t), "runs as USER root"),
    (
        "shell-form CMD",
        lambda t: re.sub(r"(?m)^CMD .*$", "CMD celery -A tasks worker", t),
        "CMD is not exec form",
    ),
    (
        "sh -c wrapper",
        lambda t: re.sub(r"(?m)^CMD .*$", 'CMD ["sh", "-c", "celery -A tasks worker"]', t),
        "CMD is not exec form",
    ),
    (
        "CMD not worker",
        lambda t: re.sub(r"(?m)^CMD .*$", 'CMD ["celery", "-A", "tasks", "beat"]', t),
        "default CMD is not the worker",
    ),
    (
        "shell ENTRYPOINT",
        lambda t: t + "\nENTRYPOINT /bin/sh -c start\n",
        "ENTRYPOINT is not exec form",
    ),
    ("no STOPSIGNAL", lambda t: re.sub(r"(?m)^STOPSIGNAL .*$", "", t), "STOPSIGNAL"),
    (
        "other base",
        lambda t: t.replace("python:3.11-slim", "python:3.11", 1),
        "expected python:3.11-slim",
    ),
    (
        "CMD without reminders",
        lambda t: t.replace('"exports,reminders"', '"exports"'),
        "default CMD does not consume queue(s) ['reminders']",
    ),
    (
        "CMD with the old maintenance queue",
        lambda t: t.replace('"exports,reminders"', '"exports,reminders,maintenance"'),
        "default CMD names undeclared queue(s) ['maintenance']",
    ),
    (
        "no pip install .",
        lambda t: t.replace("pip install .", "pip install teamdesk-tasks"),
        "pip install .",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [(m, e) for _, m, e in DOCKERFILE_BREAKS],
    ids=[name for name, _, _ in DOCKERFILE_BREAKS],
)
def test_dockerfile_checks_catch_a_broken_file(
    dockerfile_text: str, mutate: Callable[[str], str], expected: str
) -> None:
    broken = mutate(dockerfile_text)
    assert broken != dockerfile_text
    assert any(expected in p for p in dockerfile_problems(broken)), dockerfile_problems(broken)


def test_dockerignore_check_catches_a_missing_pattern() -> None:
    text = DOCKERIGNORE.read_text()
    broken = re.sub(r"(?m)^\.env$", "", text)
    assert broken != text
    assert dockerignore_problems(broken) == [".dockerignore does not exclude .env"]


# --------------------------------------------------------------------------- compose tests


def _check_jsonschema_compose(path: Path) -> subprocess.CompletedProcess[str]:
    # The builtin schema ships inside the check-jsonschema wheel: nothing is downloaded.
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_compose_file_matches_the_compose_specification_schema() -> None:
    result = _check_jsonschema_compose(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_rejects_an_invalid_file(
    compose_doc: dict[str, Any], tmp_path: Path
) -> None:
    broken = copy.deepcopy(compose_doc)
    broken["services"]["worker"]["stop_grace_periode"] = "90s"  # unknown key
    broken["services"]["beat"]["restart"] = ["always"]  # wrong type
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = _check_jsonschema_compose(path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "stop_grace_periode" in result.stdout + result.stderr


def test_compose_points(compose_doc: dict[str, Any]) -> None:
    assert compose_problems(compose_doc) == []


def test_compose_yaml_anchor_carries_logging(compose_doc: dict[str, Any]) -> None:
    # The services share one x-logging block through a YAML anchor, not copies.
    text = COMPOSE_FILE.read_text()
    match = re.search(r"(?m)^x-logging: &(\S+)$", text)
    assert match is not None, "no x-logging anchor"
    assert text.count(f"logging: *{match.group(1)}") >= 2
    assert compose_doc["services"]["worker"]["logging"] == EXPECTED_LOGGING


def _set(name: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["services"][name][key] = value

    return mutate


def _drop(name: str, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        del doc["services"][name][key]

    return mutate


def _set_env(name: str, var: str, value: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        env = dict(doc["services"][name].get("environment") or {})
        env[var] = value
        doc["services"][name]["environment"] = env

    return mutate


def _compose_extra_beat(doc: dict[str, Any]) -> None:
    doc["services"]["beat2"] = copy.deepcopy(doc["services"]["beat"])


def _compose_embedded_beat(doc: dict[str, Any]) -> None:
    doc["services"]["worker"]["command"] = [*doc["services"]["worker"]["command"], "-B"]


def _compose_no_migrate_wait(doc: dict[str, Any]) -> None:
    doc["services"]["worker"]["depends_on"] = {"postgres": {"condition": "service_healthy"}}


def _compose_drop_service(doc: dict[str, Any]) -> None:
    del doc["services"]["flower"]


def _compose_log_size(doc: dict[str, Any]) -> None:
    doc["services"]["api"]["logging"] = {
        "driver": "json-file",
        "options": {"max-size": "100m", "max-file": "3"},
    }


def _compose_log_int(doc: dict[str, Any]) -> None:
    doc["services"]["redis"]["logging"] = {
        "driver": "json-file",
        "options": {"max-size": "10m", "max-file": 3},
    }


def _compose_api_health(doc: dict[str, Any]) -> None:
    doc["services"]["api"]["healthcheck"] = {"test": ["CMD", "true"]}


def _compose_worker_health_shell(doc: dict[str, Any]) -> None:
    doc["services"]["worker"]["healthcheck"] = {"test": ["CMD-SHELL", "true"]}


def _compose_flower_literal_auth(doc: dict[str, Any]) -> None:
    env = dict(doc["services"]["flower"]["environment"])
    env["FLOWER_BASIC_AUTH"] = "admin:secret"
    doc["services"]["flower"]["environment"] = env


COMPOSE_BREAKS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("service missing", _compose_drop_service, "services missing"),
    ("x-logging changed", lambda d: d.__setitem__("x-logging", {"driver": "local"}), "x-logging"),
    ("log size", _compose_log_size, "api: logging"),
    ("log file count not a string", _compose_log_int, "redis: logging"),
    ("worker restart", _set("worker", "restart", "always"), "worker: restart"),
    ("flower restart missing", _drop("flower", "restart"), "flower: restart"),
    ("grace 30s", _set("worker", "stop_grace_period", "30s"), "stop_grace_period is not 90s"),
    ("grace missing", _drop("worker", "stop_grace_period"), "stop_grace_period is not 90s"),
    (
        "drain above grace",
        _set_env("worker", "SHUTDOWN_TIMEOUT_S", "${SHUTDOWN_TIMEOUT_S:-95}"),
        "SHUTDOWN_TIMEOUT_S",
    ),
    ("api grace missing", _drop("api", "stop_grace_period"), "api: no stop_grace_period"),
    (
        "worker shell command",
        _set("worker", "command", "celery -A tasks worker"),
        "worker: command is not exec form",
    ),
    (
        "worker sh -c",
        _set("worker", "command", ["sh", "-c", "celery -A tasks worker"]),
        "worker: command is not exec form",
    ),
    (
        "worker without queues",
        _set("worker", "command", ["celery", "-A", "tasks", "worker"]),
        "no -Q",
    ),
    ("worker id shared", _set_env("worker", "WORKER_INSTANCE_ID", "w1"), "WORKER_INSTANCE_ID"),
    ("worker hostname", _set("worker", "hostname", "worker"), "worker: hostname"),
    ("worker health", _compose_worker_health_shell, "worker: health check is not"),
    (
        "worker health timeout",
        lambda d: d["services"]["worker"]["healthcheck"].__setitem__("timeout", "3s"),
        "timeout not above",
    ),
    ("worker health missing", _drop("worker", "healthcheck"), "worker: no health check"),
    ("api health", _compose_api_health, "/api/health"),
    ("postgres health missing", _drop("postgres", "healthcheck"), "postgres: no health check"),
    ("migrate restarts", _set("migrate", "restart", "unless-stopped"), "migrate: a one-shot"),
    ("migrate command", _set("migrate", "command", ["teamdesk-tasks", "scan"]), "migrate: command"),
    ("no wait for migrate", _compose_no_migrate_wait, "worker: does not wait for migrate"),
    (
        "worker without reminders",
        _set("worker", "command", ["celery", "-A", "tasks", "worker", "-Q", "exports"]),
        "no worker service consumes queue(s) ['reminders']",
    ),
    (
        "worker with the old maintenance queue",
        _set(
            "worker",
            "command",
            ["celery", "-A", "tasks", "worker", "-Q", "exports,reminders,maintenance"],
        ),
        "worker: names undeclared queue(s) ['maintenance']",
    ),
    (
        "beat scheduler replaced",
        _set(
            "beat",
            "command",
            ["celery", "-A", "tasks", "beat", "-S", "celery.beat:PersistentScheduler"],
        ),
        "replaces the app's dispatcher scheduler",
    ),
    (
        "beat scheduler named on the command line",
        _set("beat", "command", ["celery", "-A", "tasks", "beat", f"--scheduler={SCHEDULER}"]),
        "replaces the app's dispatcher scheduler",
    ),
    ("second beat service", _compose_extra_beat, "not exactly one beat"),
    ("embedded beat", _compose_embedded_beat, "not exactly one beat"),
    ("beat one replica", _set("beat", "deploy", {"replicas": 1}), "no hot standby"),
    ("beat replicas unset", _drop("beat", "deploy"), "no hot standby"),
    ("beat scale 1", _set("beat", "scale", 1), "no hot standby"),
    (
        "beat container_name",
        _set("beat", "container_name", "teamdesk-beat"),
        "beat: container_name is fixed",
    ),
    ("flower literal password", _compose_flower_literal_auth, "flower: basic auth"),
    (
        "flower no auth",
        lambda d: d["services"]["flower"].__setitem__("environment", {}),
        "flower: basic auth",
    ),
    ("flower public port", _set("flower", "ports", ["5555:5555"]), "beyond loopback"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [(m, e) for _, m, e in COMPOSE_BREAKS],
    ids=[name for name, _, _ in COMPOSE_BREAKS],
)
def test_compose_checks_catch_a_broken_file(
    compose_doc: dict[str, Any], mutate: Callable[[dict[str, Any]], None], expected: str
) -> None:
    broken = copy.deepcopy(compose_doc)
    mutate(broken)
    problems = compose_problems(broken)
    assert any(expected in p for p in problems), problems


def test_compose_flower_auth_accepts_the_command_line_form(compose_doc: dict[str, Any]) -> None:
    # `--basic-auth=${FLOWER_USER:?..}:${FLOWER_PASSWORD:?..}` is the other accepted form.
    doc = copy.deepcopy(compose_doc)
    flower = doc["services"]["flower"]
    flower["environment"] = {
        k: v for k, v in flower["environment"].items() if k != "FLOWER_BASIC_AUTH"
    }
    flower["command"] = [
        *flower["command"],
        "--basic-auth=${FLOWER_USER:?required}:${FLOWER_PASSWORD:?required}",
    ]
    assert compose_problems(doc) == []


def test_duration_parsing() -> None:
    assert _duration_s("90s") == 90.0
    assert _duration_s("1m30s") == 90.0
    assert _duration_s("500ms") == 0.5
    assert math.isnan(_duration_s("90"))  # a bare number string is not a duration
    assert math.isnan(_duration_s("90 s"))


@cache
def _docker_compose_works() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        result = subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def _docker_compose_config(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLOWER_", "POSTGRES_", "COMPOSE_", "DOCKER_HOST"))
    }
    return subprocess.run(
        ["docker", "compose", "--env-file", str(env_file), "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**clean, **env},
    )


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    if not _docker_compose_works():
        pytest.skip("docker CLI with the compose plugin not available")
    result = _docker_compose_config(
        tmp_path, {"POSTGRES_PASSWORD": "pw", "FLOWER_USER": "u", "FLOWER_PASSWORD": "p"}
    )
    assert result.returncode == 0, result.stderr
    missing = _docker_compose_config(tmp_path, {"POSTGRES_PASSWORD": "pw", "FLOWER_USER": "u"})
    assert missing.returncode != 0
    assert "FLOWER_PASSWORD" in missing.stderr


# --------------------------------------------------------------------------- Kubernetes tests


def test_k8s_manifests_are_present_and_parse(k8s_docs: list[dict[str, Any]]) -> None:
    assert len(list(K8S_DIR.glob("*.yaml"))) >= 5
    assert all("apiVersion" in d and "kind" in d for d in k8s_docs)


def test_k8s_manifests_match_the_kubernetes_schemas(k8s_docs: list[dict[str, Any]]) -> None:
    failures = []
    for doc in k8s_docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert failures == []


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type"])
def test_k8s_schema_check_rejects_an_invalid_manifest(
    k8s_docs: list[dict[str, Any]], breakage: str
) -> None:
    worker = copy.deepcopy(_find(k8s_docs, "Deployment", "teamdesk-worker"))
    assert worker is not None
    if breakage == "unknown field":
        _pod_spec(worker)["terminationGracePeriodSecond"] = 90
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
        doc = _find(docs, kind, name)
        assert doc is not None
        edit(doc)

    return mutate


def _worker_container(
    edit: Callable[[dict[str, Any]], None],
) -> Callable[[list[dict[str, Any]]], None]:
    return _k8s_edit("Deployment", "teamdesk-worker", lambda d: edit(_main_container(d)))


def _set_worker_instance(container: dict[str, Any]) -> None:
    container["env"] = [{"name": "WORKER_INSTANCE_ID", "value": "worker"}]


def _k8s_second_beat(docs: list[dict[str, Any]]) -> None:
    beat = copy.deepcopy(_find(docs, "Deployment", "teamdesk-beat"))
    assert beat is not None
    beat["metadata"]["name"] = "teamdesk-beat-2"
    docs.append(beat)


def _k8s_drain(docs: list[dict[str, Any]]) -> None:
    config = _find(docs, "ConfigMap", "teamdesk-config")
    assert config is not None
    config["data"]["SHUTDOWN_TIMEOUT_S"] = "120"


def _k8s_drop_configmap(docs: list[dict[str, Any]]) -> None:
    config = _find(docs, "ConfigMap", "teamdesk-config")
    assert config is not None
    docs.remove(config)


def _k8s_root(doc: dict[str, Any]) -> None:
    _pod_spec(doc)["securityContext"] = {"runAsUser": 0}


def _k8s_flower_literal(doc: dict[str, Any]) -> None:
    _main_container(doc)["env"] = [{"name": "FLOWER_BASIC_AUTH", "value": "admin:secret"}]


K8S_BREAKS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    (
        "worker grace default",
        _k8s_edit(
            "Deployment",
            "teamdesk-worker",
            lambda d: _pod_spec(d).pop("terminationGracePeriodSeconds"),
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
            lambda d: _main_container(d).__setitem__(
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
        _k8s_edit("Deployment", "teamdesk-api", lambda d: _main_container(d).pop("readinessProbe")),
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
            lambda j: _main_container(j).__setitem__("command", ["teamdesk-tasks"]),
        ),
        "migrate: command",
    ),
    ("no configmap", _k8s_drop_configmap, "manifests missing"),
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
