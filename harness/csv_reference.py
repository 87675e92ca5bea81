"""The CSV contract (docs/design.md, "Exports"), computed independently of the export
code (pure Python from rows read with a plain SELECT): tests and the soak compare the
export's CSV with this."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

import sqlalchemy as sa

HEADER = "id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at"
# A title is neutralised (a leading "'") when it starts with TAB, CR or LF, or when its
# first character after the leading characters a spreadsheet may skip (blank, control,
# zero-width, direction marks, BOM) could start a formula.
SKIPPED = "".join(
    map(
        chr,
        [
            *range(0x01, 0x21),  # C0 controls (TAB, LF, VT, FF, CR among them) and space
            *range(0x7F, 0xA1),  # DEL, C1 controls (NEL), NO-BREAK SPACE
            0xAD,  # SOFT HYPHEN
            0x1680,  # OGHAM SPACE MARK
            0x180E,  # MONGOLIAN VOWEL SEPARATOR
            *range(0x2000, 0x2010),  # spaces, ZWSP, ZWNJ, ZWJ, LRM, RLM
            *range(0x2028, 0x2030),  # line/paragraph separators, bidi embeddings, NNBSP
            *range(0x205F, 0x2070),  # MMSP, WORD JOINER, invisible operators, bidi isolates
            0x3000,  # IDEOGRAPHIC SPACE
            0xFEFF,  # BOM / ZERO WIDTH NO-BREAK SPACE
        ],
    )
)
FORMULA_STARTS = ("=", "+", "-", "@", "|", "\uff1d", "\uff0b", "\uff0d", "\uff20", "\uff5c")


def neutralised(title: str) -> str:
    rest = title.lstrip(SKIPPED)
    skipped = title[: len(title) - len(rest)]
    if any(ch in skipped for ch in "\t\r\n") or rest.startswith(FORMULA_STARTS):
        return "'" + title
    return title


def cell(value: Any, *, title: bool = False) -> str:
    """One CSV cell: NULL empty and unquoted, every other value quoted."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        text = value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    else:
        text = neutralised(str(value)) if title else str(value)
    return '"' + text.replace('"', '""') + '"'


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
    lines = [HEADER] + [
        ",".join(cell(v, title=name == "title") for name, v in row._mapping.items()) for row in kept
    ]
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
