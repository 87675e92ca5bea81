"""Invalid requests with a live token take from that token's budgets (issue "Security,
round four", finding 5): FastAPI validates the path, query and body before any route
runs, so a malformed creation or a ``?limit=0`` list used neither budget (150 of each
got no 429) while each cost a token lookup. Now a write that ends 422 takes from the
token's write budget and a read from its read budget, 429 once spent, exactly like valid
requests; against real Redis and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_api
from api.deps import MSG_READ_RATE, MSG_TOKEN_RATE
from harness.factories import World
from teamdesk.config import Settings
from tests.support.api_helpers import api_settings, bearer, count_tasks, exports_url

BURST = 3
MALFORMED_BODIES: list[dict[str, Any]] = [
    {"content": b"{", "headers": {"Content-Type": "application/json"}},  # not JSON
    {"json": {"scope": "EVERYTHING"}},  # an invalid field
    {"json": []},  # not an object
    {"json": {"scope": "TEAM", "surprise": 1}},  # an unknown field
]


@contextmanager
def limited_client(settings: Settings) -> Iterator[TestClient]:
    small = settings.with_overrides(
        api_rate_per_min=1, api_rate_burst=BURST, api_read_rate_per_min=1, api_read_burst=BURST
    )
    app = create_api(api_settings(small), configure_logging=False)
    with TestClient(app, client=("203.0.113.7", 50000)) as client:
        yield client


def assert_limited(response: Any, message: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json() == {"detail": message}
    assert 1 <= int(response.headers["Retry-After"]) <= 60 * BURST


def test_malformed_creations_hit_the_write_budget(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    url = exports_url(world.team_id)
    with limited_client(settings) as client:
        for i in range(BURST):
            request = MALFORMED_BODIES[i % len(MALFORMED_BODIES)]
            headers = {**staff, **request.get("headers", {})}
            kwargs = {k: v for k, v in request.items() if k != "headers"}
            answer = client.post(url, headers=headers, **kwargs)
            assert answer.status_code == 422, answer.text
        for request in MALFORMED_BODIES:  # every form of invalid body, now refused
            headers = {**staff, **request.get("headers", {})}
            kwargs = {k: v for k, v in request.items() if k != "headers"}
            assert_limited(client.post(url, headers=headers, **kwargs), MSG_TOKEN_RATE)
        # The budget is the token's: a valid creation waits too, and so does a malformed
        # retry (a malformed id answers 404 but took from the budget all the same).
        assert_limited(client.post(url, json={"scope": "TEAM"}, headers=staff), MSG_TOKEN_RATE)
        assert_limited(client.post("/api/tasks/not-a-uuid/retry", headers=staff), MSG_TOKEN_RATE)
        # Reads have their own budget, untouched; another token its own write budget.
        listed = client.get(f"/api/teams/{world.team_id}/tasks", headers=staff)
        assert listed.status_code == 200, listed.text
        other = client.post(url, json={"scope": "TEAM"}, headers=bearer(tokens["staff2"]))
        assert other.status_code == 201, other.text
    assert count_tasks(engine) == 1


def test_invalid_reads_hit_the_read_budget(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    url = f"/api/teams/{world.team_id}/tasks"
    with limited_client(settings) as client:
        for _ in range(BURST):
            assert client.get(f"{url}?limit=0", headers=staff).status_code == 422
        assert_limited(client.get(f"{url}?limit=0", headers=staff), MSG_READ_RATE)
        assert_limited(client.get(f"{url}?limit=ten", headers=staff), MSG_READ_RATE)
        assert_limited(client.get("/api/tasks/not-a-uuid", headers=staff), MSG_READ_RATE)
        assert_limited(client.get(url, headers=staff), MSG_READ_RATE)  # a valid read too
        # The write budget is apart: a creation is served.
        created = client.post(exports_url(world.team_id), json={"scope": "TEAM"}, headers=staff)
        assert created.status_code == 201, created.text
    assert count_tasks(engine) == 1


def test_without_a_live_token_an_invalid_request_is_still_401(
    settings: Settings, world: World, tokens: dict[str, str]
) -> None:
    """The token is judged first, as before: no budget of any token is touched."""
    with limited_client(settings) as client:
        for _ in range(BURST + 1):
            answer = client.post(
                exports_url(world.team_id), json=[], headers=bearer("tdk_" + "x" * 43)
            )
            assert answer.status_code == 401, answer.text
        staff = bearer(tokens["staff"])
        created = client.post(exports_url(world.team_id), json={"scope": "TEAM"}, headers=staff)
        assert created.status_code == 201, created.text
