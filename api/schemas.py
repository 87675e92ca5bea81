"""Request and response bodies, as the OpenAPI document shows them (class docstrings and
descriptions are published there). Request bodies take no unknown fields and coerce nothing;
filters are validated by :func:`ledger.filters.validate_filters`, the schema only documents them.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from ledger.filters import MAX_Q_LENGTH
from ledger.models import TICKET_PRIORITIES, TICKET_STATUSES

MAX_LIST_LIMIT = 200
DEFAULT_LIST_LIMIT = 100

FILTERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "status": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "enum": list(TICKET_STATUSES)},
        },
        "priority": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "enum": list(TICKET_PRIORITIES)},
        },
        "assignee_id": {"type": "string", "format": "uuid"},
        "created_from": {"type": "string", "format": "date"},
        "created_to": {"type": "string", "format": "date"},
        "q": {"type": "string", "maxLength": MAX_Q_LENGTH},
    },
}


class ExportRequest(BaseModel):
    """Ask for a CSV of the team's tickets (TEAM, staff only) or of your own (MINE)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    scope: Literal["TEAM", "MINE"]
    filters: dict[str, Any] = Field(
        default_factory=dict,
        description="Every key optional: status, priority, assignee_id, created_from, "
        "created_to (YYYY-MM-DD, inclusive), q (title substring, at most 200 characters).",
        json_schema_extra=FILTERS_SCHEMA,
    )


class ReminderRequest(BaseModel):
    """Remind a ticket's assignee at ``run_at`` (default: now). Staff only."""

    model_config = ConfigDict(extra="forbid")

    ticket_id: uuid.UUID
    run_at: AwareDatetime | None = Field(
        default=None, description="ISO 8601 date and time with a time zone"
    )

    @field_validator("ticket_id", mode="before")
    @classmethod
    def _uuid_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError("ticket_id must be a string")
        return value

    @field_validator("run_at", mode="before")
    @classmethod
    def _iso_8601(cls, value: Any) -> Any:
        """ISO 8601 text only (no numbers read as Unix times, no bare dates), kept in UTC:
        PostgreSQL refuses offsets Python accepts (beyond about 16 hours)."""
        if value is None:
            return None
        if not isinstance(value, str) or "T" not in value.upper():
            raise ValueError("run_at must be an ISO 8601 date and time")
        try:
            parsed = datetime.fromisoformat(value)
            return parsed if parsed.tzinfo is None else parsed.astimezone(UTC)
        except (ValueError, OverflowError):
            raise ValueError("run_at must be an ISO 8601 date and time") from None


class TaskOut(BaseModel):
    """A task as its owner (or a staff member, for TEAM scope) sees it; never the CSV body."""

    id: uuid.UUID
    kind: Literal["EXPORT", "REMINDER"]
    team_id: uuid.UUID
    owner_id: uuid.UUID
    scope: Literal["TEAM", "MINE"]
    filters: dict[str, Any]
    status: Literal["WAITING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"]
    run: int = Field(
        description="0 at creation, +1 at each manual retry (as the CLI and message ids show it)"
    )
    attempts: int = Field(description="attempt number inside the current run")
    progress: int = Field(ge=0, le=100)
    last_error: str | None
    result_summary: str | None
    run_at: datetime
    dispatched_at: datetime | None
    recoveries: int
    expires_at: datetime | None = Field(description="when the export's CSV is deleted")
    created_at: datetime
    updated_at: datetime
    has_csv: bool = Field(description="whether GET /api/tasks/{id}/csv has a file to give")
    skipped: bool = Field(
        description="a reminder that completed without sending anything (the ticket was "
        "resolved, closed or unassigned, or its assignee left the team): result_summary "
        "says why"
    )
    waiting_s: int | None = Field(
        default=None,
        description="whole seconds the task has been WAITING since it became ready to run "
        "(its run_at passed), by the database's clock; null when it is not waiting or is "
        "scheduled for later",
    )
    waiting_reason: str | None = Field(
        default=None,
        description="once a ready task has waited 5 s or more: the missing role that holds "
        'it back ("no worker consumes exports", "no dispatcher is running ...", "Redis does '
        'not answer ..."); null otherwise, and when nothing is missing (it is in line)',
    )


class TaskListOut(BaseModel):
    tasks: list[TaskOut] = Field(description="newest first")
    next: uuid.UUID | None = Field(
        default=None,
        description="when the page is full: pass it as ?before= for the next (older) page",
    )


class AcceptedOut(BaseModel):
    """The request was accepted; the work happens later, on a worker."""

    task_id: uuid.UUID
    run: int
    status: Literal["WAITING", "CANCELLED"]


class RetriedOut(AcceptedOut):
    """A retry was accepted: the new run, and when it is ready."""

    run_at: datetime = Field(
        description="when the new run is ready: now, by the database's clock (a retried "
        "reminder is sent at once, not at its earlier run_at)"
    )


class ErrorOut(BaseModel):
    detail: str


class HealthOut(BaseModel):
    status: Literal["ok", "unavailable"]
    version: str = Field(
        description="the API's running version: semantic (`1.0.0`), or `unknown` when it "
        "cannot be read (teamdesk/version.py); in both answers",
        examples=["1.0.0"],
    )


class WorkersOut(BaseModel):
    workers: bool | None = Field(description="null when Redis could not be read")
    dispatcher: bool | None = Field(
        default=None, description="a dispatcher (beat) holds the leader lock"
    )
    consumers: dict[str, int] | None = Field(
        default=None, description="live worker processes per task queue"
    )
    missing: list[str] | None = Field(
        default=None,
        description='process roles the cluster lacks: "dispatcher", "exports worker", '
        '"reminders worker"',
    )
    problems: list[str] | None = Field(
        default=None,
        description='what is missing, in words: "no dispatcher is running (start one: '
        'celery -A tasks beat)", "no worker consumes exports", ...; empty when nothing is',
    )
