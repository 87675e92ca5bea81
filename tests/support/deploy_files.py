"""What the deploy/ checks share (tests/unit/test_deploy_*.py): where the files are, the
numbers the compose file and the Kubernetes manifests are both held to, and readers of
the exec-form commands they run (celery flags, the queues a worker consumes, beat's
scheduler)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tasks.names import TASK_QUEUES as DECLARED_QUEUES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"

DRAIN_S = 75.0  # SHUTDOWN_TIMEOUT_S default
WORKER_GRACE_S = 90.0  # the orchestrator's grace the drain is sized for
HEALTH_HARD_CAP_S = 4.0  # `teamdesk-tasks health` hard cap
BEAT_REPLICAS = 2  # the leader and a hot standby (deploy/README.md, "The dispatcher")

HEALTH_CMD = ["teamdesk-tasks", "health"]
SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash", "dash", "/bin/dash"}
# The task queues (exports, reminders): the dispatcher publishes nothing to a queue no live
# worker consumes, so each needs a consumer somewhere in the deployment; and a worker
# naming any other queue (the old `maintenance`) fails at start.
TASK_QUEUES = frozenset(DECLARED_QUEUES)


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
