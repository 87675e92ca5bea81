"""Hot-path statements sent straight to the driver, each prepared once per database session
(docs/design.md, "Lease"): they skip SQLAlchemy's statement layer (about 100 µs each) and
PostgreSQL's parse and plan (as much again). A lost connection is still invalidated, so the
pool drops it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import psycopg2
from psycopg2.extensions import TRANSACTION_STATUS_IDLE
from sqlalchemy import TextClause, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from teamdesk.db import PREPARED_KEY, may_prepare

_PYFORMAT = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True)
class _Prepared:
    """A statement as a prepared statement of the session: what runs in the same round
    trip before it (``prefix``), its body with ``$n`` parameters."""

    name: str
    prefix: str
    body: str
    names: tuple[str, ...]

    def execute_sql(self) -> str:
        arguments = ", ".join(f"%({name})s" for name in self.names)
        return f"{self.prefix} EXECUTE {self.name}({arguments})"


_FORMS: dict[str, _Prepared] = {}


def _form(sql: str) -> _Prepared:
    form = _FORMS.get(sql)
    if form is None:
        prefix, _, body = sql.rpartition(";")
        names = tuple(dict.fromkeys(_PYFORMAT.findall(body)))
        converted = _PYFORMAT.sub(lambda m: f"${names.index(m.group(1)) + 1}", body)
        name = "td_prep_" + hashlib.sha256(sql.encode()).hexdigest()[:12]
        form = _FORMS[sql] = _Prepared(name, prefix + ";" if prefix else "", converted, names)
    return form


def statement_name(sql: str) -> str:
    """The name ``sql`` is prepared under on a session."""
    return _form(sql).name


def prepared_sql(conn: Connection, cursor: Any, sql: str) -> str:
    """``sql`` (psycopg2 ``%(name)s`` parameters; statements before its last ``;`` are a
    prefix sent as they are) to run on this session: its body prepared the first time, then
    executed by name; unprepared where the engine says so. A prepared statement outlives a
    rolled-back transaction; a new session starts with none."""
    if not may_prepare(conn.connection.info):
        return sql
    form = _form(sql)
    prepared: set[str] = conn.connection.info.setdefault(PREPARED_KEY, set())
    if form.name not in prepared:
        cursor.execute(f"PREPARE {form.name} AS {form.body}")
        prepared.add(form.name)
    return form.execute_sql()


def execute(
    conn: Connection, sql: str | bytes, params: dict[str, Any] | None, timeout_ms: int
) -> Any:
    """Run one statement on ``conn``'s DBAPI connection (inside its transaction, if any)
    and return the cursor; text as the session's prepared statement, bytes as they are.
    With no transaction open it is bounded by ``timeout_ms`` in the same round trip. A
    connection that is not in autocommit begins its transaction as SQLAlchemy's own
    ``execute`` would, so the caller's ``commit`` ends it."""
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    if not dbapi.autocommit and not conn.in_transaction():
        conn.begin()  # SQLAlchemy's autobegin, as its own execute does: commit() ends it
    cursor = dbapi.cursor()
    try:
        if isinstance(sql, str):
            sql = prepared_sql(conn, cursor, sql)
        if dbapi.info.transaction_status == TRANSACTION_STATUS_IDLE:
            sql = bounded(sql, timeout_ms)
        cursor.execute(sql, params)
    except psycopg2.Error as exc:
        if exc.pgcode == UNDEFINED_PREPARED_STATEMENT:
            # A pooler handed us another server session: forget the set, prepare again.
            conn.connection.info.pop(PREPARED_KEY, None)
        elif isinstance(
            exc, psycopg2.OperationalError | psycopg2.InterfaceError
        ) and connection_lost(dbapi, exc):
            conn.invalidate()  # the server connection is gone: the pool must not reuse it
        raise
    return cursor


UNDEFINED_PREPARED_STATEMENT = "26000"  # SQLSTATE invalid_sql_statement_name
# SQLSTATE classes that pass by themselves: connection, transaction rollback, resources,
# operator intervention (timeouts, shutdown), system; and lock_not_available.
_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58")
_TRANSIENT_CODES = frozenset({"55P03"})


def is_transient(exc: BaseException) -> bool:
    """Whether a failed database call may succeed if tried again later (docs/design.md,
    "Lease"): not a missing prepared statement, a permission, an undefined name, a bug."""
    if isinstance(exc, OSError | sa_exc.TimeoutError):
        return True  # the network, or no pooled connection free in time
    orig = getattr(exc, "orig", None) or exc
    if not isinstance(orig, psycopg2.Error):
        return False
    code = orig.pgcode
    if not code:  # no SQLSTATE: the connection failed or was lost (as connection_lost says)
        return True
    return code.startswith(_TRANSIENT_CLASSES) or code in _TRANSIENT_CODES


def connection_lost(dbapi: Any, exc: psycopg2.Error) -> bool:
    """Whether ``exc`` lost the session (the connection is closed, the error has no
    SQLSTATE, or it is a connection or shutdown class one), rather than ended one
    statement (a statement or lock timeout, a deadlock) on a connection still usable."""
    code = exc.pgcode or ""
    return bool(dbapi.closed) or not code or code.startswith(("08", "57P"))


def bounded(sql: str | bytes, timeout_ms: int) -> str | bytes:
    """``sql`` preceded, in the same implicit transaction, by its statement timeout."""
    bound = f"SELECT set_config('statement_timeout', '{int(timeout_ms)}ms', true); "
    return bound.encode() + sql if isinstance(sql, bytes) else bound + sql


def end_transaction(conn: Connection, commit: bool) -> None:
    """COMMIT or ROLLBACK the transaction a statement opened on ``conn``'s driver
    connection (``BEGIN`` sent as SQL, outside SQLAlchemy's own); a lost session
    invalidates the connection, so its pool drops it, and raises."""
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    try:
        dbapi.cursor().execute("COMMIT" if commit else "ROLLBACK")
    except (psycopg2.OperationalError, psycopg2.InterfaceError):
        conn.invalidate()
        raise


def as_text(sql: str) -> TextClause:
    """The SQLAlchemy form of a statement written for the driver (``%(name)s`` becomes
    ``:name``), so the sequential paths run the very SQL the hot path sends."""
    return text(_PYFORMAT.sub(r":\1", sql))


def row_dict(cursor: Any, row: tuple[Any, ...]) -> dict[str, Any]:
    """``row`` of ``cursor``'s result by column name."""
    return {column.name: value for column, value in zip(cursor.description, row, strict=True)}
