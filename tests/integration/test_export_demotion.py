"""A role change committed after the export's last permission check and before its
completion stops the CSV (docs/design.md, "Permissions"): the completion statement
itself requires that the owner may still run the export, so the run ends FAILED with the
fixed reason, no CSV is kept, and the audit trail says CLAIM, FAIL. Real in-process
worker, the interleaving forced by the gate after the worker's last check
(``export.before_result_write``); both ways the completion sends its CSV (one literal,
or staged through a temporary table) are covered.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from celery import Celery

from harness.factories import World, add_tickets, audit_events, set_role, task_row
from harness.waiting import wait_for
from ledger import service
from ledger.permissions import MSG_CREATOR_LEFT, MSG_CREATOR_NOT_STAFF
from teamdesk import hooks
from tests.support.gates import Gate
from tests.support.queues import send_message
from tests.support.workers import running_worker


def export_by(engine: sa.Engine, world: World, user: uuid.UUID, scope: str) -> uuid.UUID:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 30)
        return service.create_export(conn, world.team_id, user, scope, {})


@pytest.mark.parametrize(
    ("scope", "new_role", "reason"),
    [("TEAM", "CUSTOMER", MSG_CREATOR_NOT_STAFF), ("TEAM", None, MSG_CREATOR_LEFT)],
    ids=["demoted", "removed"],
)
def test_a_role_change_just_before_the_write_stops_the_csv(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    scope: str,
    new_role: str | None,
    reason: str,
) -> None:
    task_id = export_by(engine, world, world.staff_id, scope)
    checked = Gate("the worker's last permission check passed")
    with running_worker(celery_app), hooks.installed("export.before_result_write", checked.hook()):
        try:
            send_message(celery_app, task_id, 0, "EXPORT")
            checked.wait_reached()
            with engine.begin() as conn:
                set_role(conn, world.team_id, world.staff_id, new_role)
        finally:
            checked.release()
        wait_for(lambda: task_row(engine, task_id)["status"] != "RUNNING", what="the end")

    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"]) == ("FAILED", reason)
    assert (row["result_csv"], row["expires_at"], row["execution_id"]) == (None, None, None)
    assert row["progress"] < 100
    assert audit_events(engine, task_id) == ["CLAIM", "FAIL"]


def test_a_role_change_that_still_permits_the_export_lets_it_complete(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    """A MINE export's owner demoted to customer may still export their own tickets: the
    condition is the permission rule, not "nothing changed"."""
    task_id = export_by(engine, world, world.staff_id, "MINE")
    checked = Gate("the worker's last permission check passed")
    with running_worker(celery_app), hooks.installed("export.before_result_write", checked.hook()):
        try:
            send_message(celery_app, task_id, 0, "EXPORT")
            checked.wait_reached()
            with engine.begin() as conn:
                set_role(conn, world.team_id, world.staff_id, "CUSTOMER")
        finally:
            checked.release()
        wait_for(lambda: task_row(engine, task_id)["status"] != "RUNNING", what="the end")
    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"]) == ("COMPLETED", None)
    assert row["result_csv"] is not None and row["expires_at"] is not None
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
