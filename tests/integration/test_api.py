"""The HTTP API (docs/design.md, "HTTP API") in-process against real PostgreSQL and Redis.

Every route's success and error answers, the authorisation matrix (owner, other staff,
customer, outsider, no token, unknown token), "nothing written" on every refusal, and the
health probes with the database or Redis unreachable.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_api
from api.bounded import BoundedChecks, CheckFailed
from api.errors import MSG_LIMIT, MSG_TASK_NOT_FOUND, MSG_TEAM_NOT_FOUND
from api.middleware import MAX_BODY_BYTES
from api.tasks import MSG_EXPIRED, MSG_NOT_AN_EXPORT, MSG_NOT_COMPLETED
from dispatcher.heartbeat import Heartbeat, WorkerSlots
from dispatcher.leader import Leadership, leader_key
from ledger import permissions, service
from ledger.filters import MSG_DATE_ORDER, MSG_NOT_OBJECT, MSG_Q, MSG_STATUS, MSG_UNKNOWN_KEY
from ledger.filters import MSG_Q_CHARS as MSG_TEXT
from teamdesk.config import Settings
from tests.support.api_helpers import (
    BAD_TOKEN,
    api_client,
    bearer,
    closed_port,
    count_tasks,
    make_tokens,
    silent_listener,
    task_in_state,
)
from tests.support.factories import World, add_ticket, set_role, task_row

HEALTH_BUDGET_S = 3.0


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with api_client(settings) as test_client:
        yield test_client


@pytest.fixture
def tokens(engine: sa.Engine, world: World) -> dict[str, str]:
    return make_tokens(engine, world)


def exports_url(team_id: object) -> str:
    return f"/api/teams/{team_id}/exports"


def reminders_url(team_id: object) -> str:
    return f"/api/teams/{team_id}/reminders"


def assert_unauthenticated(response: Any) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert set(response.json()) == {"detail"}


# --- /api/health ------------------------------------------------------------------------


def test_health_ok_is_never_cached(client: TestClient) -> None:
    response = client.get("/api/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert response.headers["Cache-Control"] == "no-store"


def _assert_unavailable_without_details(settings: Settings, port: int) -> None:
    broken = settings.with_overrides(database_url=f"postgresql://postgres@127.0.0.1:{port}/x")
    with api_client(broken) as client:
        started = time.monotonic()
        response = client.get("/api/health")
        elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable"}
    assert response.headers["Cache-Control"] == "no-store"
    for leak in ("127.0.0.1", str(port), "postgres", "Error", "connect"):
        assert leak not in response.text
    assert elapsed < HEALTH_BUDGET_S, elapsed


def test_health_503_when_the_database_port_is_closed(settings: Settings) -> None:
    _assert_unavailable_without_details(settings, closed_port())


def test_health_503_within_budget_when_the_database_never_answers(settings: Settings) -> None:
    with silent_listener() as port:
        _assert_unavailable_without_details(settings, port)


def test_health_does_not_need_redis(settings: Settings) -> None:
    no_redis = settings.with_overrides(redis_url=f"redis://127.0.0.1:{closed_port()}/0")
    with api_client(no_redis) as client:
        assert client.get("/api/health").json() == {"status": "ok"}


# --- /api/workers/health ----------------------------------------------------------------


def roles(workers: bool, dispatcher: bool, exports: int, reminders: int) -> dict[str, object]:
    missing = [] if dispatcher else ["dispatcher"]
    missing += [f"{q} worker" for q, n in (("exports", exports), ("reminders", reminders)) if not n]
    return {
        "workers": workers,
        "dispatcher": dispatcher,
        "consumers": {"exports": exports, "reminders": reminders},
        "missing": missing,
    }


def test_workers_health_says_which_roles_are_live_and_which_are_missing(
    client: TestClient, settings: Settings, redis_client: redis.Redis
) -> None:
    response = client.get("/api/workers/health")
    assert (response.status_code, response.json()) == (200, roles(False, False, 0, 0))
    assert response.headers["Cache-Control"] == "no-store"
    prefix, ttl = settings.queue_prefix, settings.heartbeat_ttl_s
    exporter = Heartbeat(redis_client, prefix, "api-test", ttl, WorkerSlots(("exports",), 2))
    assert exporter.renew()
    assert client.get("/api/workers/health").json() == roles(True, False, 2, 0)
    leader = Leadership(redis_client, leader_key(prefix), 15)
    assert leader.ensure()
    mixed = WorkerSlots(("exports", "reminders"), 3)
    both = Heartbeat(redis_client, prefix, "api-test", ttl, mixed)
    assert both.renew()
    assert client.get("/api/workers/health").json() == roles(True, True, 5, 3)
    exporter.remove(draining=True)  # a draining worker takes no new work
    both.remove()
    leader.release()
    assert client.get("/api/workers/health").json() == roles(False, False, 0, 0)


def test_workers_health_503_when_redis_is_unreachable(settings: Settings) -> None:
    port = closed_port()
    with api_client(settings.with_overrides(redis_url=f"redis://127.0.0.1:{port}/0")) as client:
        started = time.monotonic()
        response = client.get("/api/workers/health")
        elapsed = time.monotonic() - started
    assert (response.status_code, response.json()) == (503, {"workers": None})
    assert response.headers["Cache-Control"] == "no-store"
    assert str(port) not in response.text
    assert elapsed < HEALTH_BUDGET_S


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


# --- POST /api/teams/{team_id}/exports ----------------------------------------------------


@pytest.mark.parametrize(
    ("user", "scope"), [("staff", "TEAM"), ("staff", "MINE"), ("customer", "MINE")]
)
def test_create_export_writes_one_waiting_row(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    user: str,
    scope: str,
) -> None:
    filters = {
        "status": ["OPEN"],
        "priority": ["HIGH"],
        "q": "printer",
        "created_from": "2026-01-01",
    }
    response = client.post(
        exports_url(world.team_id),
        json={"scope": scope, "filters": filters},
        headers=bearer(tokens[user]),
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert response.headers["Location"] == f"/api/tasks/{body['id']}"
    assert (body["kind"], body["scope"], body["status"], body["run"]) == (
        "EXPORT",
        scope,
        "WAITING",
        0,
    )
    assert body["filters"] == filters and body["team_id"] == str(world.team_id)
    assert body["has_csv"] is False and "result_csv" not in body
    row = task_row(engine, uuid.UUID(body["id"]))
    # The API never waits on a worker: the row is left for the dispatcher to publish.
    assert (row["status"], row["dispatched_at"], row["execution_id"]) == ("WAITING", None, None)
    assert count_tasks(engine) == 1


def test_create_export_filters_default_to_empty(
    client: TestClient, world: World, tokens: dict[str, str]
) -> None:
    response = client.post(
        exports_url(world.team_id), json={"scope": "MINE"}, headers=bearer(tokens["customer"])
    )
    assert response.status_code == 201 and response.json()["filters"] == {}


INVALID_EXPORTS: list[tuple[Any, str]] = [
    ({"scope": "ALL"}, service.MSG_SCOPE),
    ({"filters": {}}, service.MSG_SCOPE),
    ({"scope": 1}, service.MSG_SCOPE),
    ({"scope": "TEAM", "filters": []}, MSG_NOT_OBJECT),
    ({"scope": "TEAM", "filters": "status=OPEN"}, MSG_NOT_OBJECT),
    ({"scope": "TEAM", "filters": {"owner": "me"}}, MSG_UNKNOWN_KEY),
    ({"scope": "TEAM", "filters": {"status": ["open"]}}, MSG_STATUS),
    ({"scope": "TEAM", "filters": {"status": []}}, MSG_STATUS),
    ({"scope": "TEAM", "filters": {"q": "x" * 201}}, MSG_Q),
    ({"scope": "TEAM", "filters": {"q": "nul\x00byte"}}, MSG_TEXT),
    ({"scope": "TEAM", "filters": {"q": "lone \ud800 surrogate"}}, MSG_TEXT),
    (
        {"scope": "TEAM", "filters": {"created_from": "2026-02-01", "created_to": "2026-01-01"}},
        MSG_DATE_ORDER,
    ),
    ({"scope": "TEAM", "extra": 1}, "the request body may only contain scope, filters"),
    (["scope", "TEAM"], "the request body must be a JSON object"),
    ("TEAM", "the request body must be a JSON object"),
]


@pytest.mark.parametrize(("body", "message"), INVALID_EXPORTS)
def test_invalid_export_is_422_with_a_fixed_message_and_writes_nothing(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    body: Any,
    message: str,
) -> None:
    headers = {**bearer(tokens["staff"]), "Content-Type": "application/json"}
    # json.dumps escapes what a client library would refuse to encode (a lone surrogate).
    response = client.post(exports_url(world.team_id), content=json.dumps(body), headers=headers)
    assert (response.status_code, response.json()) == (422, {"detail": message})
    assert count_tasks(engine) == 0


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b'{"scope": "TEAM"', b"\xa3\x8b\x89", b"[" * 60_000],
    ids=["garbage", "empty", "truncated", "not-utf8", "too-deep"],
)
def test_malformed_json_is_422(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], raw: bytes
) -> None:
    headers = {**bearer(tokens["staff"]), "Content-Type": "application/json"}
    response = client.post(exports_url(world.team_id), content=raw, headers=headers)
    assert (response.status_code, response.json()) == (
        422,
        {"detail": "the request body must be a JSON object"},
    )
    assert count_tasks(engine) == 0


def test_oversized_body_is_413_and_writes_nothing(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    body = {"scope": "TEAM", "filters": {"q": "x" * (MAX_BODY_BYTES + 1)}}
    response = client.post(exports_url(world.team_id), json=body, headers=bearer(tokens["staff"]))
    assert response.status_code == 413
    assert "64 KiB" in response.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield b'{"scope": "TEAM", "filters": {"q": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}}'

    headers = {**bearer(tokens["staff"]), "Content-Type": "application/json"}
    response = client.post(exports_url(world.team_id), content=chunks(), headers=headers)
    assert response.status_code == 413
    assert count_tasks(engine) == 0


def test_customer_team_export_is_403_and_writes_nothing(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    response = client.post(
        exports_url(world.team_id), json={"scope": "TEAM"}, headers=bearer(tokens["customer"])
    )
    assert (response.status_code, response.json()) == (
        403,
        {"detail": permissions.MSG_TEAM_EXPORT_NEEDS_STAFF},
    )
    assert count_tasks(engine) == 0


@pytest.mark.parametrize("team", ["outsider_team", "missing", "malformed"])
def test_export_in_a_team_you_are_not_in_is_404_like_a_missing_team(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], team: str
) -> None:
    team_id = {"outsider_team": world.team_id, "missing": uuid.uuid4(), "malformed": "nope"}[team]
    response = client.post(
        exports_url(team_id), json={"scope": "MINE"}, headers=bearer(tokens["outsider"])
    )
    assert (response.status_code, response.json()) == (404, {"detail": MSG_TEAM_NOT_FOUND})
    assert count_tasks(engine) == 0


# --- POST /api/teams/{team_id}/reminders --------------------------------------------------


@pytest.fixture
def ticket_id(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return add_ticket(
            conn, world.team_id, world.customer_id, "Printer", assignee_id=world.staff_id
        )


def test_create_reminder_at_a_time(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    ticket_id: uuid.UUID,
) -> None:
    response = client.post(
        reminders_url(world.team_id),
        json={"ticket_id": str(ticket_id), "run_at": "2030-05-01T10:00:00+02:00"},
        headers=bearer(tokens["staff2"]),
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["kind"], body["scope"], body["status"]) == ("REMINDER", "TEAM", "WAITING")
    assert body["filters"] == {"ticket_id": str(ticket_id)}
    assert body["run_at"] == "2030-05-01T08:00:00Z"
    assert response.headers["Location"] == f"/api/tasks/{body['id']}"
    row = task_row(engine, uuid.UUID(body["id"]))
    assert row["run_at"] == datetime(2030, 5, 1, 8, tzinfo=UTC) and row["dispatched_at"] is None


def test_create_reminder_defaults_to_now(
    client: TestClient, world: World, tokens: dict[str, str], ticket_id: uuid.UUID
) -> None:
    before = datetime.now(UTC) - timedelta(seconds=5)
    response = client.post(
        reminders_url(world.team_id),
        json={"ticket_id": str(ticket_id)},
        headers=bearer(tokens["staff"]),
    )
    assert response.status_code == 201
    run_at = datetime.fromisoformat(response.json()["run_at"])
    assert before <= run_at <= datetime.now(UTC) + timedelta(seconds=5)


def test_invalid_reminders_write_nothing(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    ticket_id: uuid.UUID,
) -> None:
    with engine.begin() as conn:
        other_team = conn.execute(
            sa.text("SELECT id FROM teams WHERE id <> :t"), {"t": world.team_id}
        ).scalar_one()
        foreign_ticket = add_ticket(conn, other_team, world.outsider_id, "Elsewhere")
    ticket = str(ticket_id)
    cases: list[tuple[str, Any, int, str]] = [
        ("staff", {"ticket_id": ticket, "run_at": "2030-05-01T10:00:00"}, 422, service.MSG_RUN_AT),
        ("staff", {"ticket_id": ticket, "run_at": "tomorrow"}, 422, service.MSG_RUN_AT),
        ("staff", {"ticket_id": ticket, "run_at": 1893456000}, 422, service.MSG_RUN_AT),
        ("staff", {"ticket_id": "ticket-7"}, 422, service.MSG_TICKET),
        ("staff", {}, 422, service.MSG_TICKET),
        ("staff", {"ticket_id": str(uuid.uuid4())}, 422, service.MSG_TICKET),
        ("staff", {"ticket_id": str(foreign_ticket)}, 422, service.MSG_TICKET),
        (
            "staff",
            {"ticket_id": ticket, "to": "x"},
            422,
            "the request body may only contain ticket_id, run_at",
        ),
        ("customer", {"ticket_id": ticket}, 403, permissions.MSG_REMINDER_NEEDS_STAFF),
        ("outsider", {"ticket_id": ticket}, 404, MSG_TEAM_NOT_FOUND),
    ]
    for user, body, status, message in cases:
        response = client.post(
            reminders_url(world.team_id), json=body, headers=bearer(tokens[user])
        )
        assert (response.status_code, response.json()) == (status, {"detail": message}), body
    assert count_tasks(engine) == 0


# --- GET /api/teams/{team_id}/tasks -------------------------------------------------------


def test_list_shows_what_each_user_may_see_newest_first(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    team_task = task_in_state(engine, world, "WAITING")
    staff_mine = task_in_state(engine, world, "WAITING", scope="MINE")
    customer_mine = task_in_state(engine, world, "FAILED", scope="MINE", owner_id=world.customer_id)
    url = f"/api/teams/{world.team_id}/tasks"

    def ids(user: str, query: str = "") -> list[str]:
        response = client.get(url + query, headers=bearer(tokens[user]))
        assert response.status_code == 200, response.text
        return [task["id"] for task in response.json()["tasks"]]

    assert ids("staff") == [str(staff_mine), str(team_task)]
    assert ids("staff2") == [str(team_task)]
    assert ids("customer") == [str(customer_mine)]
    assert ids("staff", "?limit=1") == [str(staff_mine)]
    outsider = client.get(url, headers=bearer(tokens["outsider"]))
    assert (outsider.status_code, outsider.json()) == (404, {"detail": MSG_TEAM_NOT_FOUND})


def test_list_items_never_carry_the_csv(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    task_in_state(engine, world, "COMPLETED", csv="id\r\nsecret-row\r\n")
    response = client.get(f"/api/teams/{world.team_id}/tasks", headers=bearer(tokens["staff"]))
    (task,) = response.json()["tasks"]
    assert task["has_csv"] is True and task["status"] == "COMPLETED"
    assert "result_csv" not in task and "secret-row" not in response.text


@pytest.mark.parametrize("limit", ["0", "201", "-1", "ten", "1.5"])
def test_list_limit_out_of_range_is_422(
    client: TestClient, world: World, tokens: dict[str, str], limit: str
) -> None:
    response = client.get(
        f"/api/teams/{world.team_id}/tasks?limit={limit}", headers=bearer(tokens["staff"])
    )
    assert (response.status_code, response.json()) == (422, {"detail": MSG_LIMIT})


def test_list_of_a_malformed_team_is_404(client: TestClient, tokens: dict[str, str]) -> None:
    response = client.get("/api/teams/12345/tasks", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (404, {"detail": MSG_TEAM_NOT_FOUND})


# --- the authorisation matrix for one task --------------------------------------------------

# Who sees a task: its owner, and staff when its scope is TEAM (docs/design.md, "Lifecycle").
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
    users: list[str | None] = ["staff", "staff2", "customer", "outsider", None, "bad"]
    for user in users:
        task_id = task_in_state(engine, world, state, owner_id=owner, scope=scope)
        before = task_row(engine, task_id)
        token = None if user is None else tokens.get(user, BAD_TOKEN)
        response = client.request(method, f"/api/tasks/{task_id}{suffix}", headers=bearer(token))
        if user is None or user == "bad":
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


# --- GET /api/tasks/{task_id} -------------------------------------------------------------


def test_get_task_shows_status_run_attempts_progress_and_error(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    task_id = task_in_state(engine, world, "FAILED")
    response = client.get(f"/api/tasks/{task_id}", headers=bearer(tokens["staff"]))
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == str(task_id)
    assert (body["status"], body["run"], body["attempts"], body["progress"]) == ("FAILED", 0, 1, 0)
    assert body["last_error"] == "Export failed."
    assert body["expires_at"] is None and body["has_csv"] is False
    assert set(body) >= {"result_summary", "created_at", "updated_at", "run_at", "recoveries"}
    assert "result_csv" not in body and "execution_id" not in body


# --- POST /api/tasks/{task_id}/retry --------------------------------------------------------


@pytest.mark.parametrize("state", ["FAILED", "CANCELLED"])
def test_retry_is_accepted_and_opens_a_new_run(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], state: str
) -> None:
    task_id = task_in_state(engine, world, state)
    response = client.post(f"/api/tasks/{task_id}/retry", headers=bearer(tokens["staff2"]))
    assert (response.status_code, response.json()) == (
        202,
        {"task_id": str(task_id), "run": 1, "status": "WAITING"},
    )
    row = task_row(engine, task_id)
    assert (row["status"], row["run"], row["attempts"], row["dispatched_at"]) == (
        "WAITING",
        1,
        0,
        None,
    )


@pytest.mark.parametrize("state", ["WAITING", "RUNNING", "COMPLETED"])
def test_retry_of_an_unfinished_or_completed_task_is_409(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], state: str
) -> None:
    task_id = task_in_state(engine, world, state)
    before = task_row(engine, task_id)
    response = client.post(f"/api/tasks/{task_id}/retry", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (409, {"detail": service.MSG_RETRY_STATE})
    assert task_row(engine, task_id) == before


def test_retry_of_a_team_export_whose_creator_was_demoted_is_403(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    task_id = task_in_state(engine, world, "FAILED", owner_id=world.staff2_id)
    with engine.begin() as conn:
        set_role(conn, world.team_id, world.staff2_id, "CUSTOMER")
    before = task_row(engine, task_id)
    response = client.post(f"/api/tasks/{task_id}/retry", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (
        403,
        {"detail": permissions.MSG_CREATOR_NOT_STAFF},
    )
    assert task_row(engine, task_id) == before


# --- POST /api/tasks/{task_id}/cancel -------------------------------------------------------


@pytest.mark.parametrize("state", ["WAITING", "RUNNING"])
def test_cancel_is_accepted_and_revokes_the_lease(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], state: str
) -> None:
    task_id = task_in_state(engine, world, state)
    response = client.post(f"/api/tasks/{task_id}/cancel", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (
        202,
        {"task_id": str(task_id), "run": 0, "status": "CANCELLED"},
    )
    row = task_row(engine, task_id)
    assert (row["status"], row["execution_id"]) == ("CANCELLED", None)
    again = client.post(f"/api/tasks/{task_id}/cancel", headers=bearer(tokens["staff"]))
    assert (again.status_code, again.json()) == (409, {"detail": service.MSG_CANCEL_STATE})


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED"])
def test_cancel_of_a_finished_task_is_409(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], state: str
) -> None:
    task_id = task_in_state(engine, world, state)
    before = task_row(engine, task_id)
    response = client.post(f"/api/tasks/{task_id}/cancel", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (409, {"detail": service.MSG_CANCEL_STATE})
    assert task_row(engine, task_id) == before


# --- GET /api/tasks/{task_id}/csv -----------------------------------------------------------

CSV = 'id,title\r\nT-1,"Café, ""quoted"""\r\nT-2,\'=1+1\r\n'


