"""A rolling replacement of a running cluster, under a steady load, and what it must leave
behind (tests/process/test_upgrade.py).

:class:`Load` creates exports and reminders on a thread of its own, one every
``interval_s``, through a creator it can be switched to as the schema changes: the
previous release's ledger statement in plain SQL (:func:`sql_creator`, which any schema
from 0001 on accepts) or head's ``ledger.service`` (:func:`head_creator`, which needs
head's schema). :func:`ledger_faults` and :func:`error_lines` say what went wrong.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from harness.factories import World, add_ticket, add_tickets
from harness.processes import Proc

Creator = Callable[[Connection, str, uuid.UUID | None], uuid.UUID]

EXPORT_TICKETS = 30  # unassigned tickets; every export (TEAM, no filter) has them all
REMINDER_TICKETS = 6  # assigned to a staff member: each reminder notifies once
TICKETS = EXPORT_TICKETS + REMINDER_TICKETS

# The previous release's creation (its ledger/service.py ``INSERT_TASK``, due now).
INSERT_TASK = sa.text("""
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)
    VALUES (:kind, :team_id, :owner_id, 'TEAM', CAST(:filters AS jsonb))
    RETURNING id
""")


@dataclass
class Seeded:
    """The business rows the load works on: one team, its reminder tickets and their
    versions before any reminder ran."""

    world: World
    reminder_tickets: list[uuid.UUID]
    versions: dict[uuid.UUID, int]


def seed(engine: Engine, world: World) -> Seeded:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, EXPORT_TICKETS)
        tickets = [
            add_ticket(conn, world.team_id, world.customer_id, f"R{i}", assignee_id=world.staff2_id)
            for i in range(REMINDER_TICKETS)
        ]
    return Seeded(world, tickets, ticket_versions(engine, tickets))


def ticket_versions(engine: Engine, tickets: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, version FROM tickets WHERE id = ANY(:ids)"), {"ids": tickets}
        )
        return {row.id: int(row.version) for row in rows}


def sql_creator(world: World) -> Creator:
    def create(conn: Connection, kind: str, ticket: uuid.UUID | None) -> uuid.UUID:
        filters = {} if ticket is None else {"ticket_id": str(ticket)}
        params = {
            "kind": kind,
            "team_id": world.team_id,
            "owner_id": world.staff_id,
            "filters": json.dumps(filters),
        }
        return uuid.UUID(str(conn.execute(INSERT_TASK, params).scalar_one()))

    return create


def head_creator(world: World) -> Creator:
    from ledger import service

    def create(conn: Connection, kind: str, ticket: uuid.UUID | None) -> uuid.UUID:
        if ticket is None:
            return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        return service.create_reminder(conn, world.team_id, world.staff_id, ticket)

    return create


@dataclass
class Load:
    """Exports and reminders, alternately, one every ``interval_s`` until :meth:`stop`."""

    engine: Engine
    seeded: Seeded
    creator: Creator
    interval_s: float = 0.15
    created: dict[uuid.UUID, tuple[str, uuid.UUID | None]] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop creating; a creation that failed is in :attr:`errors` (it ended the load)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        tickets = self.seeded.reminder_tickets
        n = 0
        while not self._stop.wait(self.interval_s):
            ticket = None if n % 2 == 0 else tickets[(n // 2) % len(tickets)]
            kind = "EXPORT" if ticket is None else "REMINDER"
            try:
                with self.engine.begin() as conn:
                    task_id = self.creator(conn, kind, ticket)
            except Exception as exc:  # the test asserts there is none
                self.errors.append(exc)
                return
            self.created[task_id] = (kind, ticket)
            n += 1

    def ids(self) -> list[uuid.UUID]:
        return list(self.created)


def finished(engine: Engine, ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM background_tasks WHERE id = ANY(:ids)"
                    " AND status IN ('COMPLETED', 'FAILED', 'CANCELLED')"
                ),
                {"ids": ids},
            ).scalar_one()
        )


def ledger_faults(engine: Engine, load: Load) -> list[str]:
    """Everything the ledger says went wrong with the load's tasks: not COMPLETED, an
    audit trail other than one CLAIM and one COMPLETE, an export without all its rows, a
    reminder without exactly one notification and one system event, a ticket whose
    version did not move once per reminder."""
    ids = load.ids()
    with engine.connect() as conn:
        rows = {
            r.id: r
            for r in conn.execute(
                sa.text(
                    "SELECT id, kind, status, recoveries, result_summary FROM background_tasks"
                    " WHERE id = ANY(:ids)"
                ),
                {"ids": ids},
            )
        }
        trails: dict[uuid.UUID, Counter[str]] = {task_id: Counter() for task_id in ids}
        for r in conn.execute(
            sa.text("SELECT task_id, event FROM task_audit WHERE task_id = ANY(:ids)"),
            {"ids": ids},
        ):
            trails[r.task_id][r.event] += 1
        notified = _counts(conn, "SELECT task_id, count(*) FROM notifications GROUP BY 1")
        events = _counts(
            conn,
            "SELECT CAST(payload->>'task_id' AS uuid), count(*) FROM system_events GROUP BY 1",
        )
    faults = [f"{task_id}: never written" for task_id in ids if task_id not in rows]
    for task_id, row in rows.items():
        faults += _task_faults(
            row, trails[task_id], notified.get(task_id, 0), events.get(task_id, 0)
        )
    moved = ticket_versions(engine, load.seeded.reminder_tickets)
    reminders = Counter(ticket for kind, ticket in load.created.values() if kind == "REMINDER")
    for ticket, before in load.seeded.versions.items():
        if moved[ticket] - before != reminders[ticket]:
            faults.append(
                f"ticket {ticket}: version {before} -> {moved[ticket]}, "
                f"{reminders[ticket]} reminders"
            )
    return faults


def _counts(conn: Connection, sql: str) -> dict[uuid.UUID, int]:
    return {uuid.UUID(str(key)): int(n) for key, n in conn.execute(sa.text(sql))}


def _task_faults(row: Any, trail: Counter[str], notified: int, events: int) -> list[str]:
    said = f"{row.id} ({row.kind})"
    faults = []
    if row.status != "COMPLETED":
        faults.append(f"{said}: {row.status}")
    if trail != Counter({"CLAIM": 1, "COMPLETE": 1}):
        faults.append(f"{said}: audit {dict(trail)}")
    if row.recoveries:
        faults.append(f"{said}: recovered {row.recoveries} times")
    if row.kind == "EXPORT" and row.result_summary != f"{TICKETS} rows":
        faults.append(f"{said}: {row.result_summary!r}")
    if row.kind == "REMINDER" and (notified, events) != (1, 1):
        faults.append(f"{said}: {notified} notifications, {events} system events")
    return faults


def error_lines(proc: Proc) -> list[str]:
    """Lines at error or fatal level, and tracebacks, in ``proc``'s output."""
    found = []
    for line in proc.output().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            if "Traceback" in line:
                found.append(line)
            continue
        if not isinstance(record, dict):
            continue
        if record.get("level") in ("error", "fatal") or "Traceback" in json.dumps(record):
            found.append(line)
    return found
