"""Idempotency keys through the HTTP API (ledger/idempotency.py, docs/design.md
"Idempotent requests"), in-process against real PostgreSQL and Redis, as the API's role.

The same ``Idempotency-Key`` with the same request answers the task the first created
(``Idempotent-Replayed: true``) and writes nothing; with another request it answers 422
and writes nothing; concurrent requests with one key create one task, decided by the
database's primary key; a key lives 24 hours by the database's clock, per team.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from fastapi.testclient import TestClient

from api.deps import MSG_TOKEN_RATE
from dispatcher.scan import run_once
from harness.factories import World, add_ticket, audit_events, set_role, task_row
from harness.waiting import wait_for
from ledger import creation, idempotency, permissions, service
from ledger.errors import MSG_TEAM_FULL
from ledger.idempotency import MSG_KEY, MSG_KEY_REUSED
from ledger.quota import NO_EXPORT_QUOTA
from teamdesk.config import Settings
from tests.support.api_helpers import (
    api_client,
    bearer,
    count_tasks,
    exports_url,
    reminders_url,
    task_in_state,
)

FILTERS: dict[str, Any] = {"status": ["OPEN"]}
EXPORT = {"scope": "TEAM", "filters": FILTERS}
REPLAYED = "Idempotent-Replayed"
CONCURRENT = 8


def keyed(token: str, key: str) -> dict[str, str]:
    return {**bearer(token), "Idempotency-Key": key}


def post_export(
    client: TestClient, team_id: uuid.UUID, token: str, key: str, body: Any = EXPORT
) -> Any:
    return client.post(exports_url(team_id), json=body, headers=keyed(token, key))


def age_keys(engine: sa.Engine, interval: str, key: str | None = None) -> None:
    """Make keys (all, or ``key``) ``interval`` old by the database's clock."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET created_at = now() - CAST(:age AS interval)"
                " WHERE CAST(:key AS text) IS NULL OR key = :key"
            ),
            {"age": interval, "key": key},
        )


def key_rows(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT team_id, key, user_id, task_id, run FROM idempotency_keys ORDER BY 2")
        )
        return [dict(row._mapping) for row in rows]


def a_ticket(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)


def other_team(engine: sa.Engine, world: World) -> uuid.UUID:
    """The team the world's outsider is staff of."""
    with engine.connect() as conn:
        return uuid.UUID(
            str(
                conn.execute(
                    sa.text("SELECT team_id FROM memberships WHERE user_id = :u"),
                    {"u": world.outsider_id},
                ).scalar_one()
            )
        )


def test_the_same_request_twice_answers_the_first_task_and_writes_nothing(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    key = str(uuid.uuid4())
    first = post_export(client, world.team_id, tokens["staff"], key)
    assert first.status_code == 201, first.text
    assert REPLAYED not in first.headers
    keys, row = key_rows(engine), task_row(engine, uuid.UUID(first.json()["id"]))

    again = post_export(client, world.team_id, tokens["staff"], key)
    assert again.status_code == 201, again.text
    assert again.headers[REPLAYED] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    assert again.json() == first.json()  # the same task, still WAITING
    assert count_tasks(engine) == 1
    assert (
        key_rows(engine)
        == keys
        == [
            {
                "team_id": world.team_id,
                "key": key,
                "user_id": world.staff_id,
                "task_id": uuid.UUID(first.json()["id"]),
                "run": 0,
            }
        ]
    )
    assert task_row(engine, uuid.UUID(first.json()["id"])) == row  # nothing written to it


def test_a_reminder_replays_its_instant_in_any_time_zone(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    ticket = a_ticket(engine, world)
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)
    key = "reminder-" + uuid.uuid4().hex
    url, headers = reminders_url(world.team_id), keyed(tokens["staff"], key)
    first = client.post(
        url, json={"ticket_id": str(ticket), "run_at": when.isoformat()}, headers=headers
    )
    paris = when.astimezone(timezone(timedelta(hours=1))).isoformat()
    again = client.post(url, json={"ticket_id": str(ticket), "run_at": paris}, headers=headers)
    later = client.post(
        url,
        json={"ticket_id": str(ticket), "run_at": (when + timedelta(minutes=1)).isoformat()},
        headers=headers,
    )
    assert (first.status_code, again.status_code) == (201, 201), again.text
    assert again.headers[REPLAYED] == "true" and again.json()["id"] == first.json()["id"]
    assert (later.status_code, later.json()) == (422, {"detail": MSG_KEY_REUSED})
    assert count_tasks(engine) == 1


@pytest.mark.parametrize(
    ("route", "body", "user"),
    [
        ("exports", {"scope": "TEAM", "filters": {"status": ["CLOSED"]}}, "staff"),  # body
        ("exports", {"scope": "MINE", "filters": {"status": ["OPEN"]}}, "staff"),  # body
        ("exports", EXPORT, "staff2"),  # user
        ("reminders", None, "staff"),  # route
    ],
)
def test_the_key_with_another_request_answers_422_and_writes_nothing(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    route: str,
    body: dict[str, Any] | None,
    user: str,
) -> None:
    key = str(uuid.uuid4())
    first = post_export(client, world.team_id, tokens["staff"], key)
    assert first.status_code == 201
    keys = key_rows(engine)
    if route == "reminders":
        ticket = a_ticket(engine, world)
        url, body = reminders_url(world.team_id), {"ticket_id": str(ticket)}
    else:
        url = exports_url(world.team_id)
    other = client.post(url, json=body, headers=keyed(tokens[user], key))
    assert (other.status_code, other.json()) == (422, {"detail": MSG_KEY_REUSED})
    assert REPLAYED not in other.headers
    assert count_tasks(engine) == 1 and key_rows(engine) == keys


@pytest.mark.parametrize(
    "key",
    ["", "   ", "x" * (idempotency.MAX_KEY_LENGTH + 1), "two words", "key*", "a;b", "a,b", '"'],
)
def test_a_key_we_do_not_keep_answers_422_and_writes_nothing(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str], key: str
) -> None:
    response = post_export(client, world.team_id, tokens["staff"], key)
    assert (response.status_code, response.json()) == (422, {"detail": MSG_KEY})
    assert count_tasks(engine) == 0 and key_rows(engine) == []


