"""Celery's own operator tools (``celery -A tasks control|inspect|call``) run as
subprocesses against a test's cluster, the way a platform team runs them, and the reads
of a worker's output the tests of those tools share."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

import redis

from harness.processes import ROOT, Proc, celery_argv, settings_env
from tasks.names import TASK_QUEUES
from teamdesk.config import Settings
from tests.support.queues import queue_key

REPLY_TIMEOUT_S = 10  # how long a remote-control command waits for the node's reply


@dataclass(frozen=True)
class ToolRun:
    code: int
    out: str
    err: str


def celery_tool(settings: Settings, *args: str, timeout: float = 60) -> ToolRun:
    """Run ``celery -A tasks <args>`` with the test's configuration; its output."""
    done = subprocess.run(
        celery_argv(*args),
        env=settings_env(settings),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return ToolRun(done.returncode, done.stdout, done.stderr)


def _replied(run: ToolRun, node: str, what: str) -> Any:
    assert run.code == 0, f"{what}: exit {run.code}\n{run.out}\n{run.err[-2000:]}"
    replies = json.loads(run.out)
    if isinstance(replies, list):  # control: [{node: reply}], inspect: {node: reply}
        replies = {k: v for reply in replies for k, v in reply.items()}
    assert node in replies, f"{what}: {node} did not reply: {replies}"
    return replies[node]


def control(settings: Settings, node: str, command: str, *args: str) -> Any:
    """``celery -A tasks control <command> <args> -d <node>``: the node's reply."""
    run = celery_tool(
        settings, "control", command, *args, "-d", node, "-t", str(REPLY_TIMEOUT_S), "-j"
    )
    return _replied(run, node, f"control {command}")


def inspect(settings: Settings, node: str, command: str) -> Any:
    """``celery -A tasks inspect <command> -d <node>``: the node's reply."""
    run = celery_tool(settings, "inspect", command, "-d", node, "-t", str(REPLY_TIMEOUT_S), "-j")
    return _replied(run, node, f"inspect {command}")


def consumed_queues(settings: Settings, node: str) -> set[str]:
    """The task queues ``node`` consumes now (``inspect active_queues``)."""
    return {queue["name"] for queue in inspect(settings, node, "active_queues")}


def call(settings: Settings, task: str, args: str, kwargs: str | None = None) -> str:
    """``celery -A tasks call <task> --args <args> [--kwargs <kwargs>]``: the message id."""
    extra = ["--kwargs", kwargs] if kwargs is not None else []
    run = celery_tool(settings, "call", task, "--args", args, *extra)
    assert run.code == 0, f"celery call: exit {run.code}\n{run.out}\n{run.err[-2000:]}"
    return run.out.strip()


def node_of(worker: Proc) -> str:
    """The worker's Celery node name (``w1@host``), from its worker.started line."""
    return str(worker.wait_event("worker.started", timeout=60)["hostname"])


def records(worker: Proc, since: int = 0) -> list[dict[str, Any]]:
    """The worker's JSON lines, from the ``since``-th on (a line that is not JSON is left
    out here; :func:`not_json` lists those)."""
    found = []
    for line in worker.output().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found[since:]


def not_json(worker: Proc) -> list[str]:
    """The worker's output lines that are not JSON (a process that printed past our logs)."""
    lines = [line for line in worker.output().splitlines() if line.strip()]
    return [line for line in lines if not line.startswith("{")]


def celery_lines(worker: Proc, text: str) -> list[dict[str, Any]]:
    """Celery's own lines (event ``log``) whose message contains ``text``."""
    return [
        line
        for line in records(worker)
        if line.get("event") == "log" and text in str(line.get("message", ""))
    ]


def unacked(client: redis.Redis, prefix: str) -> int:
    """Messages a worker has taken and not acknowledged (kombu's ``unacked`` hash)."""
    return int(client.hlen(f"{prefix}:unacked"))


def queue_length(client: redis.Redis, prefix: str, queue: str) -> int:
    return int(client.llen(queue_key(prefix, queue)))


def held_messages(client: redis.Redis, prefix: str) -> int:
    """Task messages the broker still holds: waiting in either queue, or unacknowledged."""
    waiting = sum(queue_length(client, prefix, queue) for queue in TASK_QUEUES)
    return waiting + unacked(client, prefix)
