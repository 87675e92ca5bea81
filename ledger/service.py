"""What users ask of the ledger: create, read, retry and cancel (docs/design.md, "Lifecycle").

Authorisation is applied here, so the API and the CLI answer alike, with the rules of
ledger/permissions.py. Everything a user may not see answers :class:`NotFound`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, RowMapping

from ledger import creation, idempotency
from ledger.errors import (
    ExportQuotaExceeded,
    InvalidInput,
    InvalidState,
    LedgerError,
    NotAllowed,
    NotFound,
    TeamQuotaExceeded,
)
from ledger.filters import validate_filters
from ledger.idempotency import IdempotencyKey, KeyInUse, Remembered
from ledger.permissions import (
    MSG_REMINDER_NEEDS_STAFF,
    MSG_TEAM_EXPORT_NEEDS_STAFF,
    STAFF,
    export_refusal,
    may_see,
)
from ledger.quota import (
    MSG_EXPORT_BYTES_PER_DAY,
    MSG_EXPORTS_PER_DAY,
    NO_CAP,
    NO_EXPORT_QUOTA,
    ExportQuota,
    ensure_export_room,
    ensure_room,
)
from ledger.states import SCOPES
from ledger.wake import WAKE_SQL
from teamdesk import tracing

MSG_SCOPE = "scope must be TEAM or MINE"
MSG_TICKET = "ticket_id must name a ticket of this team"
MSG_RUN_AT = "run_at must be a date and time with a time zone"
MSG_RUN_AT_WINDOW = (
    "run_at must be at most one year ahead and at most one day in the past (a past time means now)"
)
MSG_RETRY_STATE = "only FAILED or CANCELLED tasks can be retried"
MSG_CANCEL_STATE = "only WAITING or RUNNING tasks can be cancelled"
MSG_TEAM_NOT_FOUND = "Team not found."

ROLE = text("SELECT role FROM memberships WHERE team_id = :team_id AND user_id = :user_id")


# A completed export's CSV is kept (its 24 hours, by the database's clock, have not ended).
# Never a test of result_csv: the API's role may not read that column (ledger/api_database_role.py).
KEPT_CSV_SQL = "(kind = 'EXPORT' AND status = 'COMPLETED' AND coalesce(expires_at > now(), false))"

# A reminder that completes without side effects says why in its summary, after this.
SKIPPED_PREFIX = "skipped: "

# waiting_s: whole seconds a WAITING run has been ready (run_at passed), by the database's
# clock; NULL when it is not waiting or is scheduled for later. skipped: a completion
# without side effects (its summary starts with SKIPPED_PREFIX). has_csv: a completed
# export's CSV is kept (every completion stores one; it goes when the 24 hours end).
TASK_COLUMNS = f"""id, kind, team_id, owner_id, scope, filters, status, run, attempts, progress,
    last_error, result_summary, run_at, dispatched_at, recoveries, expires_at, created_at,
    updated_at, {KEPT_CSV_SQL} AS has_csv,
    (status = 'COMPLETED' AND coalesce(starts_with(result_summary, '{SKIPPED_PREFIX}'), false))
        AS skipped,
    CASE WHEN status = 'WAITING' AND run_at <= now()
         THEN CAST(floor(extract(epoch FROM now() - run_at)) AS integer) END AS waiting_s"""

SELECT_TASK = text(f"SELECT {TASK_COLUMNS} FROM background_tasks WHERE id = :task_id")

SELECT_TASK_FOR_UPDATE = text(
    f"SELECT {TASK_COLUMNS} FROM background_tasks WHERE id = :task_id FOR UPDATE"
)

# permissions.may_see, in SQL.
# A page: the newest, or those older than the task ``before`` (the last of the previous
# page) in the same order - a keyset, so a page costs the same however deep it is.
LIST_TASKS = text(f"""
    SELECT {TASK_COLUMNS} FROM background_tasks
     WHERE team_id = :team_id
       AND CASE WHEN scope = 'TEAM' THEN :is_staff ELSE owner_id = :user_id END
       AND (CAST(:before AS uuid) IS NULL
            OR (created_at, id) < (SELECT b.created_at, b.id FROM background_tasks b
                                    WHERE b.id = CAST(:before AS uuid) AND b.team_id = :team_id))
     ORDER BY created_at DESC, id DESC
     LIMIT :limit