def test_a_quoted_key_and_the_longest_are_kept(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """The draft writes the key as a structured-field string: ``"..."`` is the same key."""
    longest = "k" * idempotency.MAX_KEY_LENGTH
    url = exports_url(world.team_id)
    first = client.post(url, json=EXPORT, headers=keyed(tokens["staff"], f'"{longest}"'))
    again = client.post(url, json=EXPORT, headers=keyed(tokens["staff"], longest))
    assert (first.status_code, again.status_code, again.headers[REPLAYED]) == (201, 201, "true")
    assert [row["key"] for row in key_rows(engine)] == [longest]


def test_concurrent_requests_with_one_key_create_one_task(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    key = str(uuid.uuid4())
    start = threading.Barrier(CONCURRENT)

    def post(_: int) -> Any:
        start.wait(timeout=30)
        return post_export(client, world.team_id, tokens["staff"], key)

    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(post, range(CONCURRENT)))
    assert [a.status_code for a in answers] == [201] * CONCURRENT, [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert sorted(a.headers.get(REPLAYED, "") for a in answers) == [""] + ["true"] * 7
    assert count_tasks(engine) == 1 and len(key_rows(engine)) == 1


def test_a_request_that_races_an_uncommitted_one_waits_and_answers_its_task(
    client: TestClient, settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """Forced interleaving: another session's creation with the key is inserted and not
    committed; the API's request with the key inserts its own task, waits on the key's
    primary key (seen in pg_stat_activity), and once the first commits its statement
    fails, its task with it: it answers the first's task as a replay."""
    key = str(uuid.uuid4())
    first_key = service.export_key(key, world.team_id, world.staff_id, "TEAM", FILTERS)
    answer: list[Any] = []
    with engine.connect() as first:
        first.begin()
        created = creation.insert_export(
            first,
            world.team_id,
            world.staff_id,
            "TEAM",
            FILTERS,
            0,
            NO_EXPORT_QUOTA,
            service.TASK_COLUMNS,
            first_key,
        )
        assert created.row is not None
        racer = threading.Thread(
            target=lambda: answer.append(post_export(client, world.team_id, tokens["staff"], key))
        )
        racer.start()
        try:
            wait_for(lambda: _waits_on_a_lock(engine), timeout=30, what="the racer's lock wait")
            first.commit()
        finally:
            if first.in_transaction():
                first.rollback()
            racer.join(timeout=30)
    assert len(answer) == 1 and answer[0].status_code == 201, answer
    assert answer[0].headers[REPLAYED] == "true"
    assert answer[0].json()["id"] == str(created.row["id"])
    assert count_tasks(engine) == 1 and len(key_rows(engine)) == 1


def _waits_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE '%idempotency_keys%'"
                )
            ).scalar()
        )


