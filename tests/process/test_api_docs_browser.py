"""The API's documentation pages under their Content-Security-Policy, as a person opens
them: the real ``teamdesk-tasks api`` and headless Chromium (tests/support/browser.py).
Every answer says ``X-Frame-Options: DENY`` and carries a policy; the data answers load
nothing (``default-src 'none'``), and /docs (Swagger UI) and /redoc still render the
routes with theirs - scripts, styles, fonts and the web worker from this server only, and
no inline script but Swagger UI's own start, allowed by its hash (no 'unsafe-inline')."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import pytest

from api.app import create_api
from api.middleware import API_CSP, docs_policy
from harness.processes import Proc, cluster, free_port, settings_env
from harness.waiting import wait_for
from teamdesk.config import Settings
from tests.support.browser import Chromium, chromium_for_test

SETTLE_MS = 10_000  # virtual time for the pages' scripts to fetch and render the spec


@pytest.fixture
def browser(tmp_path: Path) -> Chromium:
    return chromium_for_test(tmp_path / "chromium")


def headers_of(url: str) -> dict[str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return {k.lower(): v for k, v in answer.headers.items()}
    except OSError:
        return {}


def test_the_docs_render_under_their_policy_and_data_answers_load_nothing(
    settings: Settings, tmp_path: Path, browser: Chromium
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    docs_csp = docs_policy(create_api(settings, configure_logging=False), "")
    script_src = next(d for d in docs_csp.decode().split(";") if "script-src" in d)
    assert "'sha256-" in script_src and "unsafe" not in script_src
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(port)]
    with cluster(tmp_path) as procs:
        procs.append(Proc("api", api_argv, settings_env(settings), tmp_path).start())
        wait_for(lambda: headers_of(base + "/api/health"), timeout=60, what="the API")
        for path, policy in (
            ("/api/health", API_CSP[1]),
            ("/openapi.json", API_CSP[1]),
            ("/docs", docs_csp),
            ("/redoc", docs_csp),
        ):
            headers = headers_of(base + path)
            assert headers["x-frame-options"] == "DENY", path
            assert headers["content-security-policy"] == policy.decode(), path
        swagger = browser.dump_dom(base + "/docs", settle_ms=SETTLE_MS)
        redoc = browser.dump_dom(base + "/redoc", settle_ms=SETTLE_MS)
    # Swagger UI fetched /openapi.json and rendered one block per operation.
    assert 'class="swagger-ui' in swagger
    assert swagger.count("opblock-summary-path") >= 8, swagger[:2000]
    assert "/api/teams/{team_id}/exports" in swagger.replace("&ZeroWidthSpace;", "").replace(
        "\u200b", ""
    )
    # Redoc rendered the API's title and its operations (its worker ran).
    assert "TeamDesk tasks API" in redoc
    assert "Ask for a CSV export of tickets" in redoc, redoc[:2000]
