"""Creating tasks through the HTTP API (docs/design.md, "HTTP API"), in-process against
real PostgreSQL.

``POST /api/teams/{team_id}/exports`` and ``.../reminders`` write one WAITING row and
leave it to the dispatcher; every refusal (invalid, malformed or oversized body, a
customer's team export or reminder, a team you are not in) answers a fixed message and
writes nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.errors import MSG_TEAM_NOT_FOUND
from api.middleware import MAX_BODY_BYTES
from harness.factories import World, add_ticket, task_row
from ledger import permissions, service
from ledger.filters import (
    MSG_DATE,
    MSG_DATE_ORDER,
    MSG_NOT_OBJECT,
    MSG_Q,
    MSG_STATUS,
    MSG_UNKNOWN_KEY,
)
from ledger.filters import MSG_Q_CHARS as MSG_TEXT
from ledger.service import MSG_RUN_AT_WINDOW as WINDOW
from tests.support.api_helpers import bearer, count_tasks, exports_url, reminders_url

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
    (
        {"scope": "TEAM", "filters": {"created_to": "9999-12-31"}},
        MSG_DATE.format(key="created_to"),
    ),
    (
        {"scope": "TEAM", "filters": {"created_from": "0001-01-01"}},
        MSG_DATE.format(key="created_from"),
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
    [b"{not json", b'{"scope": "TEAM"', b"\xa3\x8b\x89", b"[" * 60_000],
    ids=["garbage", "truncated", "not-utf8", "too-deep"],
)
def test_malformed_json_is_422(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], raw: bytes
) -> None:
    """(The messages, and an empty body's: test_api_error_wording.py.)"""
    headers = {**bearer(tokens["staff"]), "Content-Type": "application/json"}
    response = client.post(exports_url(world.team_id), content=raw, headers=headers)
    assert (response.status_code, response.json()) == (
        422,
        {"detail": "the request body is not valid JSON"},
    )
    assert count_tasks(engine) == 0


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_says_how_to_send_it(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    content_type: str | None,
) -> None:
    """curl -d without -H "Content-Type: application/json" (curl then says form data):
    the answer names the header. Before: "the request body must be a JSON object", for a
    body that was one."""
    headers = bearer(tokens["staff"])
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = b'{"scope":"TEAM","filters":{}}'
    response = client.post(exports_url(world.team_id), content=body, headers=headers)
    assert (response.status_code, response.json()) == (
        422,
        {"detail": "send the request body as JSON, with Content-Type: application/json"},
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
    when = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
    in_paris_summer = when.astimezone(timezone(timedelta(hours=2)))
    response = client.post(
        reminders_url(world.team_id),
        json={"ticket_id": str(ticket_id), "run_at": in_paris_summer.isoformat()},
        headers=bearer(tokens["staff2"]),
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["kind"], body["scope"], body["status"]) == ("REMINDER", "TEAM", "WAITING")
    assert body["filters"] == {"ticket_id": str(ticket_id)}
    assert body["run_at"] == when.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert response.headers["Location"] == f"/api/tasks/{body['id']}"
    row = task_row(engine, uuid.UUID(body["id"]))
    assert row["run_at"] == when and row["dispatched_at"] is None


def test_a_reminder_at_a_past_time_is_due_now(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    ticket_id: uuid.UUID,
) -> None:
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    response = client.post(
        reminders_url(world.team_id),
        json={"ticket_id": str(ticket_id), "run_at": an_hour_ago.isoformat()},
        headers=bearer(tokens["staff"]),
    )
    assert response.status_code == 201, response.text
    row = task_row(engine, uuid.UUID(response.json()["id"]))
    assert row["run_at"] == row["created_at"]  # the database's now(), not an hour ago


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
    far_ahead = (datetime.now(UTC) + timedelta(days=370)).isoformat()
    two_days_ago = (datetime.now(UTC) - timedelta(days=2)).isoformat()
    cases: list[tuple[str, Any, int, str]] = [
        ("staff", {"ticket_id": ticket, "run_at": "2030-05-01T10:00:00"}, 422, service.MSG_RUN_AT),
        ("staff", {"ticket_id": ticket, "run_at": "tomorrow"}, 422, service.MSG_RUN_AT),
        ("staff", {"ticket_id": ticket, "run_at": 1893456000}, 422, service.MSG_RUN_AT),
        ("staff", {"ticket_id": ticket, "run_at": "9999-12-31T00:00:00Z"}, 422, WINDOW),
        ("staff", {"ticket_id": ticket, "run_at": "0001-01-01T00:00:00Z"}, 422, WINDOW),
        ("staff", {"ticket_id": ticket, "run_at": far_ahead}, 422, WINDOW),
        ("staff", {"ticket_id": ticket, "run_at": two_days_ago}, 422, WINDOW),
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