""")

# Where the CSV is while it is kept (expiry by the database's clock): its chunks' key (NULL:
# an earlier release stored it in the row) and its size (NULL for those).
SELECT_CSV = text(f"""
    SELECT {KEPT_CSV_SQL} AS kept, result_key, result_bytes
      FROM background_tasks WHERE id = :task_id
""")

# Guard: only a finished-without-result run opens a new one (docs/design.md, "Lifecycle").
# The new run belongs to the retry's trace (teamdesk/tracing.py), linked to the one before.
RETRY = text("""
    WITH previous AS (
        SELECT trace_parent FROM background_tasks WHERE id = :task_id
    ), reopened AS (
        UPDATE background_tasks
           SET run = run + 1, status = 'WAITING', progress = 0, attempts = 0, last_error = NULL,
               execution_id = NULL, lease_holder = NULL, dispatched_at = NULL,
               result_summary = NULL, expires_at = NULL, recoveries = 0,
               run_at = now(), run_opened_at = now(), updated_at = now(),
               trace_parent = CAST(:trace_parent AS text)
         WHERE id = :task_id AND status IN ('FAILED', 'CANCELLED')
        RETURNING id, run
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event) SELECT id, run, 'RETRY' FROM reopened
    )
    SELECT run, (SELECT trace_parent FROM previous) AS previous_trace FROM reopened
""")

# Guard: not finished. Clearing execution_id revokes a running execution's lease.
_CANCEL = """
    WITH live AS (
        SELECT id, run, execution_id FROM background_tasks
         WHERE id = :task_id AND status IN ('WAITING', 'RUNNING'){run_guard}
           FOR UPDATE
    ), cancelled AS (
        UPDATE background_tasks t
           SET status = 'CANCELLED', execution_id = NULL, lease_holder = NULL, updated_at = now()
          FROM live WHERE t.id = live.id
        RETURNING t.id, t.run, live.execution_id AS revoked
    ), audit AS (
        INSERT INTO task_audit (task_id, run, event, execution_id)
        SELECT id, run, 'CANCEL', revoked FROM cancelled
    )
    SELECT id FROM cancelled
"""
CANCEL = text(_CANCEL.format(run_guard=""))
# Guard: not finished, and still the run a revoked queue message named (a revoke never
# reaches a later run: a manual retry is a new run, with a message id of its own).
CANCEL_RUN = text(_CANCEL.format(run_guard=" AND run = :run"))

WAKE = text(WAKE_SQL)


@dataclass(frozen=True)
class TaskView:
    """A task as its owner may see it (everything but the CSV body); ``replayed``: the
    answer to a request whose Idempotency-Key created it earlier (ledger/idempotency.py)."""

    row: Mapping[Any, Any]
    replayed: bool = False

    @property
    def id(self) -> uuid.UUID:
        return uuid.UUID(str(self.row["id"]))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in self.row.items():
            if isinstance(value, uuid.UUID):
                value = str(value)
            elif isinstance(value, datetime):
                value = value.astimezone(UTC).isoformat().replace("+00:00", "Z")
            out[key] = value
        return out


def role_of(conn: Connection, team_id: uuid.UUID, user_id: uuid.UUID) -> str | None:
    row = conn.execute(ROLE, {"team_id": team_id, "user_id": user_id}).one_or_none()
    return None if row is None else str(row.role)


def _visible_task(
    conn: Connection, task_id: uuid.UUID, user_id: uuid.UUID, for_update: bool = False
) -> RowMapping:
    stmt = SELECT_TASK_FOR_UPDATE if for_update else SELECT_TASK
    task = conn.execute(stmt, {"task_id": task_id}).mappings().one_or_none()
    if task is None or not may_see(
        task["scope"], task["owner_id"], user_id, role_of(conn, task["team_id"], user_id)
    ):
        raise NotFound()
    return task


def _member_role(conn: Connection, team_id: uuid.UUID, user_id: uuid.UUID) -> str:
    role = role_of(conn, team_id, user_id)
    if role is None:
        raise NotFound(MSG_TEAM_NOT_FOUND)
    return role


def create_export(
    conn: Connection,
    team_id: uuid.UUID,
    user_id: uuid.UUID,
    scope: Any,
    filters: Any,
    max_unfinished: int = NO_CAP,
    export_quota: ExportQuota = NO_EXPORT_QUOTA,
) -> uuid.UUID:
    """:func:`submit_export`'s new task id."""
    return submit_export(conn, team_id, user_id, scope, filters, max_unfinished, export_quota).id


