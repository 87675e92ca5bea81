"""Export: a CSV of a team's tickets, streamed by one COPY into chunks or an object and
completed under the lease. The CSV contract and the title's formula guard: docs/design.md,
"Exports" (records end with LF).
"""

from __future__ import annotations

import functools
import sys
import unicodedata
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from itertools import compress
from typing import Any, NamedTuple

import psycopg2.errors
from sqlalchemy.engine import Connection

from ledger import artifacts, lease
from ledger.errors import CsvTooLarge, PermissionLost, TooManyRows
from ledger.filters import ExportFilters, validate_filters
from ledger.permissions import export_refusal
from tasks import watchdog
from tasks.execution import Context
from teamdesk import export_store, hooks, s3_store, tracing

HEADER = "id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at\n"

MSG_TOO_MANY = "The export matches more than {limit} tickets; narrow the filters."
MSG_TOO_LARGE = "The export's CSV would be larger than {limit} bytes; narrow the filters."

_TS = '\'YYYY-MM-DD"T"HH24:MI:SS"Z"\''

# What a spreadsheet may skip before it decides what a cell starts with: a rule over
# Unicode's data, not a list. OTHER_IGNORABLE includes the default-ignorable code points
# not assigned yet, which a newer spreadsheet may draw as nothing.
SKIPPED_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp", "Mn"})
OTHER_IGNORABLE = "\u115f\u1160\u2065\u3164\uffa0" + "".join(
    map(chr, [*range(0xFFF0, 0xFFF9), *range(0xE0000, 0xE1000)])
)
# What starts a formula, and every character whose NFKC form starts with one. TAB, CR and
# LF count anywhere in the skipped run (the regex backtracks to them).
FORMULA_STARTS = "=+-@|\u2212"
LINE_STARTS = "\t\n\r"


def guard_characters() -> tuple[str, str]:
    """The characters skipped before deciding what a title starts with (NUL left out: no
    text holds it), and those that start a formula, from Python's Unicode data (about
    0.3 s). Only a character with a decomposition has an NFKC form other than itself."""
    every = "".join(map(chr, range(1, sys.maxunicode + 1)))
    wanted = map(SKIPPED_CATEGORIES.__contains__, map(unicodedata.category, every))
    skipped = "".join(compress(every, wanted)) + OTHER_IGNORABLE
    decomposed = compress(every, map(unicodedata.decomposition, every))
    forms = (ch for ch in decomposed if _nfkc_starts_formula(ch))
    return skipped, LINE_STARTS + FORMULA_STARTS + "".join(forms)


def _nfkc_starts_formula(ch: str) -> bool:
    return unicodedata.normalize("NFKC", ch).startswith(tuple(FORMULA_STARTS))


def regex_class(characters: str) -> str:
    """A bracket expression's contents for PostgreSQL's regular expressions: runs of
    consecutive code points as ranges, every character as an escape (so none is special,
    and the text holds no quote, '%' or brace for mogrify or str.format to see)."""
    runs: list[list[int]] = []
    for code in sorted(set(map(ord, characters))):
        if runs and code == runs[-1][1] + 1:
            runs[-1][1] = code
        else:
            runs.append([code, code])
    return "".join(
        _escape(low) + ("" if low == high else "-" + _escape(high)) for low, high in runs
    )


def _escape(code: int) -> str:
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


class Guard(NamedTuple):
    """The formula guard as built from this Python's Unicode data: the characters skipped
    before deciding what a title starts with, those that start a formula, and the title
    cell that applies them."""

    skipped: str
    starts: str
    title_cell: str


@functools.cache
def guard() -> Guard:
    """The guard, built once per process at first need (about 0.3 s): a worker builds it
    before the pool forks (worker/lifecycle.py); processes that never export never pay.
    The title cell is one anchored regex (PostgreSQL's ARE reads the escapes)."""
    skipped, starts = guard_characters()
    cell = (
        f"CASE WHEN title ~ '^[{regex_class(skipped)}]*[{regex_class(starts)}]' "
        "THEN '''' || title ELSE title END"
    )
    return Guard(skipped, starts, cell)


