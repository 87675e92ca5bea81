"""A reminder outlives its creator's demotion (docs/design.md, "Permissions"): it was
scheduled by staff for a ticket's assignee, and a demotion takes the creator's powers,
not the team's work. So it is still sent at its time, and, like every reminder, it is a
team task: the demoted creator no longer sees it, the team's other staff see it and may
cancel it. Only a creator who left the team stops it (FAILED with the reason).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa
from celery import Celery
from fastapi.testclient import TestClient

from harness.factories import (
    World,
    add_ticket,
    audit_events,
    notifications,
    set_role,
    task_row,
)
from harness.waiting import wait_for
from ledger import dispatch, service
from ledger.permissions import MSG_CREATOR_LEFT
from tests.support.api_helpers import bearer
from tests.support.dispatching import running_cluster


def scheduled_reminder(engine: sa.Engine, world: World, in_s: float) -> uuid.UUID:
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff2_id)
        run_at = dispatch.database_now(conn) + timedelta(seconds=in_s)
        return service.create_reminder(conn, world.team_id, world.staff_id, ticket, run_at)


def test_the_team_s_other_staff_see_and_may_cancel_it_the_creator_does_not(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    task_id = scheduled_reminder(engine, world, 3600)
    with engine.begin() as conn:
        set_role(conn, world.team_id, world.staff_id, "CUSTOMER")
    creator, other = bearer(tokens["staff"]), bearer(tokens["staff2"])
    assert client.get(f"/api/tasks/{task_id}", headers=creator).status_code == 404
    listed = client.get(f"/api/teams/{world.team_id}/tasks", headers=other).json()["tasks"]
    assert [(t["id"], t["status"]) for t in listed] == [(str(task_id), "WAITING")]
    assert client.post(f"/api/tasks/{task_id}/cancel", headers=other).status_code == 202
    assert task_row(engine, task_id)["status"] == "CANCELLED"
    assert audit_events(engine, task_id) == ["CANCEL"]


@pytest.mark.parametrize(
    ("new_role", "status", "sent"), [("CUSTOMER", "COMPLETED", 1), (None, "FAILED", 0)]
)
def test_it_is_sent_at_its_time_unless_the_creator_left(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    new_role: str | None,
    status: str,
    sent: int,
) -> None:
    task_id = scheduled_reminder(engine, world, 0.5)
    with engine.begin() as conn:
        set_role(conn, world.team_id, world.staff_id, new_role)
    assert task_row(engine, task_id)["scheduled"] is True
    with running_cluster(celery_app):
        wait_for(lambda: task_row(engine, task_id)["status"] in ("COMPLETED", "FAILED"))
    row = task_row(engine, task_id)
    assert row["status"] == status
    assert row["last_error"] == (None if sent else MSG_CREATOR_LEFT)
    assert notifications(engine, task_id) == sent
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE" if sent else "FAIL"]