def test_a_key_expires_after_24_hours_by_the_database_clock(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    key = str(uuid.uuid4())
    url, headers = exports_url(world.team_id), keyed(tokens["staff"], key)
    first = client.post(url, json=EXPORT, headers=headers)
    age_keys(engine, "1439 minutes")  # 23 h 59 min: still kept
    kept = client.post(url, json=EXPORT, headers=headers)
    age_keys(engine, "24 hours")  # gone
    fresh = client.post(url, json={**EXPORT, "scope": "MINE"}, headers=headers)
    assert (first.status_code, kept.status_code, kept.headers[REPLAYED]) == (201, 201, "true")
    assert fresh.status_code == 201 and REPLAYED not in fresh.headers
    assert fresh.json()["id"] != first.json()["id"] and count_tasks(engine) == 2
    assert [(r["key"], str(r["task_id"])) for r in key_rows(engine)] == [(key, fresh.json()["id"])]


def test_one_key_in_two_teams_is_two_keys(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    key = str(uuid.uuid4())
    elsewhere = other_team(engine, world)
    ours = post_export(client, world.team_id, tokens["staff"], key)
    theirs = post_export(client, elsewhere, tokens["outsider"], key)
    assert (ours.status_code, theirs.status_code) == (201, 201)
    assert REPLAYED not in theirs.headers and ours.json()["id"] != theirs.json()["id"]
    assert {(r["team_id"], r["key"]) for r in key_rows(engine)} == {
        (world.team_id, key),
        (elsewhere, key),
    }
    # Not a member: the team is not found, whatever the key did there.
    probe = post_export(client, elsewhere, tokens["staff"], key)
    assert probe.status_code == 404 and count_tasks(engine) == 2


def test_a_refused_creation_keeps_no_key(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """A 429 (the team's cap) writes nothing, the key's row included: once there is room,
    the same key creates the task."""
    blocker = task_in_state(engine, world, "WAITING")
    key = str(uuid.uuid4())
    with api_client(settings.with_overrides(team_max_unfinished=1)) as capped:
        full = post_export(capped, world.team_id, tokens["staff"], key)
        assert (full.status_code, full.json()) == (429, {"detail": MSG_TEAM_FULL})
        assert key_rows(engine) == [] and count_tasks(engine) == 1
        with engine.begin() as conn:
            service.cancel(conn, blocker, world.staff_id)
        made = post_export(capped, world.team_id, tokens["staff"], key)
    assert made.status_code == 201 and REPLAYED not in made.headers
    assert [str(r["task_id"]) for r in key_rows(engine)] == [made.json()["id"]]


def test_a_replay_is_charged_to_the_rate_limit(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    key = str(uuid.uuid4())
    limited = settings.with_overrides(api_rate_per_min=1, api_rate_burst=2)
    with api_client(limited) as client:
        answers = [post_export(client, world.team_id, tokens["staff"], key) for _ in range(3)]
    assert [a.status_code for a in answers] == [201, 201, 429]
    assert answers[1].headers[REPLAYED] == "true"
    assert answers[2].json() == {"detail": MSG_TOKEN_RATE}
    assert count_tasks(engine) == 1


def test_a_retry_with_its_key_opens_one_run(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    failed = task_in_state(engine, world, "FAILED")
    key = str(uuid.uuid4())
    url, headers = f"/api/tasks/{failed}/retry", keyed(tokens["staff"], key)
    first = client.post(url, headers=headers)
    with engine.begin() as conn:  # the new run is taken and cancelled meanwhile
        service.cancel(conn, failed, world.staff_id)
    again = client.post(url, headers=headers)
    fresh = client.post(url, headers=keyed(tokens["staff"], str(uuid.uuid4())))
    reused = client.post(exports_url(world.team_id), json=EXPORT, headers=headers)
    assert (first.status_code, again.status_code, fresh.status_code) == (202, 202, 202)
    assert REPLAYED not in first.headers and again.headers[REPLAYED] == "true"
    assert (first.json()["run"], again.json()["run"], fresh.json()["run"]) == (1, 1, 2)
    assert (reused.status_code, reused.json()) == (422, {"detail": MSG_KEY_REUSED})
    assert audit_events(engine, failed).count("RETRY") == 2  # the first and the fresh key's
    assert task_row(engine, failed)["run"] == 2
    assert {(str(r["task_id"]), r["run"]) for r in key_rows(engine)} == {
        (str(failed), 1),
        (str(failed), 2),
    }


def test_the_dispatcher_purge_removes_expired_keys_only(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    with engine.begin() as conn:
        for n in range(3):
            service.submit_export(
                conn, world.team_id, world.staff_id, "TEAM", {}, idempotency_key=f"k{n}"
            )
    age_keys(engine, "25 hours", "k0")
    age_keys(engine, "24 hours", "k1")
    age_keys(engine, "23 hours", "k2")
    with engine.begin() as conn:  # one at a time, oldest first
        assert idempotency.purge_expired(conn, batch=1) == 1
    assert [r["key"] for r in key_rows(engine)] == ["k1", "k2"]
    counts = run_once(celery_app)  # the scan's purge step
    assert counts.forgotten_keys == 1
    assert [r["key"] for r in key_rows(engine)] == ["k2"]
    assert count_tasks(engine) == 3  # keys go, tasks stay


def test_a_replay_by_a_user_who_lost_the_right_is_refused_as_a_new_request(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """Staff created a team export with a key, then became a customer: the replay answers
    403 as a new request would (not 404, as if the task were gone), and writes nothing."""
    key = str(uuid.uuid4())
    first = post_export(client, world.team_id, tokens["staff"], key)
    with engine.begin() as conn:
        set_role(conn, world.team_id, world.staff_id, "CUSTOMER")
    again = post_export(client, world.team_id, tokens["staff"], key)
    assert first.status_code == 201
    assert (again.status_code, again.json()) == (
        403,
        {"detail": permissions.MSG_TEAM_EXPORT_NEEDS_STAFF},
    )
    assert count_tasks(engine) == 1 and len(key_rows(engine)) == 1
