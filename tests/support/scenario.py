"""Helpers shared by the worker scenarios: counting side effects, finding outcomes."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.workers import EventLog


@dataclass(frozen=True)
class SideEffects:
    notifications: int
    events: int
    version: int


def side_effects(engine: sa.Engine, ticket_id: uuid.UUID) -> SideEffects:
    with engine.connect() as conn:
        notes = conn.execute(
            sa.text("SELECT count(*) FROM notifications WHERE ticket_id = :t"), {"t": ticket_id}
        ).scalar_one()
        events = conn.execute(
            sa.text(
                "SELECT count(*) FROM system_events WHERE ticket_id = :t "
                "AND type = 'ticket.reminder_sent'"
            ),
            {"t": ticket_id},
        ).scalar_one()
        version = conn.execute(
            sa.text("SELECT version FROM tickets WHERE id = :t"), {"t": ticket_id}
        ).scalar_one()
    return SideEffects(int(notes), int(events), int(version))


def outcomes(events: EventLog, message: str) -> list[str]:
    """Outcomes returned by the deliveries of ``message`` that ended, in order."""
    return [str(e.get("result")) for e in events.of_type("task-succeeded", message)]


def event_records(
    caplog: pytest.LogCaptureFixture, event: str, task_id: uuid.UUID | None = None
) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "event", None) == event
        and (task_id is None or getattr(r, "task_id", None) == str(task_id))
    ]


def field(record: logging.LogRecord, name: str) -> Any:
    return getattr(record, name)