def test_csv_download_of_a_completed_export(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    task_id = task_in_state(engine, world, "COMPLETED", csv=CSV)
    response = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff2"]))
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    assert response.headers["Content-Disposition"] == f'attachment; filename="export-{task_id}.csv"'
    assert response.headers["Cache-Control"] == "no-store"
    assert response.content == CSV.encode("utf-8")


@pytest.mark.parametrize("state", ["WAITING", "RUNNING", "FAILED", "CANCELLED"])
def test_csv_is_409_until_the_export_completes(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], state: str
) -> None:
    task_id = task_in_state(engine, world, state)
    response = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (409, {"detail": MSG_NOT_COMPLETED})


def test_csv_of_a_reminder_is_409(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    task_id = task_in_state(engine, world, "COMPLETED", kind="REMINDER")
    response = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (409, {"detail": MSG_NOT_AN_EXPORT})


@pytest.mark.parametrize(
    "change",
    [
        "expires_at = now() - interval '1 second'",
        "result_csv = NULL",  # purged by the dispatcher
    ],
    ids=["expired", "purged"],
)
def test_csv_is_410_once_expired_or_purged(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], change: str
) -> None:
    task_id = task_in_state(engine, world, "COMPLETED", csv=CSV)
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE background_tasks SET {change} WHERE id = :id"), {"id": task_id}
        )
    response = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (410, {"detail": MSG_EXPIRED})


