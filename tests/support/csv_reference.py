"""The CSV contract (docs/design.md, "Exports"), computed independently of the export
code (pure Python from rows read with a plain SELECT): tests and the soak compare the
export's CSV with this."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

import sqlalchemy as sa

HEADER = "id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at"
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = str(value)
    if text.startswith(FORMULA_STARTS):
        text = "'" + text
    if text == "":
        return '""'
    if any(ch in text for ch in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def expected_csv(
    engine: sa.Engine, team_id: uuid.UUID, owner_id: uuid.UUID, scope: str, filters: dict[str, Any]
) -> str:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, title, status, priority, requester_id, assignee_id, due_at, created_at,"
                " updated_at FROM tickets WHERE team_id = :t"
            ),
            {"t": team_id},
        ).all()
    kept = sorted(
        (r for r in rows if matches(r, owner_id, scope, filters)),
        key=lambda r: (r.created_at, r.id),
    )
    lines = [HEADER] + [",".join(cell(v) for v in row) for row in kept]
    return "\n".join(lines) + "\n"


def matches(row: Any, owner_id: uuid.UUID, scope: str, filters: dict[str, Any]) -> bool:
    """The export filters (docs/design.md, "Exports") for one ticket (anything with the
    tickets' attribute names)."""
    if scope == "MINE" and owner_id not in (row.requester_id, row.assignee_id):
        return False
    if "status" in filters and row.status not in filters["status"]:
        return False
    if "priority" in filters and row.priority not in filters["priority"]:
        return False
    if "assignee_id" in filters and str(row.assignee_id) != filters["assignee_id"]:
        return False
    created = row.created_at.astimezone(UTC)
    if "created_from" in filters and created < _day(filters["created_from"]):
        return False
    if "created_to" in filters and created >= _day(filters["created_to"]) + timedelta(days=1):
        return False
    return not ("q" in filters and filters["q"].lower() not in row.title.lower())


def _day(text: str) -> datetime:
    return datetime.combine(date.fromisoformat(text), datetime.min.time(), tzinfo=UTC)
