"""The routes on existing tasks, in-process against real PostgreSQL.

Listing a team's tasks (who sees what, newest first, never the CSV, the limit's bounds),
reading one task, retry and cancel (accepted, or refused by state or a demoted creator,
with the row untouched), and the CSV download (its headers; 409 until the export
completes; 410 once expired or purged).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api import downloads
from api.errors import MSG_LIMIT, MSG_TASK_NOT_FOUND, MSG_TEAM_NOT_FOUND
from api.tasks import MSG_EXPIRED, MSG_NOT_AN_EXPORT, MSG_NOT_COMPLETED
from harness.factories import World, add_ticket, set_role, task_row
from ledger import permissions, service
from ledger.tokens import TokenOwner, resolve_token
from tests.support.api_helpers import bearer, task_in_state

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


def test_the_list_pages_with_next_through_every_task(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """Past the first page: each full page names its last task as ``next``, and
    ``?before=`` it gives the next older page, down to the last (``next`` null). Before,
    the list stopped at 200 with no way on."""
    created = [task_in_state(engine, world, "WAITING") for _ in range(5)]
    with engine.begin() as conn:  # same created_at for two: the id breaks the tie
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET created_at = now() - interval '1 hour' "
                "WHERE id = ANY(:ids)"
            ),
            {"ids": created[:2]},
        )
    url = f"/api/teams/{world.team_id}/tasks?limit=2"
    seen: list[str] = []
    pages = 0
    query = url
    while True:
        body = client.get(query, headers=bearer(tokens["staff"])).json()
        pages += 1
        seen += [task["id"] for task in body["tasks"]]
        if body["next"] is None:
            break
        assert body["next"] == body["tasks"][-1]["id"]
        query = f"{url}&before={body['next']}"
    newest_first = [str(t) for t in reversed(created[2:])]
    oldest_two = sorted((str(t) for t in created[:2]), reverse=True)
    assert seen == newest_first + oldest_two
    assert pages == 3
    other = client.get(f"{url}&before={uuid.uuid4()}", headers=bearer(tokens["staff"]))
    assert (other.status_code, other.json()) == (200, {"tasks": [], "next": None})


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
    body = response.json()
    run_at = datetime.fromisoformat(body.pop("run_at").replace("Z", "+00:00"))
    assert (response.status_code, body) == (
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
    assert run_at == row["run_at"]


def test_a_retried_scheduled_reminder_is_ready_now_and_the_answer_says_so(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """The rule is kept (a retry is ready at once) and said: the answer's run_at is now,
    not the reminder's scheduled time a day ahead."""
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff2_id)
        task_id = service.create_reminder(
            conn, world.team_id, world.staff_id, ticket, datetime.now(UTC) + timedelta(days=1)
        )
        service.cancel(conn, task_id, world.staff_id)
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
    response = client.post(f"/api/tasks/{task_id}/retry", headers=bearer(tokens["staff"]))
    assert response.status_code == 202
    run_at = datetime.fromisoformat(response.json()["run_at"].replace("Z", "+00:00"))
    assert now <= run_at == task_row(engine, task_id)["run_at"] < now + timedelta(minutes=1)


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


@pytest.mark.parametrize("new_role", ["CUSTOMER", None])
def test_a_team_export_follows_its_creators_role_at_read_time(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    new_role: str | None,
) -> None:
    """Staff created a whole-team export; once demoted (or removed) they no longer see it,
    its CSV or its place in the list; other staff still do."""
    task_id = task_in_state(engine, world, "COMPLETED", owner_id=world.staff_id)
    with engine.begin() as conn:
        set_role(conn, world.team_id, world.staff_id, new_role)
    creator = bearer(tokens["staff"])
    for suffix in ("", "/csv", "/retry", "/cancel"):
        method = "POST" if suffix in ("/retry", "/cancel") else "GET"
        response = client.request(method, f"/api/tasks/{task_id}{suffix}", headers=creator)
        assert (response.status_code, response.json()) == (404, {"detail": MSG_TASK_NOT_FOUND})
    listed = client.get(f"/api/teams/{world.team_id}/tasks", headers=creator)
    if new_role is None:
        assert listed.status_code == 404  # no longer a member of the team
    else:
        assert [t["id"] for t in listed.json()["tasks"]] == []
    assert (
        client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff2"])).status_code == 200
    )
    assert task_row(engine, task_id)["status"] == "COMPLETED"


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


@pytest.mark.parametrize("state", ["WAITING", "RUNNING"])  # ended: test_api_error_wording.py
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
        "result_key = NULL",  # purged by the dispatcher
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


def tokens_owner(engine: sa.Engine, raw: str) -> TokenOwner:
    with engine.begin() as conn:
        owner = resolve_token(conn, raw)
    assert owner is not None
    return owner


def test_a_download_gives_its_slot_back_however_its_body_ends(
    engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """api/downloads.py: read to the end, closed half-read, dropped before its first chunk
    was asked for (a client gone at once: the body never ran), or gone before it started
    (410): each gives its slot back, once."""
    task_id = task_in_state(engine, world, "COMPLETED", csv=CSV)
    owner = tokens_owner(engine, tokens["staff"])
    with engine.connect() as conn:
        _, stored = service.read_csv(conn, task_id, world.staff_id)
    assert stored is not None
    slots = downloads.Slots(total=3, per_token=3)
    held = []
    for _ in range(3):
        assert slots.take(owner.token_id)
        body = downloads.start(engine, stored, slots, owner)
        assert body is not None
        held.append(body)
    del body
    whole = b"".join(held[0])
    next(held[1])
    held[1].close()
    held[1].close()
    in_use = slots.in_use()
    del held[2]
    dropped = slots.in_use()
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE background_tasks SET result_key = NULL WHERE id = :id"), {"id": task_id}
        )
    assert slots.take(owner.token_id)
    gone = downloads.start(engine, stored, slots, owner)
    assert (whole, in_use, dropped, gone, slots.in_use()) == (CSV.encode(), 1, 0, None, 0)