# --- the database going away under a task route ---------------------------------------------


def test_task_routes_answer_503_without_details_when_the_database_is_unreachable(
    settings: Settings,
) -> None:
    port = closed_port()
    broken = settings.with_overrides(database_url=f"postgresql://postgres@127.0.0.1:{port}/x")
    with api_client(broken) as client:
        response = client.get(f"/api/tasks/{uuid.uuid4()}", headers=bearer(BAD_TOKEN))
    assert response.status_code == 503
    assert set(response.json()) == {"detail"}
    assert str(port) not in response.text and "127.0.0.1" not in response.text


# --- OpenAPI ---------------------------------------------------------------------------------


def test_openapi_and_docs_are_served(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert set(schema["paths"]) == {
        "/api/health",
        "/api/workers/health",
        "/api/teams/{team_id}/exports",
        "/api/teams/{team_id}/reminders",
        "/api/teams/{team_id}/tasks",
        "/api/tasks/{task_id}",
        "/api/tasks/{task_id}/retry",
        "/api/tasks/{task_id}/cancel",
        "/api/tasks/{task_id}/csv",
    }
    assert "bearer" in schema["components"]["securitySchemes"]
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_importing_the_module_level_app_needs_no_database() -> None:
    env = {
        **os.environ,
        "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{closed_port()}/x",
        "REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0",
    }
    code = "import api.app; print(sorted(api.app.app.openapi()['paths'])[0])"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "/api/health"


def test_logs_carry_no_token_body_or_csv(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    task_id = task_in_state(engine, world, "COMPLETED", csv="id\r\nsecret-csv-row\r\n")
    client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
    body = {"scope": "TEAM", "filters": {"q": "secret-body-text"}}
    client.post(exports_url(world.team_id), json=body, headers=bearer(tokens["staff"]))
    broken = settings.with_overrides(
        database_url=f"postgresql://postgres@127.0.0.1:{closed_port()}/x"
    )
    with api_client(broken) as down:
        down.post(exports_url(world.team_id), json=body, headers=bearer(tokens["staff"]))
        down.get("/api/health")
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "database unavailable" in logged and "health check failed" in logged
    for secret in (tokens["staff"], "secret-body-text", "secret-csv-row"):
        assert secret not in logged


# --- bounded health checks and the last-resort answer ---------------------------------------


def test_a_hung_check_answers_at_its_deadline_and_in_flight_checks_are_capped() -> None:
    release = threading.Event()
    running = [threading.Event(), threading.Event()]
    checks = BoundedChecks(max_in_flight=2)

    def hang(started: threading.Event) -> bool:
        started.set()
        return release.wait()

    async def scenario() -> None:
        hung = [asyncio.create_task(checks.run(functools.partial(hang, e), 30.0)) for e in running]
        # Gate: both checks hold their slot (the slot is taken before the thread starts).
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, lambda: all(e.wait(10) for e in running))
        started = time.monotonic()
        with pytest.raises(CheckFailed):  # no slot left: fails at once, no thread started
            await checks.run(lambda: True, 30.0)
        assert time.monotonic() - started < 1.0
        assert not any(task.done() for task in hung)
        release.set()
        assert await asyncio.gather(*hung) == [True, True]
        assert await checks.run(lambda: 7, 5.0) == 7

    asyncio.run(scenario())


def test_a_check_overrunning_its_deadline_fails() -> None:
    release = threading.Event()
    checks = BoundedChecks()

    async def scenario() -> None:
        started = time.monotonic()
        with pytest.raises(CheckFailed) as failed:
            await checks.run(release.wait, 0.2)
        assert isinstance(failed.value.__cause__, TimeoutError)
        assert time.monotonic() - started < 2.0

    asyncio.run(scenario())
    release.set()


def test_an_unexpected_error_answers_500_without_its_text(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_api(settings, configure_logging=False)

    @app.get("/api/boom")
    def boom() -> None:
        raise ValueError("secret-detail")

    with TestClient(app) as client:
        response = client.get("/api/boom")
    assert (response.status_code, response.json()) == (500, {"detail": "internal error"})
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "ValueError" in logged and "secret-detail" not in logged
