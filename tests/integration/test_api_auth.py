"""Who may call the task routes (docs/design.md, "HTTP API"), in-process against real
PostgreSQL.

Every route needs a live bearer token and says so before validating anything; the
authorisation matrix for one task (owner, other staff, customer, outsider, no token,
unknown token, the owner's revoked or expired token) with nothing written on any
refusal; a task you may not see answers 404 like a missing or malformed id. Revoked and
expired tokens answer exactly like unknown ones.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.errors import MSG_TASK_NOT_FOUND
from harness.factories import World, task_row
from tests.support.api_helpers import (
    BAD_TOKEN,
    bearer,
    count_tasks,
    exports_url,
    reminders_url,
    task_in_state,
)
from tests.support.tokens import new_token, revoke


def assert_unauthenticated(response: Any) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert set(response.json()) == {"detail"}


# --- authentication -----------------------------------------------------------------------


def _every_route(world: World) -> list[tuple[str, str, dict[str, Any] | None]]:
    task = uuid.uuid4()
    return [
        ("POST", exports_url(world.team_id), {"scope": "TEAM"}),
        ("POST", reminders_url(world.team_id), {"ticket_id": str(uuid.uuid4())}),
        ("GET", f"/api/teams/{world.team_id}/tasks", None),
        ("GET", f"/api/tasks/{task}", None),
        ("POST", f"/api/tasks/{task}/retry", None),
        ("POST", f"/api/tasks/{task}/cancel", None),
        ("GET", f"/api/tasks/{task}/csv", None),
    ]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer(BAD_TOKEN),
        bearer("not-even-our-prefix"),
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
    ],
    ids=["missing", "unknown", "foreign", "basic", "empty"],
)
def test_every_task_route_needs_a_known_token(
    client: TestClient, engine: sa.Engine, world: World, headers: dict[str, str]
) -> None:
    for method, url, body in _every_route(world):
        response = client.request(method, url, json=body, headers=headers)
        assert_unauthenticated(response)
    assert count_tasks(engine) == 0


@pytest.mark.parametrize("state", ["revoked", "expired"])
def test_revoked_and_expired_tokens_answer_like_unknown_ones(
    client: TestClient, engine: sa.Engine, world: World, state: str
) -> None:
    token = new_token(engine, world.staff_id, state)
    unknown = client.get(f"/api/teams/{world.team_id}/tasks", headers=bearer(BAD_TOKEN))
    assert_unauthenticated(unknown)
    for method, url, body in _every_route(world):
        response = client.request(method, url, json=body, headers=bearer(token))
        assert_unauthenticated(response)
        assert response.json() == unknown.json()
    # also where the body is invalid (the 401-before-422 path looks the token up again)
    assert_unauthenticated(
        client.post(
            exports_url(world.team_id),
            content=b"{",
            headers={**bearer(token), "Content-Type": "application/json"},
        )
    )
    assert count_tasks(engine) == 0


def test_a_token_stops_working_the_moment_it_is_revoked(
    client: TestClient, engine: sa.Engine, world: World
) -> None:
    token = new_token(engine, world.staff_id)
    url = f"/api/teams/{world.team_id}/tasks"
    assert client.get(url, headers=bearer(token)).status_code == 200
    revoke(engine, token)
    assert_unauthenticated(client.get(url, headers=bearer(token)))


def test_authentication_comes_before_validation(
    client: TestClient, engine: sa.Engine, world: World
) -> None:
    for headers in ({}, bearer(BAD_TOKEN)):
        json_headers = {**headers, "Content-Type": "application/json"}
        for raw in (b"{", b"\xa3\x8b"):
            response = client.post(exports_url(world.team_id), content=raw, headers=json_headers)
            assert_unauthenticated(response)
        assert_unauthenticated(client.get("/api/tasks/not-a-uuid", headers=headers))
        assert_unauthenticated(
            client.post(exports_url(world.team_id), json={"scope": "ALL"}, headers=headers)
        )
        assert_unauthenticated(
            client.get(f"/api/teams/{world.team_id}/tasks?limit=0", headers=headers)
        )
    assert count_tasks(engine) == 0


# --- the authorisation matrix for one task --------------------------------------------------

# Who sees a task (docs/design.md, "Permissions"): a TEAM task its team's staff, a MINE
# task its owner.
VISIBLE = {
    ("TEAM", "staff"): True,  # the owner
    ("TEAM", "staff2"): True,
    ("TEAM", "customer"): False,
    ("TEAM", "outsider"): False,
    ("MINE", "customer"): True,  # the owner
    ("MINE", "staff"): False,
    ("MINE", "staff2"): False,
    ("MINE", "outsider"): False,
}
# (method, path suffix, state the task must be in, status when allowed)
ACTIONS = {
    "get": ("GET", "", "RUNNING", 200),
    "retry": ("POST", "/retry", "FAILED", 202),
    "cancel": ("POST", "/cancel", "RUNNING", 202),
    "csv": ("GET", "/csv", "COMPLETED", 200),
}


@pytest.mark.parametrize("scope", ["TEAM", "MINE"])
@pytest.mark.parametrize("action", list(ACTIONS))
def test_authorisation_matrix(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    action: str,
    scope: str,
) -> None:
    method, suffix, state, allowed = ACTIONS[action]
    owner = world.staff_id if scope == "TEAM" else world.customer_id
    # The owner's own tokens, once revoked or expired, are refused like no token at all.
    dead = {kind: new_token(engine, owner, kind) for kind in ("revoked", "expired")}
    users: list[str | None] = ["staff", "staff2", "customer", "outsider", None, "bad"]
    users += list(dead)
    for user in users:
        task_id = task_in_state(engine, world, state, owner_id=owner, scope=scope)
        before = task_row(engine, task_id)
        token = None if user is None else {**tokens, **dead}.get(user, BAD_TOKEN)
        response = client.request(method, f"/api/tasks/{task_id}{suffix}", headers=bearer(token))
        if user in (None, "bad", "revoked", "expired"):
            assert_unauthenticated(response)
        elif VISIBLE[(scope, user)]:
            assert response.status_code == allowed, (user, response.text)
            continue
        else:
            assert (response.status_code, response.json()) == (
                404,
                {"detail": MSG_TASK_NOT_FOUND},
            ), user
        assert task_row(engine, task_id) == before, user


@pytest.mark.parametrize("suffix", ["", "/retry", "/cancel", "/csv"])
def test_missing_and_malformed_task_ids_are_404(
    client: TestClient, tokens: dict[str, str], suffix: str
) -> None:
    method = "POST" if suffix in ("/retry", "/cancel") else "GET"
    for task_id in (str(uuid.uuid4()), "not-a-uuid", "1"):
        response = client.request(
            method, f"/api/tasks/{task_id}{suffix}", headers=bearer(tokens["staff"])
        )
        assert (response.status_code, response.json()) == (404, {"detail": MSG_TASK_NOT_FOUND})
