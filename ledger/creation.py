"""A task's creation in one round trip: every rule and the insert in one statement, which
also says which rule refused (docs/design.md, "HTTP API").

The statement reads the asker's role and one boolean per rule (``checks``), inserts the
task only when every rule passes (and, with an Idempotency-Key, while no row holds the
key: ledger/idempotency.py), and returns the checks beside the new task's columns, so a
refusal is told from the same snapshot that refused it. The team's lock comes first in
the same round trip (``LOCK_TEAM_SQL``: a second statement of one implicit transaction on
an autocommit connection, or of the caller's transaction), so the counts see every
creation of the team that committed before. The rules' SQL is ledger/permissions.py's
(``MAY_CREATE_*``) and ledger/quota.py's (``UNFINISHED_SQL``, ``EXPORTS_OF_THE_DAY_SQL``).
The insert wakes the dispatcher through the table's statement trigger (ledger/wake.py)
and returns the new task's view: whoever may create a task may see it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg2
from sqlalchemy.engine import Connection

from ledger import prepared
from ledger.idempotency import (
    CLAIM_SQL,
    FORGET_EXPIRED_KEY_SQL,
    HELD_SQL,
    IdempotencyKey,
    KeyInUse,
    Remembered,
    is_key_taken,
)
from ledger.permissions import MAY_CREATE_EXPORT_SQL, MAY_CREATE_REMINDER_SQL
from ledger.quota import (
    EXPORTS_OF_THE_DAY_SQL,
    HELD_BYTES_SQL,
    LOCK_TEAM_SQL,
    NO_CAP,
    UNFINISHED_SQL,
    ExportQuota,
)
from teamdesk import tracing

# The bound of each statement sent on an autocommit connection (a request's): the API's
# transactions have the same (api/resources.py).
STATEMENT_TIMEOUT_MS = 10_000

# The window a reminder's run_at may fall in, by the database's clock: a year ahead at most
# (a reminder in year 9999 would never fire), a day in the past at most (a late request).
RUN_AT_WINDOW_SQL = "BETWEEN now() - interval '1 day' AND now() + interval '1 year'"
TICKET_IN_TEAM_SQL = (
    "SELECT 1 FROM tickets WHERE id = CAST(%(ticket_id)s AS uuid) AND team_id = %(team_id)s"
)
ROLE_SQL = (
    "SELECT role FROM memberships"
    " WHERE team_id = CAST(%(team_id)s AS uuid) AND user_id = CAST(%(owner_id)s AS uuid)"
)

# The rules, each a boolean column of ``checks``, in the order a refusal names them.
EXPORT_RULES = {"allowed": MAY_CREATE_EXPORT_SQL}
REMINDER_RULES = {
    "run_at_ok": "(CAST(%(run_at)s AS timestamptz) IS NULL"
    f" OR CAST(%(run_at)s AS timestamptz) {RUN_AT_WINDOW_SQL})",
    "allowed": MAY_CREATE_REMINDER_SQL,
    "ticket_ok": f"EXISTS ({TICKET_IN_TEAM_SQL})",
}
ROOM_RULE = {"has_room": f"{UNFINISHED_SQL} < %(cap)s"}
# The daily export quota, from one read of the team's exports of the last 24 hours.
DAY_SQL = f"""(SELECT count(*) AS runs, {HELD_BYTES_SQL} AS bytes,
            ceil(extract(epoch FROM min(run_opened_at) + interval '1 day' - now())) AS frees_in_s
      {EXPORTS_OF_THE_DAY_SQL}) AS day"""
DAY_COLUMNS = ", day.frees_in_s"
RUNS_RULE = {"within_runs": "day.runs < %(per_day)s"}
BYTES_RULE = {"within_bytes": "day.bytes + %(reserve_bytes)s <= %(bytes_per_day)s"}

_CREATE = """
    WITH checks AS (
        SELECT ({role}) AS role, {rules}{sources}
    ){held}, task AS (
        INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, run_at, trace_parent)
        SELECT '{kind}', CAST(%(team_id)s AS uuid), CAST(%(owner_id)s AS uuid),
               CAST(%(scope)s AS text), CAST(%(filters)s AS jsonb),
               greatest(coalesce(CAST(%(run_at)s AS timestamptz), now()), now()),
               CAST(%(trace_parent)s AS text)
          FROM checks
         WHERE {passed}
        RETURNING {returning}
    ){claim}
    SELECT checks.*, {held_columns} task.* FROM checks{held_join} LEFT JOIN task ON true"""
_HELD = """, held AS ({held_sql}
    )"""
_CLAIM = """, claimed AS ({claim_sql}
    )"""
_HELD_COLUMNS = ("held_fingerprint", "held_task_id", "held_run")
HELD_COLUMNS_SQL = (
    "held.fingerprint AS held_fingerprint, held.task_id AS held_task_id, held.run AS held_run,"
)

_STATEMENTS: dict[tuple[Any, ...], str] = {}


@dataclass(frozen=True)
class Created:
    """What the statement did: the new task's ``returning`` columns (``row``), else why
    not: the asker's ``role`` (None: not a member), each rule's verdict in order
    (``passed``), when the day's quota frees (``frees_in_s``), and what a live
    Idempotency-Key did (``held``, with the fingerprint of the request it was kept for)."""

    row: dict[str, Any] | None
    role: str | None
    passed: dict[str, bool]
    frees_in_s: int
    held: Remembered | None
    held_fingerprint: bytes | None


def _statement(kind: str, rules: dict[str, str], day: bool, returning: str, keyed: bool) -> str:
    key = (kind, tuple(rules), day, returning, keyed)
    sql = _STATEMENTS.get(key)
    if sql is None:
        passed = [*rules, *(["NOT EXISTS (SELECT 1 FROM held)"] if keyed else [])]
        create = _CREATE.format(
            role=ROLE_SQL,
            rules=", ".join(f"{expression} AS {name}" for name, expression in rules.items()),
            sources=f"{DAY_COLUMNS} FROM {DAY_SQL}" if day else "",
            held=_HELD.format(held_sql=HELD_SQL) if keyed else "",
            kind=kind,
            passed=" AND ".join(passed),
            returning=returning,
            claim=_CLAIM.format(claim_sql=CLAIM_SQL) if keyed else "",
            held_columns=HELD_COLUMNS_SQL if keyed else "",
            held_join=" LEFT JOIN held ON true" if keyed else "",
        )
        prefix = [FORGET_EXPIRED_KEY_SQL] if keyed else []
        if "has_room" in rules or day:
            prefix.append(LOCK_TEAM_SQL)
        sql = _STATEMENTS[key] = ";".join([*prefix, create])
    return sql


def insert_export(
    conn: Connection,
    team_id: uuid.UUID,
    owner_id: uuid.UUID,
    scope: str,
    filters: dict[str, Any],
    cap: int,
    quota: ExportQuota,
    returning: str,
    key: IdempotencyKey | None = None,
) -> Created:
    """Insert a WAITING export when every rule allows it (the caller validated ``scope``
    and ``filters``). Raises :class:`KeyInUse` when a concurrent request with ``key``
    committed first."""
    rules = dict(EXPORT_RULES)
    if cap > NO_CAP:
        rules.update(ROOM_RULE)
    if quota.per_day > NO_CAP:
        rules.update(RUNS_RULE)
    if quota.bytes_per_day > NO_CAP:
        rules.update(BYTES_RULE)
    sql = _statement("EXPORT", rules, quota.enabled, returning, key is not None)
    params = {
        "team_id": str(team_id),
        "owner_id": str(owner_id),
        "scope": scope,
        "filters": json.dumps(filters),
        "run_at": None,
        "cap": cap,
        "per_day": quota.per_day,
        "bytes_per_day": quota.bytes_per_day,
        "reserve_bytes": quota.reserve_bytes,
    }
    return _create(conn, sql, params, rules, returning, key)


def insert_reminder(
    conn: Connection,
    team_id: uuid.UUID,
    owner_id: uuid.UUID,
    ticket_id: uuid.UUID,
    run_at: datetime | None,
    cap: int,
    returning: str,
    key: IdempotencyKey | None = None,
) -> Created:
    """Insert a WAITING reminder when every rule allows it (the caller validated
    ``run_at``'s time zone), as :func:`insert_export`."""
    rules = dict(REMINDER_RULES)
    if cap > NO_CAP:
        rules.update(ROOM_RULE)
    sql = _statement("REMINDER", rules, False, returning, key is not None)
    params = {
        "team_id": str(team_id),
        "owner_id": str(owner_id),
        "scope": "TEAM",
        "filters": json.dumps({"ticket_id": str(ticket_id)}),
        "ticket_id": str(ticket_id),
        "run_at": run_at,
        "cap": cap,
    }
    return _create(conn, sql, params, rules, returning, key)


def _create(
    conn: Connection,
    sql: str,
    params: dict[str, Any],
    rules: dict[str, str],
    returning: str,
    key: IdempotencyKey | None,
) -> Created:
    params["trace_parent"] = tracing.current_parent()  # None when tracing is off
    if key is not None:
        params = {**params, **key.params()}
    try:
        cursor = prepared.execute(conn, sql, params, STATEMENT_TIMEOUT_MS)
    except psycopg2.IntegrityError as exc:
        if is_key_taken(exc):
            raise KeyInUse() from exc
        raise
    out = prepared.row_dict(cursor, cursor.fetchone())
    role = out.pop("role")
    passed = {name: bool(out.pop(name)) for name in rules}
    frees_in_s = out.pop("frees_in_s", None)
    fingerprint, task_id, run = (out.pop(name, None) for name in _HELD_COLUMNS)
    return Created(
        row=out if out.get("id") is not None else None,
        role=role,
        passed=passed,
        frees_in_s=max(1, int(frees_in_s or 1)),
        held=None if task_id is None else Remembered(task_id, int(run)),
        held_fingerprint=None if fingerprint is None else bytes(fingerprint),
    )
