"""The API behind a reverse proxy, the way the deploy files run it: the real
``teamdesk-tasks api`` (uvicorn) with ``FORWARDED_ALLOW_IPS`` naming the proxy, reached
from the proxy's address with ``X-Forwarded-For`` as a proxy writes it (what the client
sent, then the address the proxy saw). Failed authentications are counted against the
client the proxy saw: a client cannot escape its budget by writing another address in
front, cannot charge its failures to another client, and a live token is served even
from a client whose budget is spent. ``FORWARDED_ALLOW_IPS='*'`` is refused at start."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import sqlalchemy as sa

from harness.factories import World
from harness.processes import Proc, cluster, free_port, settings_env
from harness.waiting import wait_for
from ledger.tokens import create_token
from teamdesk.config import Settings

FAILURES = 3
BAD_TOKEN = "tdk_" + "x" * 43


def get(base: str, path: str, forwarded_for: str, token: str | None = None) -> int:
    headers = {"X-Forwarded-For": forwarded_for}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(base + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return int(refused.code)
    except urllib.error.URLError:
        return 0  # not listening yet


def test_failures_count_against_the_client_the_proxy_saw(
    settings: Settings, engine: sa.Engine, world: World, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        token = create_token(conn, world.staff_id, "proxy test")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = settings_env(settings, AUTH_FAILURES_PER_MIN=FAILURES, FORWARDED_ALLOW_IPS="127.0.0.1")
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(port)]
    url = f"/api/teams/{world.team_id}/tasks"
    attacker, victim = "203.0.113.5", "203.0.113.6"
    with cluster(tmp_path) as procs:
        procs.append(Proc("api", api_argv, env, tmp_path).start())
        wait_for(lambda: get(base, "/api/health", victim) == 200, timeout=60, what="API")
        for i in range(FAILURES):  # whatever the client writes in front, it is the attacker
            assert get(base, url, f"198.51.100.{i}, {attacker}", BAD_TOKEN) == 401
        assert get(base, url, f"10.9.9.9, {attacker}", BAD_TOKEN) == 429  # cannot escape
        assert get(base, url, attacker, BAD_TOKEN) == 429
        assert get(base, url, f"{victim}, {attacker}", BAD_TOKEN) == 429  # nor charge
        assert get(base, url, victim, BAD_TOKEN) == 401  # the victim's own budget is whole
        assert get(base, url, attacker, token) == 200  # a live token is served all the same
        assert get(base, url, f"{attacker}, {victim}", token) == 200


def test_trusting_every_address_is_refused_at_start(settings: Settings) -> None:
    env = settings_env(settings, FORWARDED_ALLOW_IPS="*")
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(free_port())]
    done = subprocess.run(api_argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "FORWARDED_ALLOW_IPS='*'" in done.stderr
    assert "left of X-Forwarded-For" in done.stderr
    assert "Uvicorn running" not in done.stderr + done.stdout
