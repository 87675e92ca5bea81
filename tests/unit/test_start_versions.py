"""Each process's start line says the running version (teamdesk/version.py): the worker's
``worker.started`` and beat's first ``dispatcher.leader`` (``leader`` or ``standby``,
whichever it is), as JSON lines through the real formatter. The API has no start line of
its own; ``GET /api/health`` says its version (tests/integration/test_api_health.py)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from dispatcher.leader import Leadership
from teamdesk.logs import setup_logging
from teamdesk.version import version
from worker import lifecycle


@pytest.fixture
def capture() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def events(stream: io.StringIO, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    return [line for line in lines if line["event"] == name]


def test_worker_started_says_the_version(capture: io.StringIO) -> None:
    setup_logging("worker", "info", capture)
    sender = SimpleNamespace(
        hostname="w1@host",
        controller=SimpleNamespace(pool_cls="celery.concurrency.prefork:TaskPool", concurrency=2),
        app=SimpleNamespace(
            amqp=SimpleNamespace(queues=SimpleNamespace(consume_from={"exports": None}))
        ),
    )
    lifecycle._on_ready(sender)
    (line,) = events(capture, "worker.started")
    assert line["version"] == version()
    assert (line["hostname"], line["concurrency"], line["queues"]) == ("w1@host", 2, ["exports"])


class _Lock:
    def __init__(self, free: bool) -> None:
        self.free = free

    def acquire(self, blocking: bool = True) -> bool:
        return self.free

    def reacquire(self) -> None:
        pass


class _Redis:
    def __init__(self, free: bool) -> None:
        self.free = free

    def lock(self, key: str, timeout: int, thread_local: bool) -> _Lock:
        return _Lock(self.free)


@pytest.mark.parametrize(("free", "role"), [(True, "leader"), (False, "standby")])
def test_beats_first_line_says_the_version_whichever_role(
    capture: io.StringIO, free: bool, role: str
) -> None:
    setup_logging("beat", "info", capture)
    leadership = Leadership(_Redis(free), "t:dispatcher:leader", 15)  # type: ignore[arg-type]
    assert leadership.ensure() is free
    assert leadership.ensure() is free  # extending or still standing by: no new line
    (line,) = events(capture, "dispatcher.leader")
    assert (line["role"], line["ttl_s"], line["version"]) == (role, 15, version())
