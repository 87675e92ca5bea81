"""The documentation pages' Content-Security-Policy (api/middleware.py): no
``'unsafe-inline'`` script. The pages' own inline scripts - Swagger UI's start on /docs,
the OAuth2 redirect page's - are allowed by their SHA-256, and nothing else inline is: the
policy lists exactly the hashes of the inline scripts the served pages carry, under any
``root_path`` (the Swagger page names /openapi.json under it). /redoc has no inline
script. That the pages still render in a browser under it:
tests/process/test_api_docs_browser.py."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_api
from teamdesk.config import Settings

DOCS_PAGES = ("/docs", "/docs/oauth2-redirect", "/redoc")


@pytest.fixture(params=["", "/tasks"], ids=["root", "under /tasks"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    app = create_api(Settings(), configure_logging=False)
    with TestClient(app, root_path=request.param) as test_client:
        yield test_client


def directives(policy: str) -> dict[str, list[str]]:
    parts = (part.split() for part in policy.split(";") if part.strip())
    return {name: sources for name, *sources in parts}


def inline_script_hashes(html: str) -> set[str]:
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.DOTALL)
    return {
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
        for s in scripts
    }


def test_the_docs_allow_exactly_their_own_inline_scripts(client: TestClient) -> None:
    pages = {path: client.get(path) for path in DOCS_PAGES}
    policies = {
        path: directives(page.headers["content-security-policy"]) for path, page in pages.items()
    }
    own = set().union(*(inline_script_hashes(page.text) for page in pages.values()))
    assert {page.status_code for page in pages.values()} == {200}
    assert len(own) == 2  # Swagger UI's start and the redirect page's
    for path, policy in policies.items():
        assert "'unsafe-inline'" not in policy["script-src"], path
        assert set(policy["script-src"]) == {"'self'", *own}, path
        assert policy["object-src"] == ["'none'"] and policy["base-uri"] == ["'none'"], path


def test_the_data_answers_still_load_nothing(client: TestClient) -> None:
    policy = client.get("/openapi.json").headers["content-security-policy"]
    assert policy == "default-src 'none'; frame-ancestors 'none'"