def submit_export(
    conn: Connection,
    team_id: uuid.UUID,
    user_id: uuid.UUID,
    scope: Any,
    filters: Any,
    max_unfinished: int = NO_CAP,
    export_quota: ExportQuota = NO_EXPORT_QUOTA,
    idempotency_key: str | None = None,
) -> TaskView:
    """Validate and insert a WAITING export in one statement (ledger/creation.py), on an
    autocommit connection or in the caller's transaction; nothing is written when anything
    is wrong, when the team has ``max_unfinished`` unfinished tasks, or when it used its
    daily ``export_quota`` (ledger/quota.py): the first rule that refused raises. Returns
    the new task as its creator sees it, or, for an ``idempotency_key`` this request sent
    before, that task (``replayed``)."""
    if scope not in SCOPES:
        raise InvalidInput(MSG_SCOPE)
    validate_filters(filters)
    key = None
    if idempotency_key is not None:
        key = export_key(idempotency_key, team_id, user_id, scope, filters)
    created = _keyed(
        conn,
        key,
        lambda: creation.insert_export(
            conn,
            team_id,
            user_id,
            scope,
            dict(filters),
            max_unfinished,
            export_quota,
            TASK_COLUMNS,
            key,
        ),
    )
    return _answer(conn, created, user_id, key, MSG_TEAM_EXPORT_NEEDS_STAFF)


def create_reminder(
    conn: Connection,
    team_id: uuid.UUID,
    user_id: uuid.UUID,
    ticket_id: Any,
    run_at: datetime | None = None,
    max_unfinished: int = NO_CAP,
) -> uuid.UUID:
    """:func:`submit_reminder`'s new task id."""
    return submit_reminder(conn, team_id, user_id, ticket_id, run_at, max_unfinished).id


def submit_reminder(
    conn: Connection,
    team_id: uuid.UUID,
    user_id: uuid.UUID,
    ticket_id: Any,
    run_at: datetime | None = None,
    max_unfinished: int = NO_CAP,
    idempotency_key: str | None = None,
) -> TaskView:
    """Validate and insert a WAITING reminder for one ticket, due at ``run_at`` (default
    now), as :func:`submit_export` does."""
    ticket = _ticket(ticket_id)
    if run_at is not None and run_at.tzinfo is None:
        raise InvalidInput(MSG_RUN_AT)
    key = None
    if idempotency_key is not None:
        key = reminder_key(idempotency_key, team_id, user_id, ticket, run_at)
    created = _keyed(
        conn,
        key,
        lambda: creation.insert_reminder(
            conn, team_id, user_id, ticket, run_at, max_unfinished, TASK_COLUMNS, key
        ),
    )
    return _answer(conn, created, user_id, key, MSG_REMINDER_NEEDS_STAFF)


def export_key(
    raw: str, team_id: uuid.UUID, user_id: uuid.UUID, scope: Any, filters: Any
) -> IdempotencyKey:
    """An export request's key (ledger/idempotency.py), validated."""
    request = {"route": "export", "team": team_id, "user": user_id, "scope": scope}
    return IdempotencyKey.of(raw, {**request, "filters": filters})


def reminder_key(
    raw: str, team_id: uuid.UUID, user_id: uuid.UUID, ticket: uuid.UUID, run_at: datetime | None
) -> IdempotencyKey:
    """A reminder request's key; ``run_at`` is compared as an instant (any time zone)."""
    when = None if run_at is None else run_at.astimezone(UTC).isoformat()
    request = {"route": "reminder", "team": team_id, "user": user_id, "ticket": ticket}
    return IdempotencyKey.of(raw, {**request, "run_at": when})


