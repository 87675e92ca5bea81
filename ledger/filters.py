"""Export filter validation, shared by task creation (API, CLI) and the worker.

Messages are fixed strings: they name our own keys and values, never the input.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from typing import Any

from ledger.errors import InvalidFilters
from ledger.models import TICKET_PRIORITIES, TICKET_STATUSES

FILTER_KEYS = ("status", "priority", "assignee_id", "created_from", "created_to", "q")
MAX_Q_LENGTH = 200

MSG_NOT_OBJECT = "filters must be a JSON object"
MSG_UNKNOWN_KEY = f"filters may only contain {', '.join(FILTER_KEYS)}"
MSG_STATUS = f"filters.status must be a non-empty list of {', '.join(TICKET_STATUSES)}"
MSG_PRIORITY = f"filters.priority must be a non-empty list of {', '.join(TICKET_PRIORITIES)}"
MSG_ASSIGNEE = "filters.assignee_id must be a UUID"
MIN_DATE, MAX_DATE = date(1900, 1, 1), date(2999, 12, 31)
MSG_DATE = f"filters.{{key}} must be a date written YYYY-MM-DD, from {MIN_DATE} to {MAX_DATE}"
MSG_DATE_ORDER = "filters.created_from must not be after filters.created_to"
MSG_Q = f"filters.q must be text of at most {MAX_Q_LENGTH} characters"
MSG_Q_CHARS = "filters.q must be text without NUL characters or unpaired surrogates"


@dataclass(frozen=True)
class ExportFilters:
    status: tuple[str, ...] | None = None
    priority: tuple[str, ...] | None = None
    assignee_id: uuid.UUID | None = None
    created_from: date | None = None
    created_to: date | None = None
    q: str | None = None


def _choices(value: Any, allowed: tuple[str, ...], message: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidFilters(message)
    if not all(isinstance(v, str) and v in allowed for v in value):
        raise InvalidFilters(message)
    return tuple(dict.fromkeys(value))


def _date(value: Any, key: str) -> date:
    if not isinstance(value, str) or len(value) != 10:
        raise InvalidFilters(MSG_DATE.format(key=key))
    try:
        parsed = date.fromisoformat(value)
    except ValueError:
        raise InvalidFilters(MSG_DATE.format(key=key)) from None
    if not MIN_DATE <= parsed <= MAX_DATE:  # the export adds a day to created_to
        raise InvalidFilters(MSG_DATE.format(key=key))
    return parsed


def _uuid(value: Any) -> uuid.UUID:
    if not isinstance(value, str):
        raise InvalidFilters(MSG_ASSIGNEE)
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidFilters(MSG_ASSIGNEE) from None


def validate_filters(raw: Any) -> ExportFilters:
    """Parse export filters or raise InvalidFilters with a fixed message."""
    if not isinstance(raw, Mapping):
        raise InvalidFilters(MSG_NOT_OBJECT)
    if any(key not in FILTER_KEYS for key in raw):
        raise InvalidFilters(MSG_UNKNOWN_KEY)
    q = raw.get("q")
    if "q" in raw and (not isinstance(q, str) or len(q) > MAX_Q_LENGTH):
        raise InvalidFilters(MSG_Q)
    if isinstance(q, str) and any(ch == "\x00" or "\ud800" <= ch <= "\udfff" for ch in q):
        raise InvalidFilters(MSG_Q_CHARS)  # PostgreSQL text and jsonb cannot hold them
    parsed = ExportFilters(
        status=_choices(raw["status"], TICKET_STATUSES, MSG_STATUS) if "status" in raw else None,
        priority=(
            _choices(raw["priority"], TICKET_PRIORITIES, MSG_PRIORITY)
            if "priority" in raw
            else None
        ),
        assignee_id=_uuid(raw["assignee_id"]) if "assignee_id" in raw else None,
        created_from=_date(raw["created_from"], "created_from") if "created_from" in raw else None,
        created_to=_date(raw["created_to"], "created_to") if "created_to" in raw else None,
        q=q,
    )
    if parsed.created_from and parsed.created_to and parsed.created_from > parsed.created_to:
        raise InvalidFilters(MSG_DATE_ORDER)
    return parsed
