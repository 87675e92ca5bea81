"""A task's creation in one round trip: every check and the insert in one statement.

:func:`ledger.service.submit_export` and ``submit_reminder`` check, one statement at a
time, who asks (their role in the team), the ticket, the reminder's time, the team's cap
on unfinished tasks and its daily export quota, then insert; each check that fails says
why. That is five to seven round trips for the API's most frequent request. Here the same
rules are the ``WHERE`` of one ``INSERT ... SELECT``, prepared once per session, after the
team's lock in the same round trip (``LOCK_TEAM_SQL``, then the insert: two statements of
one implicit transaction on an autocommit connection, or of the caller's transaction). The
insert's snapshot is taken after the lock is granted, so the counts see every creation of
the team that committed before, as the sequential path's do. The insert returns the new
task's view, or no row when a rule refused it: the caller then runs the sequential path,
which says which rule (and creates the task after all if nothing refuses it any more).

With an Idempotency-Key the same statement also holds the key (ledger/idempotency.py): the
task is inserted only while no live row holds it, and the key's row with the task.

The rules are the sequential path's own SQL: ``ledger/permissions.py`` (``MAY_CREATE_*``)
and ``ledger/quota.py`` (``UNFINISHED_SQL``, ``EXPORTS_OF_THE_DAY_SQL``).
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

import psycopg2
from sqlalchemy.engine import Connection

from ledger import prepared
from ledger.idempotency import (
    CLAIM_SQL,
    FORGET_EXPIRED_KEY_SQL,
    KEY_FREE_SQL,
    IdempotencyKey,
    KeyInUse,
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

_INSERT = """
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, run_at, trace_parent)
    SELECT '{kind}', CAST(%(team_id)s AS uuid), CAST(%(owner_id)s AS uuid),
           CAST(%(scope)s AS text), CAST(%(filters)s AS jsonb),
           greatest(coalesce(CAST(%(run_at)s AS timestamptz), now()), now()),
           CAST(%(trace_parent)s AS text)
     WHERE {conditions}
    RETURNING {returning}"""

# With an Idempotency-Key (ledger/idempotency.py): the task only while no live row holds
# the key, and the key's row with it; a concurrent insert of the same key fails on the
# primary key, and this statement's task with it.
_KEYED = """
    WITH task AS ({insert}
    ), claimed AS ({claim}
    )
    SELECT * FROM task"""

_STATEMENTS: dict[tuple[Any, ...], str] = {}


def _statement(
    kind: str, conditions: tuple[str, ...], locked: bool, returning: str, keyed: bool
) -> str:
    key = (kind, conditions, locked, returning, keyed)
    sql = _STATEMENTS.get(key)
    if sql is None:
        if keyed:
            conditions = (*conditions, KEY_FREE_SQL)
        insert = _INSERT.format(
            kind=kind, conditions="\n       AND ".join(conditions), returning=returning
        )
        prefix = [LOCK_TEAM_SQL] if locked else []
        if keyed:
            insert = _KEYED.format(insert=insert, claim=CLAIM_SQL)
            prefix.insert(0, FORGET_EXPIRED_KEY_SQL)
        sql = _STATEMENTS[key] = ";".join([*prefix, insert])
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
) -> dict[str, Any] | None:
    """Insert a WAITING export when every rule allows it (the caller validated ``scope``
    and ``filters``); its ``returning`` columns, or None when a rule refused it or a live
    row holds ``key`` (``returning`` then names ``id``, ``team_id``, ``owner_id`` and
    ``run``); :class:`KeyInUse` when a concurrent request with ``key`` won."""
    conditions = [MAY_CREATE_EXPORT_SQL]
    if cap > NO_CAP:
        conditions.append(f"{UNFINISHED_SQL} < %(cap)s")
    day: list[str] = []
    if quota.per_day > NO_CAP:
        day.append("count(*) < %(per_day)s")
    if quota.bytes_per_day > NO_CAP:
        day.append(f"{HELD_BYTES_SQL} + %(reserve_bytes)s <= %(bytes_per_day)s")
    if day:
        conditions.append(f"(SELECT {' AND '.join(day)} {EXPORTS_OF_THE_DAY_SQL})")
    sql = _statement(
        "EXPORT", tuple(conditions), cap > NO_CAP or bool(day), returning, key is not None
    )
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
    return _insert(conn, sql, params, key)


def insert_reminder(
    conn: Connection,
    team_id: uuid.UUID,
    owner_id: uuid.UUID,
    ticket_id: uuid.UUID,
    run_at: datetime | None,
    cap: int,
    returning: str,
    key: IdempotencyKey | None = None,
) -> dict[str, Any] | None:
    """Insert a WAITING reminder when every rule allows it (the caller validated
    ``run_at``'s time zone); its ``returning`` columns, or None when a rule refused it or
    a live row holds ``key``, as :func:`insert_export`."""
    conditions = [
        MAY_CREATE_REMINDER_SQL,
        f"EXISTS ({TICKET_IN_TEAM_SQL})",
        f"(CAST(%(run_at)s AS timestamptz) IS NULL"
        f" OR CAST(%(run_at)s AS timestamptz) {RUN_AT_WINDOW_SQL})",
    ]
    if cap > NO_CAP:
        conditions.append(f"{UNFINISHED_SQL} < %(cap)s")
    sql = _statement("REMINDER", tuple(conditions), cap > NO_CAP, returning, key is not None)
    params = {
        "team_id": str(team_id),
        "owner_id": str(owner_id),
        "scope": "TEAM",
        "filters": json.dumps({"ticket_id": str(ticket_id)}),
        "ticket_id": str(ticket_id),
        "run_at": run_at,
        "cap": cap,
    }
    return _insert(conn, sql, params, key)


def _insert(
    conn: Connection, sql: str, params: dict[str, Any], key: IdempotencyKey | None
) -> dict[str, Any] | None:
    params["trace_parent"] = tracing.current_parent()  # None when tracing is off
    if key is not None:
        params = {**params, **key.params()}
    try:
        cursor = prepared.execute(conn, sql, params, STATEMENT_TIMEOUT_MS)
    except psycopg2.IntegrityError as exc:
        if is_key_taken(exc):
            raise KeyInUse() from exc
        raise
    row = cursor.fetchone()
    return None if row is None else prepared.row_dict(cursor, row)