def _keyed(
    conn: Connection, key: IdempotencyKey | None, create: Callable[[], creation.Created]
) -> creation.Created:
    """``create``; with a key, once more when a concurrent request with it committed first
    (:class:`KeyInUse`): the second statement finds the key's row. In the caller's
    transaction the first try is under a savepoint, so the failure leaves it usable."""
    if key is None:
        return create()
    dbapi = conn.connection.dbapi_connection
    try:
        with nullcontext() if dbapi is None or dbapi.autocommit else conn.begin_nested():
            return create()
    except KeyInUse:
        return create()


def _answer(
    conn: Connection,
    created: creation.Created,
    user_id: uuid.UUID,
    key: IdempotencyKey | None,
    needs_staff: str,
) -> TaskView:
    """The new task, a key's replay, or the first refusal, in the order the rules are
    told: who asks (404), the key (422 for another request; a replay asks ``allowed``
    again, so a demoted user is refused as a new request is), then each rule."""
    if created.row is not None:
        return TaskView(created.row)
    if created.role is None:
        raise NotFound(MSG_TEAM_NOT_FOUND)
    if created.held is not None:
        if key is None or created.held_fingerprint != key.fingerprint:
            raise InvalidInput(idempotency.MSG_KEY_REUSED)
        if not created.passed["allowed"]:
            raise NotAllowed(needs_staff)
        return TaskView(_visible_task(conn, created.held.task_id, user_id), replayed=True)
    refusals: dict[str, Callable[[], LedgerError]] = {
        "allowed": lambda: NotAllowed(needs_staff),
        "run_at_ok": lambda: InvalidInput(MSG_RUN_AT_WINDOW),
        "ticket_ok": lambda: InvalidInput(MSG_TICKET),
        "has_room": TeamQuotaExceeded,
        "within_runs": lambda: ExportQuotaExceeded(MSG_EXPORTS_PER_DAY, created.frees_in_s),
        "within_bytes": lambda: ExportQuotaExceeded(MSG_EXPORT_BYTES_PER_DAY, created.frees_in_s),
    }
    for rule, ok in created.passed.items():
        if not ok:
            raise refusals[rule]()
    # Every rule passed and no key was held, so the statement inserted: never reached.
    raise AssertionError("the creation inserted nothing and no rule refused it")


def _ticket(ticket_id: Any) -> uuid.UUID:
    try:
        return uuid.UUID(str(ticket_id))
    except ValueError:
        raise InvalidInput(MSG_TICKET) from None


def read_task_as_operator(conn: Connection, task_id: uuid.UUID) -> TaskView:
    """A task by id with no authorisation: for operators at the CLI, never for the API."""
    task = conn.execute(SELECT_TASK, {"task_id": task_id}).mappings().one_or_none()
    if task is None:
        raise NotFound()
    return TaskView(task)


def get_task(conn: Connection, task_id: uuid.UUID, user_id: uuid.UUID) -> TaskView:
    return TaskView(_visible_task(conn, task_id, user_id))


def list_tasks(
    conn: Connection,
    team_id: uuid.UUID,
    user_id: uuid.UUID,
    limit: int = 100,
    before: uuid.UUID | None = None,
) -> list[TaskView]:
    """The team's tasks ``user_id`` may see, newest first: the first ``limit``, or those
    after the task ``before`` (the last one of the previous page; a task of another team
    gives an empty page)."""
    role = _member_role(conn, team_id, user_id)
    params = {"team_id": team_id, "user_id": user_id, "is_staff": role == STAFF}
    rows = conn.execute(
        LIST_TASKS, {**params, "limit": limit, "before": None if before is None else str(before)}
    ).mappings()
    return [TaskView(row) for row in rows]


@dataclass(frozen=True)
class StoredCsv:
    """Where a kept CSV is: chunks under ``key`` (None: the text an earlier release stored
    in the row), ``size`` bytes in all when known; read them with
    ledger.artifacts.read_chunk."""

    task_id: uuid.UUID
    key: uuid.UUID | None
    size: int | None


