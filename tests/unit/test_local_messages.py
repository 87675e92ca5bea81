"""run-local's fixed messages: the stop message names the workers' drain budget
(SHUTDOWN_TIMEOUT_S), and the Redis hint names REDIS_URL and the port it points at."""

from __future__ import annotations

import signal

import pytest

from cli import localrun
from teamdesk.config import load_settings


def test_the_stop_message_says_the_drain_budget_not_the_kill_deadline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    manager = localrun.cluster_manager(load_settings({}))
    assert (manager.drain_s, manager.stop_grace_s) == (75.0, 75.0 + localrun.KILL_GRACE_S)
    manager._on_signal(signal.SIGINT, None)
    out = capsys.readouterr().out
    assert (
        "SIGINT received: stopping (one SIGTERM each; workers finish running tasks, "
        "up to 75 s). Send it again to kill them now." in out
    )
    assert "90 s" not in out


def test_the_stop_message_follows_shutdown_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    manager = localrun.cluster_manager(load_settings({"SHUTDOWN_TIMEOUT_S": "30"}))
    manager._on_signal(signal.SIGTERM, None)
    assert "workers finish running tasks, up to 30 s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis://127.0.0.1:6390/0",
            "cannot reach Redis (ConnectionError) on port 6390 (from REDIS_URL); check "
            "REDIS_URL and start it, e.g.: redis-server --daemonize yes --bind 127.0.0.1 -::1 "
            "--port 6390 --save '' --appendonly no",
        ),
        (
            "redis://localhost/0",
            "cannot reach Redis (ConnectionError) on port 6379 (from REDIS_URL); check "
            "REDIS_URL and start it, e.g.: redis-server --daemonize yes --bind 127.0.0.1 -::1 "
            "--port 6379 --save '' --appendonly no",
        ),
        (
            "rediss://:s3cret@cache.internal:7000/0",
            "cannot reach Redis (ConnectionError) on port 7000 (from REDIS_URL); check "
            "REDIS_URL and that Redis is running there",
        ),
        (
            "unix:///run/redis.sock",
            "cannot reach Redis (ConnectionError) at the socket REDIS_URL names; check REDIS_URL",
        ),
    ],
)
def test_the_redis_hint_names_the_variable_and_the_urls_port(url: str, expected: str) -> None:
    assert localrun.redis_hint(url, "ConnectionError") == expected
