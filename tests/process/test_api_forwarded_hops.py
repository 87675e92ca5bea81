"""``teamdesk-tasks api`` (the real uvicorn server) behind a proxy, issue "Security, round
four", finding 7: ``FORWARDED_ALLOW_IPS=0.0.0.0/0,::/0`` is refused at start like ``*``
(before, it started and behaved like ``*``); and with the proxy trusted, a hop that is not
an address in front of the trusted hop the proxy appended never becomes the client (before,
uvicorn made ``evil-1`` the client, so every invented name had a budget of its own). The
rest of the proxy behaviour: test_api_behind_proxy.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from harness.factories import World
from harness.processes import Proc, cluster, free_port, settings_env
from harness.waiting import wait_for
from teamdesk.config import Settings
from tests.process.test_api_behind_proxy import BAD_TOKEN, get

FAILURES = 3


@pytest.mark.parametrize("trusted", ["0.0.0.0/0,::/0", "::/0", "0.0.0.0/1,128.0.0.0/1"])
def test_trusting_every_network_is_refused_at_start_like_a_star(
    settings: Settings, trusted: str
) -> None:
    env = settings_env(settings, FORWARDED_ALLOW_IPS=trusted)
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(free_port())]
    done = subprocess.run(api_argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "FORWARDED_ALLOW_IPS='*'" in done.stderr
    assert "left of X-Forwarded-For" in done.stderr
    assert "Uvicorn running" not in done.stderr + done.stdout


def test_invented_names_before_the_proxys_hop_are_no_client(
    settings: Settings,
    world: World,
    tmp_path: Path,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = settings_env(settings, AUTH_FAILURES_PER_MIN=FAILURES, FORWARDED_ALLOW_IPS="127.0.0.1")
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(port)]
    url = f"/api/teams/{world.team_id}/tasks"
    with cluster(tmp_path) as procs:
        procs.append(Proc("api", api_argv, env, tmp_path).start())
        wait_for(lambda: get(base, "/api/health", "127.0.0.1") == 200, timeout=60, what="API")
        statuses = [get(base, url, f"evil-{i}, 127.0.0.1", BAD_TOKEN) for i in range(FAILURES)]
        assert statuses == [401] * FAILURES
        assert get(base, url, "evil-new, 127.0.0.1", BAD_TOKEN) == 429  # no escape
    buckets = set(redis_client.scan_iter(match=f"{queue_prefix}:ratelimit:auth:*"))
    assert buckets == {f"{queue_prefix}:ratelimit:auth:127.0.0.1"}
