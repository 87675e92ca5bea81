"""Business rows for tests, inserted with plain SQL (the ledger's own code is under test)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine


@dataclass
class World:
    """One team with a staff member, a customer and an outsider."""

    team_id: uuid.UUID
    staff_id: uuid.UUID
    staff2_id: uuid.UUID
    customer_id: uuid.UUID
    outsider_id: uuid.UUID


def _one(conn: Connection, sql: str, **params: Any) -> Any:
    return conn.execute(sa.text(sql), params).scalar_one()


def add_user(conn: Connection, name: str) -> uuid.UUID:
    email = f"{name.lower()}-{uuid.uuid4().hex[:6]}@example.test"
    return _one(
        conn, "INSERT INTO users (email, name) VALUES (:e, :n) RETURNING id", e=email, n=name
    )


def add_member(conn: Connection, team_id: uuid.UUID, user_id: uuid.UUID, role: str) -> None:
    conn.execute(
        sa.text("INSERT INTO memberships (team_id, user_id, role) VALUES (:t, :u, :r)"),
        {"t": team_id, "u": user_id, "r": role},
    )


def set_role(conn: Connection, team_id: uuid.UUID, user_id: uuid.UUID, role: str | None) -> None:
    if role is None:
        conn.execute(
            sa.text("DELETE FROM memberships WHERE team_id = :t AND user_id = :u"),
            {"t": team_id, "u": user_id},
        )
    else:
        conn.execute(
            sa.text("UPDATE memberships SET role = :r WHERE team_id = :t AND user_id = :u"),
            {"t": team_id, "u": user_id, "r": role},
        )


def make_world(engine: Engine) -> World:
    with engine.begin() as conn:
        team = _one(conn, "INSERT INTO teams (name) VALUES ('Support') RETURNING id")
        staff, staff2 = add_user(conn, "Ada"), add_user(conn, "Grace")
        customer, outsider = add_user(conn, "Carl"), add_user(conn, "Olga")
        add_member(conn, team, staff, "STAFF")
        add_member(conn, team, staff2, "STAFF")
        add_member(conn, team, customer, "CUSTOMER")
        other = _one(conn, "INSERT INTO teams (name) VALUES ('Elsewhere') RETURNING id")
        add_member(conn, other, outsider, "STAFF")
    return World(team, staff, staff2, customer, outsider)


BASE_TIME = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def add_ticket(
    conn: Connection,
    team_id: uuid.UUID,
    requester_id: uuid.UUID,
    title: str = "T",
    *,
    status: str = "OPEN",
    priority: str = "NORMAL",
    assignee_id: uuid.UUID | None = None,
    created_at: datetime | None = None,
    due_at: datetime | None = None,
) -> uuid.UUID:
    return _one(
        conn,
        """
        INSERT INTO tickets (team_id, title, status, priority, requester_id, assignee_id,
                             due_at, created_at, updated_at)
        VALUES (:team, :title, :status, :priority, :req, :asg, :due, :created, :created)
        RETURNING id""",
        team=team_id,
        title=title,
        status=status,
        priority=priority,
        req=requester_id,
        asg=assignee_id,
        due=due_at,
        created=created_at or BASE_TIME,
    )


def add_tickets(
    conn: Connection, team_id: uuid.UUID, requester_id: uuid.UUID, count: int, title: str = "Ticket"
) -> None:
    conn.execute(
        sa.text("""
        INSERT INTO tickets (team_id, title, requester_id, created_at, updated_at)
        SELECT :team, :title || ' ' || g, :req, :base + g * interval '1 minute',
               :base + g * interval '1 minute'
          FROM generate_series(1, :n) AS g"""),
        {"team": team_id, "title": title, "req": requester_id, "base": BASE_TIME, "n": count},
    )


def insert_task(
    conn: Connection,
    world: World,
    *,
    kind: str = "EXPORT",
    scope: str = "TEAM",
    filters: dict[str, Any] | None = None,
    owner_id: uuid.UUID | None = None,
    status: str = "WAITING",
    run: int = 0,
) -> uuid.UUID:
    return _one(
        conn,
        """
        INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status, run)
        VALUES (:kind, :team, :owner, :scope, CAST(:filters AS jsonb), :status, :run)
        RETURNING id""",
        kind=kind,
        team=world.team_id,
        owner=owner_id or world.staff_id,
        scope=scope,
        filters=json.dumps(filters or {}),
        status=status,
        run=run,
    )


def task_row(engine: Engine, task_id: uuid.UUID) -> dict[str, Any]:
    """The task's row; ``result_csv`` is its stored CSV wherever it is kept (the chunks
    its completion names, ledger/artifacts.py, or the row's own column)."""
    with engine.connect() as conn:
        row = dict(
            conn.execute(sa.text("SELECT * FROM background_tasks WHERE id = :id"), {"id": task_id})
            .mappings()
            .one()
        )
        if row.get("result_key") is not None:
            row["result_csv"] = stored_csv(conn, task_id, row["result_key"])
    return row


def stored_csv(conn: Connection, task_id: uuid.UUID, key: uuid.UUID) -> str:
    """The CSV stored as chunks under ``key``, whole (for checks; the API streams it)."""
    pieces = conn.execute(
        sa.text(
            "SELECT data FROM export_chunks WHERE task_id = :t AND execution_id = :k ORDER BY seq"
        ),
        {"t": task_id, "k": key},
    ).scalars()
    return b"".join(bytes(p) for p in pieces).decode()


def audit_events(engine: Engine, task_id: uuid.UUID) -> list[str]:
    """The task's audit trail, oldest first: its events only (CLAIM, COMPLETE, ...)."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT event FROM task_audit WHERE task_id = :t ORDER BY id"),
                {"t": task_id},
            ).scalars()
        )


def audit_trail(engine: Engine, task_id: uuid.UUID) -> list[tuple[str, str | None]]:
    """The task's audit trail, oldest first: each event with its execution id (text)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT event, execution_id FROM task_audit WHERE task_id = :t ORDER BY id"),
            {"t": task_id},
        )
        return [(r.event, None if r.execution_id is None else str(r.execution_id)) for r in rows]


def notifications(engine: Engine, task_id: uuid.UUID) -> int:
    """How many notifications the task (a reminder) has written."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM notifications WHERE task_id = :t"), {"t": task_id}
            ).scalar_one()
        )


def age_task(engine: Engine, task_id: uuid.UUID, seconds: float) -> None:
    """Move updated_at into the past (compresses the staleness clock; no waiting)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET updated_at = updated_at - "
                "make_interval(secs => :s) WHERE id = :id"
            ),
            {"s": seconds, "id": task_id},
        )


def later(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)
