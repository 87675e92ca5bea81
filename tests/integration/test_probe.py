"""``teamdesk-tasks health`` as a real subprocess against real Redis and PostgreSQL."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from teamdesk.heartbeat import Heartbeat
from tests.conftest import REDIS_URL
from tests.support.redis_server import dedicated_redis, free_port

CLI = str(Path(sys.executable).parent / "teamdesk-tasks")
SCOPE = "probe-host"
TTL_S = 20.0
BOUND_S = 2.0  # docs/design.md, "Heartbeats": the whole check
RUN_TIMEOUT_S = 15.0  # only detects a probe that never ends


@dataclass
class ProbeRun:
    code: int
    fields: dict[str, Any]
    stdout: str
    stderr: str
    elapsed_s: float


def probe_env(database_url: str, redis_url: str, prefix: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BROKER_URL", "WORKER_INSTANCE_ID")}
    env.update(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        QUEUE_PREFIX=prefix,
        HEARTBEAT_TTL_S=str(TTL_S),
        LOG_LEVEL="info",
    )
    return env


def startup_s() -> float:
    """What starting the probe's interpreter and its imports costs on this machine now,
    measured as the probe starts (the same executable, the same modules, nothing checked):
    the bound is the probe's own, and a busy machine (a parallel test run) must not make a
    slow interpreter start look like a slow check."""
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import cli.main, teamdesk.config, worker.probe"],
        check=True,
        timeout=RUN_TIMEOUT_S,
    )
    return time.monotonic() - started


def within_bound(result: ProbeRun, bound_s: float = BOUND_S) -> bool:
    """The probe's check ended within ``bound_s`` of its start (its wall time less what
    starting an interpreter with its imports costs now)."""
    return result.elapsed_s - startup_s() < bound_s


def run(args: list[str], env: dict[str, str]) -> ProbeRun:
    started = time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    elapsed = time.monotonic() - started
    lines = done.stdout.splitlines()
    assert len(lines) == 1, f"expected one JSON line, got {done.stdout!r}"
    return ProbeRun(done.returncode, json.loads(lines[0]), done.stdout, done.stderr, elapsed)


def run_probe(env: dict[str, str], scope: str = SCOPE) -> ProbeRun:
    return run([CLI, "health", "--scope", scope], env)


def expected(worker: bool, redis_ok: bool, database: bool) -> dict[str, Any]:
    return {"worker": worker, "redis": redis_ok, "database": database, "scope": SCOPE}


def register(client: redis.Redis, prefix: str, scope: str = SCOPE) -> Heartbeat:
    beat = Heartbeat(client, prefix, scope, TTL_S)
    assert beat.renew() is True
    return beat


def test_probe_passes_with_a_live_member(
    redis_client: redis.Redis, queue_prefix: str, database_url: str
) -> None:
    register(redis_client, queue_prefix)

    result = run_probe(probe_env(database_url, REDIS_URL, queue_prefix))

    assert result.fields == expected(worker=True, redis_ok=True, database=True)
    assert result.code == 0
    assert result.stderr == ""
    assert within_bound(result)


def test_probe_fails_without_a_member_of_its_scope(
    redis_client: redis.Redis, queue_prefix: str, database_url: str
) -> None:
    register(redis_client, queue_prefix, scope="other-host")
    gone = register(redis_client, queue_prefix)
    gone.remove()

    register(redis_client, queue_prefix, scope="local-mixed")

    result = run_probe(probe_env(database_url, REDIS_URL, queue_prefix))

    assert result.fields == expected(worker=False, redis_ok=True, database=True)
    assert result.code == 1
    assert within_bound(result)
    # Not silent: which scope it looked for, and which are live (before: nothing).
    assert result.stderr == (
        f"teamdesk-tasks health: no live worker in scope '{SCOPE}'; live scopes: "
        "local-mixed, other-host (a worker's scope is its WORKER_INSTANCE_ID; check "
        "another with --scope)\n"
    )


def test_probe_fails_when_postgresql_is_unreachable_and_hides_the_address(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    register(redis_client, queue_prefix)
    port = free_port()  # nothing listens there
    database_url = f"postgresql://postgres:s3cret@127.0.0.1:{port}/teamdesk"

    result = run_probe(probe_env(database_url, REDIS_URL, queue_prefix))

    assert result.fields == expected(worker=True, redis_ok=True, database=False)
    assert result.code == 1
    assert within_bound(result)
    assert result.stderr == "teamdesk-tasks health: PostgreSQL did not answer (DATABASE_URL)\n"
    output = result.stdout + result.stderr
    assert "s3cret" not in output
    assert str(port) not in output
    assert "127.0.0.1" not in output


@pytest.mark.alone  # it waits out most of the 2 s bound: a busy machine's delay is the margin
def test_probe_fails_within_the_bound_when_postgresql_accepts_and_never_answers(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    register(redis_client, queue_prefix)
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
        port = silent.getsockname()[1]
        database_url = f"postgresql://postgres:s3cret@127.0.0.1:{port}/teamdesk"
        result = run_probe(probe_env(database_url, REDIS_URL, queue_prefix))
    finally:
        silent.close()

    assert result.fields == expected(worker=True, redis_ok=True, database=False)
    assert result.code == 1
    assert within_bound(result)
    assert "s3cret" not in result.stdout + result.stderr


@pytest.mark.alone  # it waits out most of the 2 s bound: a busy machine's delay is the margin
def test_probe_fails_within_the_bound_when_redis_is_frozen(
    queue_prefix: str, database_url: str
) -> None:
    with dedicated_redis() as server:
        client = server.client()
        register(client, queue_prefix)
        client.close()
        env = probe_env(database_url, server.url, queue_prefix)
        with server.frozen():
            result = run_probe(env)

    assert result.fields == expected(worker=False, redis_ok=False, database=True)
    assert result.code == 1
    assert within_bound(result, 3.0)  # the Redis check's own bounds, under the watchdog's


WATCHDOG_SCRIPT = """
import sys
from teamdesk.config import load_settings
from worker.probe import health_command
settings = load_settings()
sys.exit(health_command(settings, sys.argv[1], deadline_s=60, timeout_s=60, hard_cap_s=0.5))
"""


@pytest.mark.alone  # it waits out most of the 2 s bound: a busy machine's delay is the margin
def test_hard_cap_ends_a_probe_whose_timeouts_would_let_it_hang(
    queue_prefix: str, database_url: str
) -> None:
    with dedicated_redis() as server:
        client = server.client()
        register(client, queue_prefix)
        client.close()
        env = probe_env(database_url, server.url, queue_prefix)
        with server.frozen():
            result = run([sys.executable, "-c", WATCHDOG_SCRIPT, SCOPE], env)

    assert result.fields == expected(worker=False, redis_ok=False, database=True)
    assert result.code == 1
    assert within_bound(result)


IMPORTS_SCRIPT = """
import json, sys
from cli.main import main
code = main(["health", "--scope", sys.argv[1]])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "kombu", "tasks"))
print(json.dumps({"code": code, "loaded": loaded}), file=sys.stderr)
"""


def test_probe_does_not_load_celery_or_the_broker_client(
    redis_client: redis.Redis, queue_prefix: str, database_url: str
) -> None:
    register(redis_client, queue_prefix)

    result = run(
        [sys.executable, "-c", IMPORTS_SCRIPT, SCOPE],
        probe_env(database_url, REDIS_URL, queue_prefix),
    )

    assert result.fields == expected(worker=True, redis_ok=True, database=True)
    assert json.loads(result.stderr) == {"code": 0, "loaded": []}
    assert within_bound(result)
