"""The per-team cap on unfinished tasks (``TEAM_MAX_UNFINISHED``, ledger/quota.py), in
process against real PostgreSQL: creations and retries past the cap answer 429 with
``Retry-After`` and write nothing, finished tasks free room, other teams are not
affected, and two creations racing at ``cap - 1`` cannot both get in."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from harness.factories import World, add_member, add_ticket, add_user, task_row
from harness.waiting import wait_for
from ledger import service
from ledger.errors import MSG_TEAM_FULL, TeamQuotaExceeded
from teamdesk.config import Settings
from tests.support.api_helpers import (
    api_client,
    bearer,
    count_tasks,
    exports_url,
    reminders_url,
    task_in_state,
    waiting_on_a_team_lock,
)

CAP = 3
TEAM_EXPORT = {"scope": "TEAM"}
RACE_TIMEOUT_S = 20.0


@pytest.fixture
def capped(settings: Settings) -> Iterator[TestClient]:
    with api_client(settings.with_overrides(team_max_unfinished=CAP)) as test_client:
        yield test_client


def assert_team_full(response: Any) -> None:
    assert response.status_code == 429, response.text
    assert response.json() == {"detail": MSG_TEAM_FULL}
    assert int(response.headers["Retry-After"]) > 0


def _ledger(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, status, run FROM background_tasks ORDER BY id"))
        return [tuple(row) for row in rows]


def test_creations_past_the_cap_answer_429_and_write_nothing(
    capped: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    team_exports = exports_url(world.team_id)
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, "printer")
    reminder = {"ticket_id": str(ticket)}
    task_in_state(engine, world, "RUNNING")  # running tasks count too
    assert capped.post(team_exports, json=TEAM_EXPORT, headers=staff).status_code == 201
    created = capped.post(reminders_url(world.team_id), json=reminder, headers=staff)
    assert created.status_code == 201
    before = _ledger(engine)

    assert_team_full(capped.post(team_exports, json=TEAM_EXPORT, headers=staff))
    assert_team_full(capped.post(reminders_url(world.team_id), json=reminder, headers=staff))
    customer = bearer(tokens["customer"])  # the cap is the team's, whoever asks
    assert_team_full(capped.post(team_exports, json={"scope": "MINE"}, headers=customer))
    assert _ledger(engine) == before


def test_finished_tasks_free_room_and_other_teams_are_not_affected(
    capped: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    for status in ("COMPLETED", "FAILED", "CANCELLED"):  # finished: not counted
        task_in_state(engine, world, status)
    waiting = [task_in_state(engine, world, "WAITING") for _ in range(CAP)]
    assert_team_full(capped.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff))

    with engine.begin() as conn:
        other_team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES ('Other') RETURNING id")
        ).scalar_one()
        add_member(conn, other_team, world.staff_id, "STAFF")
    other = capped.post(exports_url(other_team), json=TEAM_EXPORT, headers=staff)
    assert other.status_code == 201, other.text

    cancelled = capped.post(f"/api/tasks/{waiting[0]}/cancel", headers=staff)
    assert cancelled.status_code == 202  # cancel is never capped, and it frees room
    again = capped.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
    assert again.status_code == 201, again.text


def test_a_retry_past_the_cap_answers_429_and_leaves_the_task_as_it_was(
    capped: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    failed = task_in_state(engine, world, "FAILED")
    for _ in range(CAP):
        task_in_state(engine, world, "WAITING")
    before = task_row(engine, failed)
    assert_team_full(capped.post(f"/api/tasks/{failed}/retry", headers=staff))
    assert task_row(engine, failed) == before
    with engine.connect() as conn:
        audit = conn.execute(sa.text("SELECT count(*) FROM task_audit WHERE event = 'RETRY'"))
        assert audit.scalar_one() == 0


def test_zero_turns_the_cap_off(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    for _ in range(CAP):
        task_in_state(engine, world, "WAITING")
    staff = bearer(tokens["staff"])
    with api_client(settings.with_overrides(team_max_unfinished=CAP)) as capped:
        assert_team_full(capped.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff))
    with api_client(settings.with_overrides(team_max_unfinished=0)) as uncapped:
        response = uncapped.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
    assert response.status_code == 201, response.text
    assert count_tasks(engine) == CAP + 1


# --- concurrency ------------------------------------------------------------------------


def _unfinished(engine: sa.Engine, team_id: uuid.UUID) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM background_tasks WHERE team_id = :t"
                    " AND status IN ('WAITING', 'RUNNING')"
                ),
                {"t": team_id},
            ).scalar_one()
        )


@pytest.mark.parametrize("second", ["export", "retry"])
def test_two_creations_racing_at_cap_minus_one_let_exactly_one_in(
    engine: sa.Engine, world: World, second: str
) -> None:
    """The first creation has counted and inserted, not yet committed; the second starts
    then. Without a lock it would count the same ``cap - 1`` (the first insert is not
    visible to it) and get in too: the lock makes it wait, count after the commit and
    be refused."""
    failed = task_in_state(engine, world, "FAILED")
    for _ in range(CAP - 1):
        task_in_state(engine, world, "WAITING")
    outcome: dict[str, object] = {}

    def create_second() -> None:
        try:
            with engine.begin() as conn:
                if second == "export":
                    service.create_export(conn, world.team_id, world.staff_id, "TEAM", {}, CAP)
                else:
                    service.retry(conn, failed, world.staff_id, max_unfinished=CAP)
            outcome["second"] = "in"
        except TeamQuotaExceeded:
            outcome["second"] = "refused"

    racer = threading.Thread(target=create_second)
    with engine.connect() as first:
        service.create_export(first, world.team_id, world.staff_id, "TEAM", {}, CAP)
        racer.start()  # the first one's row exists, uncommitted
        wait_for(
            lambda: not racer.is_alive() or waiting_on_a_team_lock(engine),
            timeout=RACE_TIMEOUT_S,
            what="the second creation to finish or wait for the team's lock",
        )
        first.commit()
    racer.join(RACE_TIMEOUT_S)
    assert outcome == {"second": "refused"}
    assert _unfinished(engine, world.team_id) == CAP
    assert task_row(engine, failed)["status"] == "FAILED"


def test_the_lock_is_per_team(engine: sa.Engine, world: World) -> None:
    """A creation holding its team's lock does not hold up another team's creation."""
    with engine.begin() as conn:
        other_team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES ('Other') RETURNING id")
        ).scalar_one()
        other_staff = add_user(conn, "Other")
        add_member(conn, other_team, other_staff, "STAFF")
    with engine.connect() as first:
        service.create_export(first, world.team_id, world.staff_id, "TEAM", {}, CAP)
        with engine.connect() as other:
            other.execute(sa.text("SET LOCAL lock_timeout = '5s'"))  # detects a wait
            service.create_export(other, other_team, other_staff, "TEAM", {}, CAP)
            other.commit()
        first.commit()
    assert count_tasks(engine) == 2
