"""Celery's operator tools the purge, consumer and reconnect tests use, on top of
tests/support/operator_commands.py (which runs ``celery -A tasks ...`` with a test's
configuration): ``celery purge``, ``celery control cancel_consumer|add_consumer``, and a
throwaway RabbitMQ virtual host for a test's broker."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from teamdesk.config import Settings
from tests.support.operator_commands import celery_tool, control


def purge(settings: Settings, queue: str) -> str:
    """``celery -A tasks purge -f -Q <queue>``; its output ("Purged N messages ...")."""
    run = celery_tool(settings, "purge", "-f", "-Q", queue)
    assert run.code == 0, f"celery purge: exit {run.code}\n{run.out}\n{run.err[-2000:]}"
    return run.out


def consumer(settings: Settings, node: str, action: str, queue: str) -> str:
    """``celery -A tasks control add_consumer|cancel_consumer <queue> -d <node>``: the
    node's confirmation (it acted on the command before replying)."""
    reply = control(settings, node, action, queue)
    assert isinstance(reply, dict) and "ok" in reply, f"{node}: {action} {queue}: {reply}"
    return str(reply["ok"])


def rabbitmqctl(*args: str) -> str:
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], check=True, capture_output=True, text=True, timeout=60
    )
    return done.stdout


@contextmanager
def rabbit_vhost(name: str) -> Iterator[str]:
    """A throwaway RabbitMQ virtual host ``name`` (name it like the test's QUEUE_PREFIX,
    as the configuration requires): the test's queues and exchanges vanish with it."""
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


def rabbit_queue_counts(vhost: str, queue: str) -> dict[str, int]:
    """``queue``'s messages ready, unacknowledged, and its consumers (rabbitmqctl)."""
    fields = ("messages_ready", "messages_unacknowledged", "consumers")
    out = rabbitmqctl("list_queues", "-p", vhost, "--no-table-headers", "name", *fields)
    for line in out.splitlines():
        name, *values = line.split()
        if name == queue:
            return dict(zip(("ready", "unacked", "consumers"), map(int, values), strict=True))
    raise AssertionError(f"no queue {queue} in vhost {vhost}:\n{out}")
