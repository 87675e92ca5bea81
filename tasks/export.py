"""Export: a CSV of a team's tickets, read in keyset batches, committed under the lease.

PostgreSQL renders the CSV (``COPY ... TO STDOUT WITH (FORMAT csv)``) and Python only
concatenates text: memory holds the CSV and nothing per row. An export that fits in one
batch is one COPY statement (a statement is its own consistent snapshot); a larger one
is read batch by batch inside one REPEATABLE READ, READ ONLY transaction bounded to 60 s,
so every batch sees the same snapshot.

The CSV contract (docs/design.md, "Exports"): UTF-8; header ``id,title,status,priority,requester_id,
assignee_id,due_at,created_at,updated_at``; rows ordered by ``created_at, id``; times in
UTC as ``YYYY-MM-DDTHH:MM:SSZ``; NULL as an empty cell; RFC 4180 quoting (a field with a
comma, quote, CR or LF is quoted, quotes doubled; an empty text is written ``""``); records
end with LF; a cell starting with ``=``, ``+``, ``-``, ``@``, TAB or CR gets a leading ``'``
(OWASP's CSV-injection guidance: spreadsheets skip a leading TAB or CR and run the rest).
"""

from __future__ import annotations

import io
import itertools
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger import lease
from ledger.errors import PermissionLost, TooManyRows
from ledger.filters import ExportFilters, validate_filters
from ledger.permissions import export_refusal
from ledger.service import role_of
from tasks.execution import Context
from teamdesk import hooks

HEADER = "id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at\n"
READ_BUDGET_S = 60

MSG_TOO_MANY = "The export matches more than {limit} tickets; narrow the filters."

_TS = '\'YYYY-MM-DD"T"HH24:MI:SS"Z"\''
CSV_COLUMNS = f"""id,
    CASE WHEN left(title, 1) IN ('=', '+', '-', '@', chr(9), chr(13)) THEN '''' || title
         ELSE title END,
    status, priority, requester_id, assignee_id,
    to_char(due_at AT TIME ZONE 'UTC', {_TS}),
    to_char(created_at AT TIME ZONE 'UTC', {_TS}),
    to_char(updated_at AT TIME ZONE 'UTC', {_TS})"""


class ExportReadTimeout(Exception):
    """The export's read transaction ran past its 60 s budget."""


def require_permission(scope: str, creator_role: str | None) -> None:
    """PermissionLost unless a creator with ``creator_role`` may still run this export."""
    refusal = export_refusal(scope, creator_role)
    if refusal is not None:
        raise PermissionLost(refusal)


def where_clause(claim: lease.Claim, filters: ExportFilters) -> tuple[str, dict[str, Any]]:
    """The ticket predicate for this export, with bound parameters."""
    parts = ["team_id = %(team_id)s"]
    params: dict[str, Any] = {"team_id": str(claim.team_id)}
    if claim.scope == "MINE":
        parts.append("(requester_id = %(owner_id)s OR assignee_id = %(owner_id)s)")
        params["owner_id"] = str(claim.owner_id)
    if filters.status:
        parts.append("status = ANY(%(status)s)")
        params["status"] = list(filters.status)
    if filters.priority:
        parts.append("priority = ANY(%(priority)s)")
        params["priority"] = list(filters.priority)
    if filters.assignee_id:
        parts.append("assignee_id = %(assignee_id)s")
        params["assignee_id"] = str(filters.assignee_id)
    if filters.created_from:
        parts.append("created_at >= %(created_from)s")
        params["created_from"] = _utc_midnight(filters.created_from)
    if filters.created_to:
        parts.append("created_at < %(created_to)s")
        params["created_to"] = _utc_midnight(filters.created_to) + timedelta(days=1)
    if filters.q:
        parts.append("strpos(lower(title), lower(%(q)s)) > 0")
        params["q"] = filters.q
    return " AND ".join(parts), params


def _utc_midnight(day: date) -> datetime:
    return datetime.combine(day, dtime(0, 0), tzinfo=UTC)


