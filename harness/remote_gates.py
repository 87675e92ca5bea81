"""Gates across processes, through Redis lists: for real ``celery worker`` subprocesses.

A worker started with ``TEAMDESK_TEST_HOOKS=harness.remote_gates`` and
``TEAMDESK_TEST_GATES=export.after_read,...`` parks every execution reaching one of those
points: it pushes a token to ``<prefix>:gate-reached:<point>`` and blocks on
``<prefix>:gate-open:<point>`` until the test pushes a release token. The wait is bounded
(TEAMDESK_TEST_GATE_TIMEOUT_S, default 60 s) so a forgotten gate cannot hang a worker.
The gates live in REDIS_URL, or in TEAMDESK_TEST_GATE_REDIS_URL where the test fails the
cluster's own Redis over.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from teamdesk import hooks

GATES_ENV = "TEAMDESK_TEST_GATES"
TIMEOUT_ENV = "TEAMDESK_TEST_GATE_TIMEOUT_S"
GATE_REDIS_ENV = "TEAMDESK_TEST_GATE_REDIS_URL"


def reached_key(prefix: str, point: str) -> str:
    return f"{prefix}:gate-reached:{point}"


def open_key(prefix: str, point: str) -> str:
    return f"{prefix}:gate-open:{point}"


def _describe(context: dict[str, Any]) -> str:
    claim = context.get("claim")
    info: dict[str, Any] = {"pid": os.getpid(), "at": time.time()}
    if claim is not None:
        info.update(
            task_id=str(claim.lease.task_id),
            run=claim.lease.run,
            execution_id=str(claim.lease.execution_id),
        )
    for key in ("done", "total", "member"):
        if key in context:
            info[key] = context[key]
    if "refs" in context:  # the dispatcher's publish points
        info["task_ids"] = [str(ref.task_id) for ref in context["refs"]]
    return json.dumps(info)


def _install_from_env() -> None:
    points = [p for p in os.environ.get(GATES_ENV, "").split(",") if p]
    if not points:
        return
    prefix = os.environ.get("QUEUE_PREFIX", "teamdesk")
    url = os.environ.get(GATE_REDIS_ENV) or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    timeout = float(os.environ.get(TIMEOUT_ENV, "60"))

    for point in points:

        def park(point: str = point, **context: Any) -> None:
            client = redis.Redis.from_url(url)
            try:
                client.rpush(reached_key(prefix, point), _describe(context))
                # Short waits in a loop: the process keeps handling signals while parked.
                deadline = time.monotonic() + timeout
                while client.blpop([open_key(prefix, point)], timeout=0.1) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"remote gate {point} was never released")
            finally:
                client.close()

        hooks.install(point, park)


class RemoteGate:
    """The test's side of one gate point."""

    def __init__(self, client: redis.Redis, prefix: str, point: str) -> None:
        self.client, self.prefix, self.point = client, prefix, point

    def wait_reached(self, timeout: float = 30) -> dict[str, Any]:
        # Short waits in a loop: a client's socket timeout may be shorter than ``timeout``.
        deadline = time.monotonic() + timeout
        while True:
            got = self.client.blpop([reached_key(self.prefix, self.point)], timeout=1)
            if got is not None:
                return dict(json.loads(got[1]))
            if time.monotonic() > deadline:
                raise AssertionError(f"remote gate {self.point} was never reached")

    def release(self, times: int = 1) -> None:
        for _ in range(times):
            self.client.rpush(open_key(self.prefix, self.point), "go")


_install_from_env()


def _log_sample_from_env() -> None:
    """TEAMDESK_TEST_LOG_SAMPLE=1: log one line carrying secrets the way careless code
    might (a URL with a password, an Authorization header), to prove the process's real
    log setup redacts them."""
    if not os.environ.get("TEAMDESK_TEST_LOG_SAMPLE"):
        return
    import logging

    logging.getLogger("teamdesk.sample").warning(
        "connecting to %s",
        os.environ.get("DATABASE_URL", ""),
        extra={"headers": {"Authorization": os.environ.get("TEAMDESK_TEST_AUTH_VALUE", "")}},
    )


_log_sample_from_env()


def _crash_from_env() -> None:
    """TEAMDESK_TEST_CRASH=start|stop: add a worker bootstep that raises when the worker
    starts (an unrecoverable error) or while it stops (a failure during the drain)."""
    where = os.environ.get("TEAMDESK_TEST_CRASH")
    if not where:
        return
    from celery import bootsteps, signals

    class Crash(bootsteps.StartStopStep):
        requires = {"celery.worker.components:Timer"}

        def start(self, parent: Any) -> None:
            if where == "start":
                raise RuntimeError("injected start failure")

        def stop(self, parent: Any) -> None:
            if where == "stop":
                raise RuntimeError("injected failure while stopping")

    def add_step(sender: Any = None, instance: Any = None, **_: Any) -> None:
        instance.app.steps["worker"].add(Crash)

    signals.celeryd_init.connect(add_step, weak=False)


_crash_from_env()
