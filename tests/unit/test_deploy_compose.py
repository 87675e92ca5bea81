"""deploy/compose.yaml's operational points, checked offline on the parsed file.

``compose_problems`` checks one beat service with a hot standby and no ``-S`` replacing
the dispatcher (and why bare ``celery beat`` runs it), every task queue consumed by some
worker and no worker naming another queue, the 90 s grace above the 75 s drain, health
checks, log rotation through one YAML anchor, the migrate one-shot, Flower auth from
the environment, and the metrics of api, worker and beat on the compose network only
(METRICS_PORT and METRICS_HOST set, the port not published, no host network); every
check is shown to fail on a copy of the file broken in exactly that point. Validation
against the Compose schema: test_deploy_compose_schema.py.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from typing import Any

import pytest

from dispatcher.beat_host import SCHEDULER, beat_config
from teamdesk.config import Settings
from tests.support.deploy_files import (
    BEAT_REPLICAS,
    COMPOSE_FILE,
    DRAIN_S,
    HEALTH_CMD,
    HEALTH_HARD_CAP_S,
    WORKER_GRACE_S,
    beat_scheduler_problem,
    default_of,
    env_map,
    flag_value,
    is_exec_form,
    migrate_app_role,
    runs_celery,
    runs_embedded_beat,
    unconsumed_queues,
    unknown_queues,
)

TEAMDESK_SERVICES = ("migrate", "api", "worker", "beat", "flower")
METRICS_SERVICES = ("api", "worker", "beat")  # docs/observability.md, "Metrics"
COMPOSE_SERVICES = ("postgres", "redis", *TEAMDESK_SERVICES)
EXPECTED_LOGGING = {"driver": "json-file", "options": {"max-size": "10m", "max-file": "3"}}
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


def _target_port(published: Any) -> int | None:
    """The container port of a `ports:` entry ("127.0.0.1:8000:8000", "9101", long form)."""
    if isinstance(published, dict):
        target = published.get("target")
    else:
        target = str(published).split("/")[0].rsplit(":", 1)[-1]
    try:
        return int(str(target))
    except ValueError:
        return None


def metrics_problems(name: str, svc: dict[str, Any]) -> list[str]:
    """/metrics on for the service, reachable on the compose network and nowhere else."""
    env = env_map(svc.get("environment"))
    port = default_of(env.get("METRICS_PORT", 0))
    if not port:
        return [f"{name}: no METRICS_PORT, its metrics are off"]
    problems = []
    if not env.get("METRICS_HOST"):
        problems.append(f"{name}: METRICS_HOST unset, the metrics are on the container's loopback")
    for published in svc.get("ports") or []:
        if _target_port(published) == int(port):
            problems.append(f"{name}: metrics port {int(port)} published")
    if svc.get("network_mode") == "host":
        problems.append(f"{name}: network_mode host puts the metrics on the host's interfaces")
    own = flag_value(svc.get("command") or [], "--port")
    if own is not None and default_of(own) == port:
        problems.append(f"{name}: metrics on the API's own port")
    return problems


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
        if not is_exec_form(command):
            problems.append(f"{name}: command is not exec form: {command!r}")
        if "entrypoint" in services[name]:
            problems.append(f"{name}: overrides the image entrypoint")
        if "build" not in services[name] and "image" not in services[name]:
            problems.append(f"{name}: no image")

    migrate = services["migrate"]
    mcmd = migrate.get("command") or []
    if mcmd[:2] != ["teamdesk-tasks", "migrate"] or not migrate_app_role(mcmd):
        problems.append("migrate: command is not teamdesk-tasks migrate --app-role NAME")
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
    if not (runs_celery(wcmd, "worker") and flag_value(wcmd, "-A", "--app") == "tasks"):
        problems.append("worker: command is not celery -A tasks worker")
    if not flag_value(wcmd, "-Q", "--queues"):
        problems.append("worker: no -Q queue list")
    worker_commands = [
        s["command"]
        for s in services.values()
        if runs_celery(s.get("command"), "worker") and isinstance(s.get("command"), list)
    ]
    if unconsumed := unconsumed_queues(worker_commands):
        problems.append(f"no worker service consumes queue(s) {unconsumed}")
    for name, svc in services.items():
        command = svc.get("command")
        if runs_celery(command, "worker") and (unknown := unknown_queues(command)):
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
    env = env_map(worker.get("environment"))
    if "WORKER_INSTANCE_ID" in env:
        problems.append("worker: WORKER_INSTANCE_ID set for every replica (must be unique)")
    for key in ("hostname", "container_name"):
        if key in worker:
            problems.append(f"worker: {key} is fixed, replicas would share one heartbeat scope")
    drain = default_of(env.get("SHUTDOWN_TIMEOUT_S", DRAIN_S))
    if drain is None or not drain < grace:
        problems.append(
            f"worker: SHUTDOWN_TIMEOUT_S {env.get('SHUTDOWN_TIMEOUT_S')!r} "
            "is not below the stop grace period"
        )

    beats = [
        n
        for n, s in services.items()
        if runs_celery(s.get("command"), "beat")
        or (isinstance(s.get("command"), list) and runs_embedded_beat(s["command"]))
    ]
    if beats != ["beat"]:
        problems.append(f"not exactly one beat: {beats}")
    beat = services["beat"]
    replicas = beat.get("scale", (beat.get("deploy") or {}).get("replicas", 1))
    if replicas < BEAT_REPLICAS:
        problems.append(f"beat: {replicas} replica(s), no hot standby")
    if "container_name" in beat:
        problems.append("beat: container_name is fixed, a second replica cannot start")
    if scheduler_problem := beat_scheduler_problem("beat", beat.get("command") or []):
        problems.append(scheduler_problem)

    flower = services["flower"]
    fcmd = flower.get("command") or []
    if not runs_celery(fcmd, "flower"):
        problems.append("flower: command is not celery ... flower")
    auth_env = env_map(flower.get("environment")).get("FLOWER_BASIC_AUTH")
    auth_arg = flag_value(fcmd, "--basic-auth", "--basic_auth") if fcmd else None
    if not any(FLOWER_AUTH_RE.match(str(v)) for v in (auth_env, auth_arg) if v):
        problems.append("flower: basic auth is not ${FLOWER_USER:?}:${FLOWER_PASSWORD:?}")
    for port in flower.get("ports") or []:
        if not str(port).startswith("127.0.0.1:"):
            problems.append(f"flower: port {port} published beyond loopback")

    for name in METRICS_SERVICES:
        problems.extend(metrics_problems(name, services[name]))
    return problems


# --------------------------------------------------------------------------- beat


def test_plain_celery_beat_runs_the_dispatcher() -> None:
    # Why every beat command is bare `celery -A tasks beat`: the app itself sets the
    # dispatcher as beat's scheduler, and beat schedules no Celery task.
    config = beat_config(Settings())
    assert config["beat_scheduler"] == SCHEDULER
    assert config["beat_schedule"] == {}


# --------------------------------------------------------------------------- compose tests


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


def _drop_env(name: str, var: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        env = dict(doc["services"][name].get("environment") or {})
        del env[var]
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
    (
        "migrate without the app role",
        _set("migrate", "command", ["teamdesk-tasks", "migrate"]),
        "migrate: command",
    ),
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
    (
        "worker metrics published",
        _set("worker", "ports", ["9101:9101"]),
        "worker: metrics port 9101 published",
    ),
    (
        "api metrics published on loopback",
        _set("api", "ports", ["127.0.0.1:8000:8000", {"target": 9103, "published": 9103}]),
        "api: metrics port 9103 published",
    ),
    ("beat metrics off", _drop_env("beat", "METRICS_PORT"), "beat: no METRICS_PORT"),
    ("worker metrics port 0", _set_env("worker", "METRICS_PORT", "0"), "worker: no METRICS_PORT"),
    (
        "worker metrics on loopback only",
        _drop_env("worker", "METRICS_HOST"),
        "worker: METRICS_HOST unset",
    ),
    ("api metrics on the API's port", _set_env("api", "METRICS_PORT", "8000"), "API's own port"),
    ("beat on the host network", _set("beat", "network_mode", "host"), "beat: network_mode host"),
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


def test_target_port_parsing() -> None:
    assert _target_port("127.0.0.1:${API_PORT:-8000}:8000") == 8000
    assert _target_port("9101") == 9101
    assert _target_port("9101:9101/tcp") == 9101
    assert _target_port({"target": 9103, "published": "9103"}) == 9103
    assert _target_port("9000-9001:9000-9001") is None


def test_duration_parsing() -> None:
    assert _duration_s("90s") == 90.0
    assert _duration_s("1m30s") == 90.0
    assert _duration_s("500ms") == 0.5
    assert math.isnan(_duration_s("90"))  # a bare number string is not a duration
    assert math.isnan(_duration_s("90 s"))
