"""Create, manual retry and cancel (docs/design.md, "Lifecycle") against real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from harness.factories import World, add_ticket, insert_task, set_role, task_row
from ledger import lease, service
from ledger.errors import (
    InvalidFilters,
    InvalidInput,
    InvalidState,
    LeaseLost,
    LedgerError,
    NotAllowed,
    NotFound,
)


def count_tasks(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM background_tasks")).scalar_one())


def failed_task(
    engine: sa.Engine,
    world: World,
    *,
    scope: str = "TEAM",
    owner: uuid.UUID | None = None,
    kind: str = "EXPORT",
) -> uuid.UUID:
    """A task that ran and failed on its last attempt, with every resettable field set."""
    with engine.begin() as conn:
        task_id = insert_task(
            conn, world, scope=scope, owner_id=owner, kind=kind, filters={"status": ["OPEN"]}
        )
        held = lease.claim(conn, task_id, 0, "host/a")
        assert held is not None
        lease.report_progress(conn, held.lease, 60, 30.0)
        assert lease.report_failure(conn, held.lease, final=True, message="Export failed.")
        conn.execute(
            sa.text("""UPDATE background_tasks SET result_summary = 'partial',
            expires_at = now(), recoveries = 2, dispatched_at = now(),
            run_at = now() - interval '1 day' WHERE id = :id"""),
            {"id": task_id},
        )
    return task_id


# --- create --------------------------------------------------------------------------


def test_create_export_writes_a_waiting_row(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = service.create_export(
            conn, world.team_id, world.customer_id, "MINE", {"status": ["OPEN"], "q": "printer"}
        )
    row = task_row(engine, task_id)
    assert (row["kind"], row["scope"], row["status"], row["run"], row["attempts"]) == (
        "EXPORT",
        "MINE",
        "WAITING",
        0,
        0,
    )
    assert row["owner_id"] == world.customer_id and row["team_id"] == world.team_id
    assert row["filters"] == {"status": ["OPEN"], "q": "printer"}
    assert row["execution_id"] is None and row["dispatched_at"] is None


@pytest.mark.parametrize(
    ("user", "scope", "filters", "error"),
    [
        ("outsider_id", "MINE", {}, NotFound),
        ("customer_id", "TEAM", {}, NotAllowed),
        ("staff_id", "ALL", {}, InvalidInput),
        ("staff_id", "TEAM", {"colour": "red"}, InvalidFilters),
        ("staff_id", "TEAM", {"status": ["SOLVED"]}, InvalidFilters),
        ("staff_id", "TEAM", {"created_from": "2026-13-01"}, InvalidFilters),
        (
            "staff_id",
            "TEAM",
            {"created_from": "2026-02-01", "created_to": "2026-01-01"},
            InvalidFilters,
        ),
        ("staff_id", "TEAM", {"q": "x" * 201}, InvalidFilters),
        ("staff_id", "TEAM", ["status"], InvalidFilters),
    ],
)
def test_create_export_refusals_write_nothing(
    engine: sa.Engine,
    world: World,
    user: str,
    scope: str,
    filters: object,
    error: type[LedgerError],
) -> None:
    with pytest.raises(error), engine.begin() as conn:
        service.create_export(conn, world.team_id, getattr(world, user), scope, filters)
    assert count_tasks(engine) == 0


def test_create_reminder(engine: sa.Engine, world: World) -> None:
    when = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
        task_id = service.create_reminder(conn, world.team_id, world.staff_id, str(ticket), when)
    row = task_row(engine, task_id)
    assert (row["kind"], row["scope"], row["filters"], row["run_at"]) == (
        "REMINDER",
        "TEAM",
        {"ticket_id": str(ticket)},
        when,
    )


def test_create_reminder_refusals_write_nothing(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id)
    cases: list[tuple[uuid.UUID, object, datetime | None, type[LedgerError]]] = [
        (world.customer_id, ticket, None, NotAllowed),
        (world.outsider_id, ticket, None, NotFound),
        (world.staff_id, "not-a-uuid", None, InvalidInput),
        (world.staff_id, uuid.uuid4(), None, InvalidInput),
        (world.staff_id, ticket, datetime(2030, 1, 1), InvalidInput),
    ]
    for user, ticket_id, run_at, error in cases:
        with pytest.raises(error), engine.begin() as conn:
            service.create_reminder(conn, world.team_id, user, ticket_id, run_at)
    assert count_tasks(engine) == 0


# --- manual retry matrix ------------------------------------------------------------


def test_retry_by_owner_opens_a_new_run_and_resets_every_field(
    engine: sa.Engine, world: World
) -> None:
    task_id = failed_task(engine, world)
    before = task_row(engine, task_id)
    with engine.begin() as conn:
        assert service.retry(conn, task_id, world.staff_id) == 1
    row = task_row(engine, task_id)
    assert row["run"] == before["run"] + 1 == 1
    assert (row["status"], row["progress"], row["attempts"], row["recoveries"]) == (
        "WAITING",
        0,
        0,
        0,
    )
    for cleared in (
        "last_error",
        "execution_id",
        "lease_holder",
        "dispatched_at",
        "result_csv",
        "result_summary",
        "expires_at",
    ):
        assert row[cleared] is None, cleared
    for kept in ("id", "owner_id", "team_id", "filters", "scope", "kind", "created_at"):
        assert row[kept] == before[kept], kept
    assert row["run_at"] > before["run_at"] and row["updated_at"] > before["updated_at"]
    # A message of the old run is skipped; the new run can be claimed.
    with engine.begin() as conn:
        assert lease.claim(conn, task_id, 0, "host/a") is None
        assert lease.claim(conn, task_id, 1, "host/a") is not None


def test_retry_by_other_staff_of_a_team_task(engine: sa.Engine, world: World) -> None:
    task_id = failed_task(engine, world)
    with engine.begin() as conn:
        assert service.retry(conn, task_id, world.staff2_id) == 1


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("non_member", NotFound),
        ("customer_cannot_see", NotFound),
        ("staff_cannot_see_mine_task", NotFound),
        ("demoted_creator", NotFound),
        ("creator_demoted_other_staff_retries", NotAllowed),
        ("creator_left_team", NotAllowed),
    ],
)
def test_retry_refusals_change_nothing(
    engine: sa.Engine, world: World, case: str, error: type[LedgerError]
) -> None:
    user = world.staff_id
    if case == "non_member":
        task_id, user = failed_task(engine, world), world.outsider_id
    elif case == "customer_cannot_see":
        task_id, user = failed_task(engine, world), world.customer_id
    elif case == "staff_cannot_see_mine_task":
        task_id = failed_task(engine, world, scope="MINE", owner=world.customer_id)
    elif case == "demoted_creator":  # a TEAM task is the staff's: the creator no longer sees it
        task_id = failed_task(engine, world)
        with engine.begin() as conn:
            set_role(conn, world.team_id, world.staff_id, "CUSTOMER")
    elif case == "creator_demoted_other_staff_retries":
        task_id, user = failed_task(engine, world), world.staff2_id
        with engine.begin() as conn:
            set_role(conn, world.team_id, world.staff_id, "CUSTOMER")
    else:
        task_id, user = failed_task(engine, world), world.staff2_id
        with engine.begin() as conn:
            set_role(conn, world.team_id, world.staff_id, None)
    before = task_row(engine, task_id)
    with pytest.raises(error), engine.begin() as conn:
        service.retry(conn, task_id, user)
    assert task_row(engine, task_id) == before


def test_customer_retries_own_mine_export(engine: sa.Engine, world: World) -> None:
    task_id = failed_task(engine, world, scope="MINE", owner=world.customer_id)
    with engine.begin() as conn:
        assert service.retry(conn, task_id, world.customer_id) == 1


@pytest.mark.parametrize("status", ["WAITING", "RUNNING", "COMPLETED"])
def test_retry_only_failed_or_cancelled(engine: sa.Engine, world: World, status: str) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
        if status != "WAITING":
            held = lease.claim(conn, task_id, 0, None)
            assert held is not None
            if status == "COMPLETED":
                lease.complete_in_transaction(conn, held.lease, "done")
    before = task_row(engine, task_id)
    with pytest.raises(InvalidState), engine.begin() as conn:
        service.retry(conn, task_id, world.staff_id)
    assert task_row(engine, task_id) == before


def test_retry_of_a_cancelled_task(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
        service.cancel(conn, task_id, world.staff_id)
        assert service.retry(conn, task_id, world.staff_id) == 1
    assert task_row(engine, task_id)["status"] == "WAITING"


def test_retry_of_unknown_task(engine: sa.Engine, world: World) -> None:
    with pytest.raises(NotFound), engine.begin() as conn:
        service.retry(conn, uuid.uuid4(), world.staff_id)


# --- cancel ---------------------------------------------------------------------------


def test_cancel_waiting(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
        service.cancel(conn, task_id, world.staff_id)
    row = task_row(engine, task_id)
    assert (row["status"], row["execution_id"]) == ("CANCELLED", None)
    with engine.begin() as conn:
        assert lease.claim(conn, task_id, 0, None) is None


def test_cancel_running_revokes_the_lease(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world, kind="REMINDER")
        held = lease.claim(conn, task_id, 0, "host/a")
        assert held is not None
    with engine.begin() as conn:
        service.cancel(conn, task_id, world.staff2_id)
    cancelled = task_row(engine, task_id)
    assert (cancelled["status"], cancelled["execution_id"], cancelled["lease_holder"]) == (
        "CANCELLED",
        None,
        None,
    )
    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.report_progress(conn, held.lease, 50, 30.0)
    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.complete_export(conn, held.lease, "x", "done")
    with pytest.raises(LeaseLost), engine.begin() as conn:
        lease.complete_in_transaction(conn, held.lease, "done")
    with engine.begin() as conn:
        assert lease.report_failure(conn, held.lease, final=True, message="x") is False
    assert task_row(engine, task_id) == cancelled


def test_cancel_completed_is_refused(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
        held = lease.claim(conn, task_id, 0, None)
        assert held is not None
        lease.complete_export(conn, held.lease, "id\r\n", "0 rows")
    before = task_row(engine, task_id)
    with pytest.raises(InvalidState), engine.begin() as conn:
        service.cancel(conn, task_id, world.staff_id)
    assert task_row(engine, task_id) == before


def test_cancel_needs_visibility(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = insert_task(conn, world)
    before = task_row(engine, task_id)
    for user in (world.customer_id, world.outsider_id):
        with pytest.raises(NotFound), engine.begin() as conn:
            service.cancel(conn, task_id, user)
    assert task_row(engine, task_id) == before


# --- reading --------------------------------------------------------------------------


def test_list_and_get_respect_visibility(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        team_task = insert_task(conn, world)
        mine = insert_task(conn, world, scope="MINE", owner_id=world.customer_id)
    with engine.connect() as conn:
        staff_sees = {t.row["id"] for t in service.list_tasks(conn, world.team_id, world.staff_id)}
        customer_sees = {
            t.row["id"] for t in service.list_tasks(conn, world.team_id, world.customer_id)
        }
        assert staff_sees == {team_task}
        assert customer_sees == {mine}
        view = service.get_task(conn, mine, world.customer_id).as_dict()
        assert view["id"] == str(mine) and view["status"] == "WAITING"
        assert "result_csv" not in view and view["has_csv"] is False
        with pytest.raises(NotFound):
            service.get_task(conn, team_task, world.customer_id)
        with pytest.raises(NotFound):
            service.list_tasks(conn, world.team_id, world.outsider_id)


@pytest.mark.parametrize(
    ("kind", "scope", "creator"),
    [
        ("EXPORT", "MINE", "customer_id"),
        ("EXPORT", "TEAM", "staff_id"),
        ("REMINDER", "TEAM", "staff_id"),
    ],
)
def test_a_creation_returns_the_view_a_read_returns(
    engine: sa.Engine, world: World, kind: str, scope: str, creator: str
) -> None:
    """The API answers a creation with the insert's own RETURNING (no read-back): it must be
    the very view get_task gives the creator, in the same transaction and a later one."""
    user = getattr(world, creator)
    with engine.begin() as conn:
        if kind == "EXPORT":
            view = service.submit_export(conn, world.team_id, user, scope, {"q": "x"})
        else:
            ticket = add_ticket(conn, world.team_id, world.customer_id)
            view = service.submit_reminder(conn, world.team_id, user, str(ticket))
        assert view.as_dict() == service.get_task(conn, view.id, user).as_dict()
    with engine.begin() as conn:
        later = service.get_task(conn, view.id, user).as_dict()
    same = {k: v for k, v in later.items() if k != "waiting_s"}  # it grows with the clock
    assert {k: v for k, v in view.as_dict().items() if k != "waiting_s"} == same
    assert (view.row["kind"], view.row["scope"], view.row["status"]) == (kind, scope, "WAITING")
    assert view.row["waiting_s"] == 0 and view.row["has_csv"] is False
