"""Fixtures shared by several integration test files: the in-process API client and
tokens (test_api_*.py), a registered worker window for the dispatcher scans
(test_dispatch_{window,stamping,recovery}.py), and the in-process ``teamdesk-tasks``
runner (test_cli_*.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient

from cli.main import main
from harness.factories import World
from teamdesk import logs
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat, WorkerSlots
from tests.support.api_helpers import api_client, make_tokens
from tests.support.cli_runner import Result

# --- the HTTP API (test_api_*.py) ----------------------------------------------------------


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with api_client(settings) as test_client:
        yield test_client


@pytest.fixture
def tokens(engine: sa.Engine, world: World) -> dict[str, str]:
    return make_tokens(engine, world)


# --- the dispatcher's scans (test_dispatch_{window,stamping,recovery}.py) ------------------


@pytest.fixture
def offer(
    redis_client: redis.Redis, queue_prefix: str, settings: Settings
) -> Iterator[Callable[..., Heartbeat]]:
    """Register a live worker process offering ``concurrency`` slots on ``queues``."""
    members: list[Heartbeat] = []

    def register(
        concurrency: int = 10, queues: tuple[str, ...] = ("exports", "reminders")
    ) -> Heartbeat:
        member = Heartbeat(
            redis_client,
            queue_prefix,
            "test-host",
            settings.heartbeat_ttl_s,
            WorkerSlots(queues, concurrency),
        )
        assert member.renew()
        members.append(member)
        return member

    yield register
    for member in members:
        member.remove()


# --- the command line (test_cli_*.py) -------------------------------------------------------


@pytest.fixture
def drop_cli_log_handler() -> Iterator[None]:
    """main() installs the JSON log handler on capsys's stream; remove it afterwards.
    Every test_cli_*.py module uses it for all its tests (``pytestmark``)."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logs._JsonHandler):
            root.removeHandler(handler)


@pytest.fixture
def cli(settings: Settings, capsys: pytest.CaptureFixture[str]) -> Any:
    def run(*args: str) -> Result:
        capsys.readouterr()
        code = main(list(args))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run
