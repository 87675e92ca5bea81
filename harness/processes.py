"""Real cluster processes (``celery -A tasks worker|beat|flower``) for process tests.

Each process gets the test's settings through the configuration variables, writes
its output to a file the test reads, and is always killed (with its process group) when
the test ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from teamdesk.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def end_process(process: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL when it has not exited within ``timeout``; reaped either way."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)


def settings_env(settings: Settings, **extra: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEAMDESK_", "CELERY_"))}
    env.update(
        {
            "DATABASE_URL": settings.database_url,
            "REDIS_URL": settings.redis_url,
            "BROKER_URL": settings.broker_url,
            "QUEUE_PREFIX": settings.queue_prefix,
            "LOG_LEVEL": settings.log_level,
            "WORKER_INSTANCE_ID": settings.worker_instance_id,
            "MAX_TASK_ATTEMPTS": str(settings.max_task_attempts),
            "RETRY_BASE_DELAY_S": str(settings.retry_base_delay_s),
            "STALE_AFTER_S": str(settings.stale_after_s),
            "SCAN_INTERVAL_S": str(settings.scan_interval_s),
            "HEARTBEAT_TTL_S": str(settings.heartbeat_ttl_s),
            "MAX_RECOVERIES": str(settings.max_recoveries),
            "EXPORT_MAX_ROWS": str(settings.export_max_rows),
            "EXPORT_BATCH_SIZE": str(settings.export_batch_size),
            "SHUTDOWN_TIMEOUT_S": str(settings.shutdown_timeout_s),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if settings.redis_sentinel_master:
        env["REDIS_SENTINEL_MASTER"] = settings.redis_sentinel_master
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Proc:
    """One subprocess with its output in a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        out = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def lines(self) -> list[dict[str, Any]]:
        """Every output line parsed as JSON (raises on a line that is not JSON)."""
        return [json.loads(line) for line in self.output().splitlines() if line.strip()]

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.output().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == name:
                found.append(record)
        return found

    def wait_event(self, name: str, timeout: float = 30, count: int = 1) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(name)
            if len(found) >= count:
                return found[count - 1]
            if self.popen is not None and self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited ({self.popen.returncode}) before "
                    f"{name}:\n{self.output()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name}: no {name} within {timeout} s:\n{self.output()[-3000:]}"
                )
            time.sleep(0.05)

    def send(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tasks", *args]


def worker_argv(
    name: str,
    *,
    queues: str = "exports,reminders",
    concurrency: int = 2,
    pool: str = "prefork",
) -> list[str]:
    return celery_argv(
        "worker",
        "-n",
        f"{name}@%h",
        "-Q",
        queues,
        "-c",
        str(concurrency),
        "--pool",
        pool,
        "--without-mingle",
        "--without-gossip",
    )


@contextmanager
def cluster(log_dir: Path) -> Iterator[list[Proc]]:
    """Collects the processes a test starts and kills what is left when it ends."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