COPY_OPTIONS = "FORMAT csv, FORCE_QUOTE *"


def csv_columns() -> str:
    """The CSV's cells, as COPY renders them."""
    return f"""id,
    {guard().title_cell},
    status, priority, requester_id, assignee_id,
    to_char(due_at AT TIME ZONE 'UTC', {_TS}),
    to_char(created_at AT TIME ZONE 'UTC', {_TS}),
    to_char(updated_at AT TIME ZONE 'UTC', {_TS})"""


def text_columns() -> str:
    """The same cells, each as text (the same CSV: a uuid or a name prints as its text),
    named c1..c9 so the marker row of STREAM fits beside them."""
    return f"""id::text AS c1,
    {guard().title_cell} AS c2,
    status::text AS c3, priority::text AS c4, requester_id::text AS c5,
    assignee_id::text AS c6,
    to_char(due_at AT TIME ZONE 'UTC', {_TS}) AS c7,
    to_char(created_at AT TIME ZONE 'UTC', {_TS}) AS c8,
    to_char(updated_at AT TIME ZONE 'UTC', {_TS}) AS c9"""


class ExportReadTimeout(Exception):
    """The export's read ran past EXPORT_READ_BUDGET_S (a failed attempt)."""


class ExportReadSilent(Exception):
    """The export's read went half of STALE_AFTER_S without progress and was cancelled
    before its silence could look like a stalled execution (a failed attempt)."""


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


# One statement, one snapshot: a marker row with the matching count (up to cap + 1), then
# the rows in order, or none past the cap: progress knows the total before the first row.
# Every cell is text, so the marker fits the same columns. (A MATERIALIZED CTE holding the
# rows to count them cost a quarter more than a second pass: bench/results/.)
STREAM = """
    SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;
    SET LOCAL statement_timeout = '{budget_ms}ms';
    COPY (
        WITH total AS (
            SELECT count(*) AS n FROM (SELECT 1 FROM tickets WHERE {where} LIMIT {cap} + 1) m
        )
        SELECT c1, c2, c3, c4, c5, c6, c7, c8, c9 FROM (
            SELECT 0 AS part, NULL::timestamptz AS at_, NULL::uuid AS id_, n::text AS c1,
                   NULL::text AS c2, NULL::text AS c3, NULL::text AS c4, NULL::text AS c5,
                   NULL::text AS c6, NULL::text AS c7, NULL::text AS c8, NULL::text AS c9
              FROM total
            UNION ALL
            SELECT 1, created_at, id, {columns} FROM tickets
             WHERE {where} AND (SELECT n FROM total) <= {cap}
        ) rows ORDER BY part, at_, id_
    ) TO STDOUT WITH ({copy_options})
"""


class CsvStream:
    """The file COPY writes to, one CSV record per call: first the marker row (the total),
    then one ticket each. Chunks and progress during the stream go through a second
    connection (the execution's is busy with the COPY), opened at the first need."""

    def __init__(
        self, ctx: Context, batch_size: int, reported: Callable[[], None], max_bytes: int = 0
    ) -> None:
        self.ctx, self.batch_size, self.reported = ctx, batch_size, reported
        self.max_bytes = max_bytes  # 0: no limit
        self.total: int | None = None
        self.rows = 0
        self.too_large = False
        self._progress: Connection | None = None
        self.writer = _writer(ctx)
        self.size = len(HEADER)
        self.writer.write(self._progress_conn, HEADER.encode())

    def write(self, record: bytes) -> None:
        if self.total is None:
            self.total = int(record.split(b",", 1)[0].strip(b'"'))  # "n",,,,,,,,
            return
        if self.too_large:
            return  # the CSV is refused: the rest of the stream is read and dropped
        if self.max_bytes and self.size + len(record) > self.max_bytes:
            self.too_large = True  # what was written is an orphan (ledger/artifacts.py)
            return
        self.writer.write(self._progress_conn, record)
        self.size += len(record)
        self.rows += 1
        if self.rows % self.batch_size == 0 and self.rows < self.total:
            _batch_done(self.ctx, self.rows, self.total, self._progress_conn())
            self.reported()

    def _progress_conn(self) -> Connection:
        """The second connection (a small export never needs it); the ledger bounds its
        statements."""
        if self._progress is None:
            self._progress = self.ctx.engine.connect()  # autocommit, as the execution's
        return self._progress

    def finish(self) -> artifacts.Artifact:
        """The last chunk, through the execution's connection (the COPY is done), and
        what was stored."""
        return self.writer.finish(self.ctx.conn)

    def abort(self) -> None:
        """Remove what was stored (an object store's upload; chunks are left to the purge)."""
        self.writer.abort()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()


