"""Remote gates kept on a Redis the test does not fault (see remote_gates.py).

For tests that restart or squeeze the worker's ``REDIS_URL``: a gate parked on that
server would fail with it. A worker started with
``TEAMDESK_TEST_HOOKS=tests.support.steady_gates``, ``TEAMDESK_STEADY_GATES=<points>``
and ``TEAMDESK_STEADY_GATE_REDIS_URL=<url>`` parks at those points on that other Redis,
with the same keys, so the test drives it with :class:`~harness.remote_gates.RemoteGate`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from harness.remote_gates import TIMEOUT_ENV, _describe, open_key, reached_key
from teamdesk import hooks

POINTS_ENV = "TEAMDESK_STEADY_GATES"
URL_ENV = "TEAMDESK_STEADY_GATE_REDIS_URL"


def _install_from_env() -> None:
    points = [p for p in os.environ.get(POINTS_ENV, "").split(",") if p]
    prefix = os.environ.get("QUEUE_PREFIX", "teamdesk")
    url = os.environ.get(URL_ENV, "redis://127.0.0.1:6379/0")
    timeout = float(os.environ.get(TIMEOUT_ENV, "60"))
    for point in points:

        def park(point: str = point, **context: Any) -> None:
            client = redis.Redis.from_url(url)
            try:
                client.rpush(reached_key(prefix, point), _describe(context))
                deadline = time.monotonic() + timeout  # detects a gate never released
                while client.blpop([open_key(prefix, point)], timeout=0.1) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"steady gate {point} was never released")
            finally:
                client.close()

        hooks.install(point, park)


def worker_env(points: str, gate_redis_url: str, timeout_s: float) -> dict[str, str]:
    """The environment that makes a worker subprocess park at ``points`` (comma-separated)
    on ``gate_redis_url``; a gate not released within ``timeout_s`` fails the worker's task."""
    return {
        "TEAMDESK_TEST_HOOKS": __name__,
        POINTS_ENV: points,
        URL_ENV: gate_redis_url,
        TIMEOUT_ENV: str(timeout_s),
    }


_install_from_env()