def read_csv(
    conn: Connection, task_id: uuid.UUID, user_id: uuid.UUID
) -> tuple[RowMapping, StoredCsv | None]:
    """The task and where its CSV is (None when not produced or no longer kept)."""
    task = _visible_task(conn, task_id, user_id)
    row = conn.execute(SELECT_CSV, {"task_id": task_id}).one()
    if not row.kept:
        return task, None
    return task, StoredCsv(task_id, row.result_key, row.result_bytes)


@dataclass(frozen=True)
class Retried:
    """A retry's new run; ``replayed``: opened by an earlier request with its key."""

    run: int
    replayed: bool = False


def retry(
    conn: Connection,
    task_id: uuid.UUID,
    user_id: uuid.UUID,
    max_unfinished: int = NO_CAP,
    export_quota: ExportQuota = NO_EXPORT_QUOTA,
) -> int:
    """Open a new run of a FAILED or CANCELLED task; returns the new run number. Refused
    like a creation when the team is at ``max_unfinished`` (a retry adds a WAITING row),
    and a new run of an export like a new export by the daily ``export_quota``: it is new
    work, counted from now (ledger/quota.py)."""
    return reopen(conn, task_id, user_id, max_unfinished, export_quota).run


def reopen(
    conn: Connection,
    task_id: uuid.UUID,
    user_id: uuid.UUID,
    max_unfinished: int = NO_CAP,
    export_quota: ExportQuota = NO_EXPORT_QUOTA,
    idempotency_key: str | None = None,
) -> Retried:
    """:func:`retry`; with an ``idempotency_key`` this request sent before, the run it
    opened then (``replayed``), whatever the task's state now."""
    task = _visible_task(conn, task_id, user_id, for_update=True)
    key = None
    if idempotency_key is not None:
        request = {"route": "retry", "task": task_id, "user": user_id}
        key = IdempotencyKey.of(idempotency_key, request)
        done = idempotency.hold(conn, task["team_id"], key)
        if done is not None:
            return Retried(done.run, replayed=True)
    if task["status"] not in ("FAILED", "CANCELLED"):
        raise InvalidState(MSG_RETRY_STATE)
    if task["kind"] == "EXPORT":
        refusal = export_refusal(task["scope"], role_of(conn, task["team_id"], task["owner_id"]))
        if refusal is not None:
            raise NotAllowed(refusal)
        ensure_export_room(conn, task["team_id"], max_unfinished, export_quota)
    else:
        ensure_room(conn, task["team_id"], max_unfinished)
    with tracing.span("task.retry", task_id=task_id, team_id=task["team_id"]) as current:
        params = {"task_id": task_id, "trace_parent": tracing.current_parent()}
        row = conn.execute(RETRY, params).one_or_none()
        if row is None:
            raise InvalidState(MSG_RETRY_STATE)
        tracing.add_link(current, row.previous_trace)
        tracing.annotate(current, run=int(row.run))
    if key is not None:
        idempotency.remember(conn, task["team_id"], key, user_id, Remembered(task_id, row.run))
    conn.execute(WAKE)  # delivered when the caller's transaction commits
    return Retried(int(row.run))


def cancel(conn: Connection, task_id: uuid.UUID, user_id: uuid.UUID) -> None:
    """Cancel a WAITING or RUNNING task; a running execution loses its lease."""
    _visible_task(conn, task_id, user_id)
    if conn.execute(CANCEL, {"task_id": task_id}).rowcount != 1:
        raise InvalidState(MSG_CANCEL_STATE)
    conn.execute(WAKE)  # a cancelled run in flight frees a window slot


def cancel_run(conn: Connection, task_id: uuid.UUID, run: int) -> bool:
    """Cancel ``run`` of a task if it is WAITING or RUNNING (an operator revoked its queue
    message); False when that run has ended or is not the task's current run."""
    if conn.execute(CANCEL_RUN, {"task_id": task_id, "run": run}).rowcount != 1:
        return False
    conn.execute(WAKE)  # a cancelled run in flight frees a window slot
    return True
