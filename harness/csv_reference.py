"""The CSV contract (docs/design.md, "Exports"), computed independently of the export
code (pure Python from rows read with a plain SELECT): tests and the soak compare the
export's CSV with this."""

from __future__ import annotations

import unicodedata
import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

import sqlalchemy as sa

HEADER = "id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at"
# A title is neutralised (a leading "'") when it starts with TAB, CR or LF, or when its
# first character after the leading characters a spreadsheet may skip or draw as nothing
# (controls, format characters, spaces and separators, non-spacing marks, the other
# default-ignorable code points) could start a formula: = + - @ |, MINUS SIGN, or any
# character whose NFKC form starts with one of those (fullwidth, small, superscript...).
SKIPPED_CATEGORIES = ("Cc", "Cf", "Zs", "Zl", "Zp", "Mn")
IGNORABLE_RANGES = (  # Other_Default_Ignorable_Code_Point not in those categories
    (0x115F, 0x1160),  # HANGUL CHOSEONG FILLER, HANGUL JUNGSEONG FILLER
    (0x2065, 0x2065),  # reserved
    (0x3164, 0x3164),  # HANGUL FILLER
    (0xFFA0, 0xFFA0),  # HALFWIDTH HANGUL FILLER
    (0xFFF0, 0xFFF8),  # reserved
    (0xE0000, 0xE0FFF),  # tags, variation selectors supplement, reserved
)
FORMULA_STARTS = ("=", "+", "-", "@", "|", "\u2212")


def skipped(ch: str) -> bool:
    """Whether a spreadsheet may skip ``ch`` before deciding what a cell starts with."""
    code = ord(ch)
    return unicodedata.category(ch) in SKIPPED_CATEGORIES or any(
        low <= code <= high for low, high in IGNORABLE_RANGES
    )


def starts_formula(ch: str) -> bool:
    return unicodedata.normalize("NFKC", ch).startswith(FORMULA_STARTS)


def neutralised(title: str) -> str:
    lead = 0
    while lead < len(title) and skipped(title[lead]):
        lead += 1
    if any(ch in "\t\r\n" for ch in title[:lead]):
        return "'" + title
    if lead < len(title) and starts_formula(title[lead]):
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