class TicketReader:
    """Counts, splits and renders the matching tickets on one connection."""

    def __init__(self, conn: Connection, where: str, params: dict[str, Any]) -> None:
        self.cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        self.where, self.params = where, params

    def count_up_to(self, limit: int) -> int:
        self.cursor.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM tickets WHERE {self.where} LIMIT %(lim)s) s",
            {**self.params, "lim": limit},
        )
        row = self.cursor.fetchone()
        assert row is not None
        return int(row[0])

    def boundaries(self, batch_size: int) -> list[tuple[datetime, uuid.UUID]]:
        """The (created_at, id) key closing every full batch, in order."""
        self.cursor.execute(
            f"""
            SELECT created_at, id FROM (
                SELECT created_at, id, row_number() OVER (ORDER BY created_at, id) AS rn
                  FROM tickets WHERE {self.where}) s
             WHERE rn %% %(batch)s = 0 ORDER BY rn""",
            {**self.params, "batch": batch_size},
        )
        return [(row[0], row[1]) for row in self.cursor.fetchall()]

    def batches(self, batch_size: int, total: int) -> Iterator[str]:
        """CSV text of each keyset batch of ``batch_size`` rows (the last may be short)."""
        keys: list[Any] = [None, *self.boundaries(batch_size)]
        if total % batch_size:
            keys.append(None)
        for low, high in itertools.pairwise(keys):
            yield self.render(low, high)[0]

    def render(self, low: Any, high: Any, limit: int | None = None) -> tuple[str, int]:
        """CSV text of the rows after ``low`` up to ``high`` (keys), and how many."""
        where, params = self.where, dict(self.params)
        if low is not None:
            where += " AND (created_at, id) > (%(lo_at)s, %(lo_id)s)"
            params.update(lo_at=low[0], lo_id=low[1])
        if high is not None:
            where += " AND (created_at, id) <= (%(hi_at)s, %(hi_id)s)"
            params.update(hi_at=high[0], hi_id=high[1])
        tail = " LIMIT %(row_limit)s" if limit is not None else ""
        params["row_limit"] = limit
        query = self.cursor.mogrify(
            f"SELECT {CSV_COLUMNS} FROM tickets WHERE {where} ORDER BY created_at, id{tail}",
            params,
        )
        out = io.StringIO()
        self.cursor.copy_expert(f"COPY ({query.decode()}) TO STDOUT WITH (FORMAT csv)", out)
        return out.getvalue(), int(self.cursor.rowcount)


def run_export(ctx: Context) -> str:
    claim = ctx.claim
    filters = validate_filters(claim.filters)
    require_permission(claim.scope, claim.owner_role)  # as of the claim
    where, params = where_clause(claim, filters)
    parts, total = _read_small(ctx, where, params)
    if parts is None:
        parts, total = _read_in_batches(ctx, where, params)
    require_permission(claim.scope, role_of(ctx.conn, claim.team_id, claim.owner_id))  # now
    hooks.fire("export.before_result_write", claim=claim)
    summary = f"{total} rows"
    lease.complete_export(ctx.conn, claim.lease, "".join(parts), summary)
    return summary


def _read_small(ctx: Context, where: str, params: dict[str, Any]) -> tuple[list[str] | None, int]:
    """Most exports fit in one batch: one COPY statement (its own consistent snapshot)
    reads them all. ``None`` when the batch came back full: read in batches instead."""
    batch_size, limit = ctx.settings.export_batch_size, ctx.settings.export_max_rows
    chunk, rows = TicketReader(ctx.conn, where, params).render(None, None, limit=batch_size)
    if rows >= batch_size:
        return None, 0
    if rows > limit:
        raise TooManyRows(MSG_TOO_MANY.format(limit=limit))
    if rows:
        _batch_done(ctx, rows, rows)
    return [HEADER, chunk], rows


def _read_in_batches(ctx: Context, where: str, params: dict[str, Any]) -> tuple[list[str], int]:
    """Keyset batches inside one REPEATABLE READ, READ ONLY transaction bounded to 60 s."""
    limit, batch_size = ctx.settings.export_max_rows, ctx.settings.export_batch_size
    deadline = time.monotonic() + READ_BUDGET_S
    parts = [HEADER]
    with ctx.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with conn.begin():
            conn.execute(
                text(
                    f"SET LOCAL statement_timeout = '{READ_BUDGET_S}s'; "
                    f"SET LOCAL idle_in_transaction_session_timeout = "
                    f"'{READ_BUDGET_S}s'"
                )
            )
            reader = TicketReader(conn, where, params)
            total = reader.count_up_to(limit + 1)
            if total > limit:
                raise TooManyRows(MSG_TOO_MANY.format(limit=limit))
            done = 0
            for chunk in reader.batches(batch_size, total):
                parts.append(chunk)
                done = min(total, done + batch_size)
                _batch_done(ctx, done, total)
                if time.monotonic() > deadline:
                    raise ExportReadTimeout()
    return parts, total


def _batch_done(ctx: Context, done: int, total: int) -> None:
    hooks.fire("export.after_read", claim=ctx.claim, done=done, total=total)
    ctx.report_progress(min(99, done * 100 // total), done, total)