def _writer(ctx: Context) -> artifacts.ChunkWriter | artifacts.ObjectSink:
    """Where this execution's CSV goes (EXPORT_STORE): chunks beside the row, or an object
    under a key of its own (teamdesk/export_store.py)."""
    held = ctx.lease
    target = export_store.parse_store(ctx.settings.export_store)
    if target is None:
        return artifacts.ChunkWriter(held.task_id, held.execution_id)
    upload = s3_store.object_store().writer(target, held.task_id, held.execution_id)
    return artifacts.ObjectSink(upload, held.execution_id)


def read_csv(ctx: Context, where: str, params: dict[str, Any]) -> CsvStream:
    """The export's rows as CSV, streamed by one COPY on the execution connection. Raises
    ExportReadTimeout, ExportReadSilent (tasks/watchdog.py), TooManyRows or CsvTooLarge."""
    dbapi = ctx.conn.connection.dbapi_connection
    cursor = dbapi.cursor()  # type: ignore[union-attr]
    limit = ctx.settings.export_max_rows
    budget_ms = max(1, round(ctx.settings.export_read_budget_s * 1000))
    query = STREAM.format(
        budget_ms=budget_ms,
        columns=text_columns(),
        copy_options=COPY_OPTIONS,
        where=where,
        cap=int(limit),
    )
    with watchdog.watch(dbapi, ctx.settings.stale_after_s / 2) as watch:
        stream = CsvStream(
            ctx, ctx.settings.export_batch_size, watch.touch, ctx.settings.export_max_bytes
        )
        try:
            try:
                cursor.copy_expert(cursor.mogrify(query, params).decode(), stream)
            except psycopg2.errors.QueryCanceled as exc:
                raise (ExportReadSilent() if watch.disarm() else ExportReadTimeout()) from exc
            finally:
                watch.disarm()  # the read has returned: no cancel may reach the completion
                stream.close()
            if stream.total is None or stream.total > limit:
                raise TooManyRows(MSG_TOO_MANY.format(limit=limit))
            if stream.too_large:
                raise CsvTooLarge(MSG_TOO_LARGE.format(limit=ctx.settings.export_max_bytes))
        except BaseException:
            stream.abort()
            raise
    return stream


def run_export(ctx: Context) -> str:
    claim = ctx.claim
    filters = validate_filters(claim.filters)
    require_permission(claim.scope, claim.owner_role)  # as of the claim
    where, params = where_clause(claim, filters)
    stream = read_csv(ctx, where, params)
    tracing.event("export.read", rows=stream.rows)
    if stream.rows:
        # Nothing comes between the read and the completion, whose guard checks the role.
        hooks.fire("export.after_read", claim=claim, done=stream.rows, total=stream.rows)
    hooks.fire("export.before_result_write", claim=claim)
    summary = f"{stream.rows} rows"
    try:
        lease.complete_export(ctx.conn, claim.lease, stream.finish(), summary)
    except BaseException:
        stream.abort()  # not completed: nothing may keep what this execution stored
        raise
    tracing.event("export.completed")
    return summary


def _batch_done(ctx: Context, done: int, total: int, conn: Connection) -> None:
    hooks.fire("export.after_read", claim=ctx.claim, done=done, total=total)
    ctx.report_progress(conn, min(99, done * 100 // total), done, total)
