"""What the deploy/ checks share (tests/unit/test_deploy_*.py): where the files are, the
numbers the compose file and the Kubernetes manifests are both held to, readers of
the exec-form commands they run (celery flags, the queues a worker consumes, beat's
scheduler), of the Kubernetes documents (workloads, their pods and containers), of the
URLs in both (their user and password, a Compose default) and who may hold which
credential."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tasks.names import TASK_QUEUES as DECLARED_QUEUES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
K8S_DIR = DEPLOY / "k8s"

DRAIN_S = 75.0  # SHUTDOWN_TIMEOUT_S default
WORKER_GRACE_S = 90.0  # the orchestrator's grace the drain is sized for
HEALTH_HARD_CAP_S = 4.0  # `teamdesk-tasks health` hard cap
BEAT_REPLICAS = 2  # the leader and a hot standby (deploy/operations.md, "The dispatcher (beat)")

HEALTH_CMD = ["teamdesk-tasks", "health"]
SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash", "dash", "/bin/dash"}
# The task queues (exports, reminders): the dispatcher publishes nothing to a queue no live
# worker consumes, so each needs a consumer somewhere in the deployment; and a worker
# naming any other queue (the old `maintenance`) fails at start.
TASK_QUEUES = frozenset(DECLARED_QUEUES)

# Who gets which credential (deploy/security.md, "Who gets which secret"): the variables
# holding one, and each component's share of them. Only migrate has the schema owner's
# DATABASE_URL and the roles' passwords; the API connects as API_ROLE, the workers and
# beat as APP_ROLE; Flower has no database URL at all. Each component's REDIS_URL (and a
# Redis BROKER_URL) logs in as its own Redis user.
APP_ROLE = "teamdesk_app"
API_ROLE = "teamdesk_api"
COMPONENTS = ("migrate", "api", "worker", "beat", "flower")
DATABASE_ROLE = {"api": API_ROLE, "worker": APP_ROLE, "beat": APP_ROLE}
REDIS_USER = {c: f"teamdesk-{c}" for c in ("api", "worker", "beat", "flower")}
# The secrets a Compose service may interpolate: its own (another's is a leak).
OWN_SECRETS: dict[str, frozenset[str]] = {
    "migrate": frozenset({"POSTGRES_PASSWORD", "APP_DB_PASSWORD", "API_DB_PASSWORD"}),
    "api": frozenset({"API_DB_PASSWORD", "REDIS_API_PASSWORD"}),
    "worker": frozenset({"APP_DB_PASSWORD", "REDIS_WORKER_PASSWORD"}),
    "beat": frozenset({"APP_DB_PASSWORD", "REDIS_BEAT_PASSWORD"}),
    "flower": frozenset({"REDIS_FLOWER_PASSWORD", "FLOWER_USER", "FLOWER_PASSWORD"}),
}
SECRET_VARS = frozenset().union(*OWN_SECRETS.values()) | {"REDIS_PASSWORD"}
CREDENTIAL_VARS = frozenset(
    {
        "DATABASE_URL",
        "APP_DB_PASSWORD",
        "API_DB_PASSWORD",
        "REDIS_URL",
        "BROKER_URL",
        "DISPATCH_LISTEN_URL",
        "FLOWER_USER",
        "FLOWER_PASSWORD",
        "FLOWER_BASIC_AUTH",
        "POSTGRES_PASSWORD",
        "REDIS_PASSWORD",
        "REDIS_API_PASSWORD",
        "REDIS_WORKER_PASSWORD",
        "REDIS_BEAT_PASSWORD",
        "REDIS_FLOWER_PASSWORD",
        "OWNER_DATABASE_URL",
        "API_DATABASE_URL",
    }
)
NEEDS: dict[str, frozenset[str]] = {
    "migrate": frozenset({"DATABASE_URL", "APP_DB_PASSWORD", "API_DB_PASSWORD"}),
    "api": frozenset({"DATABASE_URL", "REDIS_URL"}),
    "worker": frozenset({"DATABASE_URL", "REDIS_URL", "BROKER_URL"}),
    "beat": frozenset({"DATABASE_URL", "REDIS_URL", "BROKER_URL", "DISPATCH_LISTEN_URL"}),
    "flower": frozenset({"REDIS_URL", "BROKER_URL", "FLOWER_USER", "FLOWER_PASSWORD"}),
}


def env_map(environment: Any) -> dict[str, Any]:
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


def url_credentials(url: str) -> tuple[str | None, str | None]:
    """The user and password of a URL (None when absent); a Compose interpolation inside
    the password stays as written (``${REDIS_PASSWORD}``)."""
    parts = urlsplit(url)
    return parts.username, parts.password


def compose_default(value: Any) -> str:
    """What a ``${VAR:-default}`` interpolation gives when no variable is set: its default,
    itself resolved when it is another such interpolation (``${A:-${B:-x}}`` gives ``x``);
    other ``${...}`` inside it stay as written. A value that is no interpolation is
    returned as it is."""
    text = str(value)
    while (match := re.match(r"\$\{[A-Z0-9_]+:?-", text)) and text.endswith("}"):
        text = text[match.end() : -1]
    return text


def migrate_app_role(command: list[str]) -> str | None:
    """The role a ``teamdesk-tasks migrate --app-role NAME`` command sets up."""
    return flag_value(command, "--app-role")


def migrate_api_role(command: list[str]) -> str | None:
    """The role a ``teamdesk-tasks migrate --api-role NAME`` command sets up."""
    return flag_value(command, "--api-role")


# --------------------------------------------------------------------------- Kubernetes


def k8s_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    for doc in docs:
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name:
            return doc
    return None


def of_kind(docs: list[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") in kinds]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod_spec(workload).get("containers", [])


def main_container(workload: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod_spec(workload)["containers"][0]
    return container


def argv(container: dict[str, Any]) -> list[str]:
    return [*(container.get("command") or []), *(container.get("args") or [])]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) picks ``labels``;
    the empty selector picks everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not held:
            return False
    return True


def default_of(value: Any) -> float | None:
    """The number in a "${VAR:-75}" interpolation (or a plain number), else None."""
    match = re.fullmatch(r"\$\{[A-Z0-9_]+:?-([0-9.]+)\}|([0-9.]+)", str(value).strip())
    if not match:
        return None
    return float(match.group(1) or match.group(2))


def is_exec_form(command: Any) -> bool:
    """A list of strings that does not start a shell wrapper (`sh -c ...`)."""
    if not isinstance(command, list) or not command:
        return False
    if not all(isinstance(part, str) for part in command):
        return False
    return command[0] not in SHELLS


def runs_celery(command: Any, sub: str) -> bool:
    """Whether an exec-form command is `celery ... <sub> ...` (worker, beat, flower)."""
    if not isinstance(command, list) or not command:
        return False
    return command[0] == "celery" and sub in command


def flag_value(command: list[str], *flags: str) -> str | None:
    for i, part in enumerate(command):
        for flag in flags:
            if part == flag and i + 1 < len(command):
                return command[i + 1]
            if part.startswith(flag + "="):
                return part.split("=", 1)[1]
    return None


def runs_embedded_beat(command: list[str]) -> bool:
    return "-B" in command or "--beat" in command


def consumed_queues(command: list[str]) -> set[str]:
    """The queues a `celery worker` command consumes: its -Q list, or every declared
    queue when it has none (Celery's default with `task_queues` set)."""
    value = flag_value(command, "-Q", "--queues")
    if value is None:
        return set(TASK_QUEUES)
    return {q.strip() for q in value.split(",") if q.strip()}


def unconsumed_queues(worker_commands: list[list[str]]) -> list[str]:
    consumed: set[str] = set()
    for command in worker_commands:
        consumed |= consumed_queues(command)
    return sorted(TASK_QUEUES - consumed)


def unknown_queues(command: list[str]) -> list[str]:
    """Queues in a worker's -Q that the app does not declare: Celery refuses to start."""
    return sorted(consumed_queues(command) - TASK_QUEUES)


def beat_scheduler_problem(where: str, command: list[str]) -> str | None:
    """The app sets beat's scheduler to the dispatcher; `-S`/`--scheduler` on the command
    line would replace it (nothing dispatched), and even naming the dispatcher there is a
    copy that goes stale when the app's choice changes."""
    scheduler = flag_value(command, "-S", "--scheduler")
    if scheduler is not None:
        return f"{where}: --scheduler {scheduler} replaces the app's dispatcher scheduler"
    return None
