"""A creation in one statement (ledger/creation.py) refuses what the rules refuse, says
which rule refused, writes nothing when it does, and answers the task's view.

Each case sets up the team, then asks both ways: on an autocommit connection (as the API
asks), and in a transaction (as the CLI asks).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from harness.factories import World, add_ticket, insert_task
from harness.waiting import wait_for
from ledger import service
from ledger.errors import (
    ExportQuotaExceeded,
    InvalidInput,
    NotAllowed,
    NotFound,
    TeamQuotaExceeded,
)
from ledger.permissions import MSG_REMINDER_NEEDS_STAFF
from ledger.quota import NO_CAP, NO_EXPORT_QUOTA, ExportQuota
from ledger.service import MSG_RUN_AT_WINDOW, MSG_TEAM_NOT_FOUND, MSG_TICKET
from teamdesk.db import autocommit

Setup = Callable[[sa.Engine, World], None]


def _nothing(_engine: sa.Engine, _world: World) -> None:
    return None


def _unfinished(n: int) -> Setup:
    def setup(engine: sa.Engine, world: World) -> None:
        with engine.begin() as conn:
            for _ in range(n):
                insert_task(conn, world)

    return setup


def _exports_today(n: int, result_bytes: int) -> Setup:
    """``n`` finished exports created now, each holding ``result_bytes`` of CSV."""

    def setup(engine: sa.Engine, world: World) -> None:
        with engine.begin() as conn:
            for _ in range(n):
                task_id = insert_task(conn, world)
                conn.execute(
                    sa.text(
                        "UPDATE background_tasks SET status = 'COMPLETED', result_bytes = :b"
                        " WHERE id = :id"
                    ),
                    {"b": result_bytes, "id": task_id},
                )

    return setup


TOO_MANY = ExportQuotaExceeded

EXPORT_CASES: list[tuple[str, str, str, Setup, int, ExportQuota, type[Exception] | None]] = [
    # id, who, scope, setup, cap, quota, the sequential path's refusal
    ("staff-team", "staff", "TEAM", _nothing, NO_CAP, NO_EXPORT_QUOTA, None),
    ("customer-team", "customer", "TEAM", _nothing, NO_CAP, NO_EXPORT_QUOTA, NotAllowed),
    ("customer-mine", "customer", "MINE", _nothing, NO_CAP, NO_EXPORT_QUOTA, None),
    ("outsider", "outsider", "TEAM", _nothing, NO_CAP, NO_EXPORT_QUOTA, NotFound),
    ("outsider-mine", "outsider", "MINE", _nothing, NO_CAP, NO_EXPORT_QUOTA, NotFound),
    ("at-cap", "staff", "TEAM", _unfinished(2), 2, NO_EXPORT_QUOTA, TeamQuotaExceeded),
    ("under-cap", "staff", "TEAM", _unfinished(2), 3, NO_EXPORT_QUOTA, None),
    ("per-day", "staff", "MINE", _exports_today(2, 0), NO_CAP, ExportQuota(2, 0), TOO_MANY),
    ("under-per-day", "staff", "MINE", _exports_today(1, 0), NO_CAP, ExportQuota(2, 0), None),
    ("bytes", "staff", "TEAM", _exports_today(1, 95), NO_CAP, ExportQuota(0, 100, 10), TOO_MANY),
    ("under-bytes", "staff", "TEAM", _exports_today(2, 40), NO_CAP, ExportQuota(0, 100, 20), None),
    # Unfinished exports hold their reservation (the most one CSV may be).
    ("reserved", "staff", "TEAM", _unfinished(2), NO_CAP, ExportQuota(0, 100, 40), TOO_MANY),
    ("reserved-room", "staff", "TEAM", _unfinished(2), NO_CAP, ExportQuota(0, 120, 40), None),
    ("both-on", "staff", "TEAM", _exports_today(2, 40), 5, ExportQuota(3, 100, 10), None),
    ("cap-first", "customer", "TEAM", _unfinished(2), 2, ExportQuota(1, 1), NotAllowed),
]  # fmt: skip


def _user(world: World, who: str) -> uuid.UUID:
    return {
        "staff": world.staff_id,
        "customer": world.customer_id,
        "outsider": world.outsider_id,
    }[who]


def _count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM background_tasks")).scalar_one())


def _view(engine: sa.Engine, task_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        return service.read_task_as_operator(conn, task_id).as_dict()


@pytest.mark.parametrize(
    ("who", "scope", "setup", "cap", "quota", "refusal"),
    [case[1:] for case in EXPORT_CASES],
    ids=[case[0] for case in EXPORT_CASES],
)
def test_an_export_in_one_statement_refuses_what_the_rules_refuse(
    engine: sa.Engine,
    world: World,
    who: str,
    scope: str,
    setup: Setup,
    cap: int,
    quota: ExportQuota,
    refusal: type[Exception] | None,
) -> None:
    setup(engine, world)
    user = _user(world, who)
    before = _count(engine)
    if refusal is None:
        with autocommit(engine) as conn:
            task = service.submit_export(conn, world.team_id, user, scope, {}, cap, quota)
        assert _count(engine) == before + 1
        assert task.as_dict() == {**_view(engine, task.id), "waiting_s": task.row["waiting_s"]}
        assert (task.row["status"], task.row["kind"], task.row["scope"]) == (
            "WAITING",
            "EXPORT",
            scope,
        )
        assert str(task.row["owner_id"]) == str(user)
        return
    with pytest.raises(refusal), autocommit(engine) as conn:
        service.submit_export(conn, world.team_id, user, scope, {}, cap, quota)
    assert _count(engine) == before  # nothing written
    with pytest.raises(refusal), engine.begin() as conn:
        service.submit_export(conn, world.team_id, user, scope, {}, cap, quota)
    assert _count(engine) == before


def _ticket_elsewhere(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        other = conn.execute(
            sa.text("SELECT team_id FROM memberships WHERE user_id = :u"), {"u": world.outsider_id}
        ).scalar_one()
        return add_ticket(conn, other, world.outsider_id)


REMINDER_CASES: list[tuple[str, str, str, timedelta | None, int, Exception | None]] = [
    # id, who, whose ticket, run_at from the database's now, cap, refusal
    ("staff", "staff", "team", None, NO_CAP, None),
    ("later", "staff", "team", timedelta(hours=1), NO_CAP, None),
    ("a-little-late", "staff", "team", timedelta(hours=-1), NO_CAP, None),
    ("customer", "customer", "team", None, NO_CAP, NotAllowed(MSG_REMINDER_NEEDS_STAFF)),
    ("outsider", "outsider", "team", None, NO_CAP, NotFound(MSG_TEAM_NOT_FOUND)),
    ("ticket-elsewhere", "staff", "elsewhere", None, NO_CAP, InvalidInput(MSG_TICKET)),
    ("too-late", "staff", "team", timedelta(days=-2), NO_CAP, InvalidInput(MSG_RUN_AT_WINDOW)),
    ("too-far", "staff", "team", timedelta(days=400), NO_CAP, InvalidInput(MSG_RUN_AT_WINDOW)),
    ("at-cap", "staff", "team", None, 1, TeamQuotaExceeded()),
    # The first rule that refuses is told: the time before who asks, who before the ticket.
    ("late-customer", "customer", "team", timedelta(days=-2), 0, InvalidInput(MSG_RUN_AT_WINDOW)),
    ("customer-elsewhere", "customer", "elsewhere", None, 1, NotAllowed(MSG_REMINDER_NEEDS_STAFF)),
    ("elsewhere-at-cap", "staff", "elsewhere", None, 1, InvalidInput(MSG_TICKET)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("who", "whose", "offset", "cap", "refusal"),
    [case[1:] for case in REMINDER_CASES],
    ids=[case[0] for case in REMINDER_CASES],
)
def test_a_reminder_in_one_statement_refuses_what_the_rules_refuse(
    engine: sa.Engine,
    world: World,
    who: str,
    whose: str,
    offset: timedelta | None,
    cap: int,
    refusal: Exception | None,
) -> None:
    if whose == "team":
        with engine.begin() as conn:
            ticket = add_ticket(conn, world.team_id, world.customer_id)
    else:
        ticket = _ticket_elsewhere(engine, world)
    if cap:
        _unfinished(cap)(engine, world)
    run_at: datetime | None = None
    if offset is not None:
        with engine.connect() as conn:
            run_at = conn.execute(sa.text("SELECT now()")).scalar_one() + offset
    user = _user(world, who)
    before = _count(engine)
    if refusal is None:
        with autocommit(engine) as conn:
            task = service.submit_reminder(conn, world.team_id, user, ticket, run_at, cap)
        assert _count(engine) == before + 1
        row = task.row
        assert (row["kind"], row["scope"], row["status"]) == ("REMINDER", "TEAM", "WAITING")
        assert row["filters"] == {"ticket_id": str(ticket)}
        if offset is not None and offset > timedelta(0):
            assert row["run_at"] == run_at  # scheduled for then
        else:  # now, or a time in the past: now
            assert row["run_at"] == row["created_at"]
        return
    for asking in (autocommit(engine), engine.begin()):
        with pytest.raises(type(refusal)) as raised, asking as conn:
            service.submit_reminder(conn, world.team_id, user, ticket, run_at, cap)
        assert str(raised.value) == str(refusal)
        assert _count(engine) == before  # nothing written


def test_the_autocommit_checkout_returns_the_connection_as_the_pool_made_it(
    engine: sa.Engine, world: World
) -> None:
    """The driver connection is switched back before it returns: the next checkout's
    transaction is a transaction again (a rollback takes its insert back)."""
    with autocommit(engine) as conn:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None and dbapi.autocommit
        service.submit_export(conn, world.team_id, world.staff_id, "TEAM", {})
    assert not dbapi.autocommit
    before = _count(engine)
    with engine.connect() as conn:
        assert conn.connection.dbapi_connection is dbapi  # the same pooled connection
        service.submit_export(conn, world.team_id, world.staff_id, "TEAM", {})
        conn.rollback()
    assert _count(engine) == before


def _notifications_until_marker(listener: Any, engine: sa.Engine) -> list[str]:
    """The channels notified before a marker notification sent now: notifications come
    in commit order, so everything committed before the marker has arrived with it."""
    with engine.connect() as conn:
        conn.exec_driver_sql("NOTIFY teamdesk_test_marker")
        conn.commit()
    channels: list[str] = []

    def marker_arrived() -> bool:
        listener.poll()
        while listener.notifies:
            channels.append(listener.notifies.pop(0).channel)
        return "teamdesk_test_marker" in channels

    wait_for(marker_arrived, what="the marker notification")
    return channels[: channels.index("teamdesk_test_marker")]


def test_a_refused_creation_wakes_no_dispatcher_an_accepted_one_does(
    engine: sa.Engine, world: World
) -> None:
    """A refusal is an INSERT of no row: before migration 0010 its statement trigger
    committed a notification anyway, and the dispatcher filled for nothing at every 429."""
    listener = engine.raw_connection()
    dbapi: Any = listener.driver_connection
    try:
        dbapi.autocommit = True
        cursor = listener.cursor()
        cursor.execute("LISTEN teamdesk_dispatch")
        cursor.execute("LISTEN teamdesk_test_marker")
        with pytest.raises(NotAllowed), autocommit(engine) as conn:
            service.submit_export(conn, world.team_id, world.customer_id, "TEAM", {})
        assert _notifications_until_marker(dbapi, engine) == []
        with autocommit(engine) as conn:
            service.submit_export(conn, world.team_id, world.staff_id, "TEAM", {})
        assert _notifications_until_marker(dbapi, engine) == ["teamdesk_dispatch"]
    finally:
        dbapi.autocommit = False
        listener.close()
