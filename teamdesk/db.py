"""SQLAlchemy engines: one per process (per child after a fork), created on first use."""

from __future__ import annotations

import math
import select
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg2
import sqlalchemy as sa
from psycopg2.extensions import TRANSACTION_STATUS_IDLE
from sqlalchemy.engine import Connection, Engine

from teamdesk.config import database_hosts, get_settings

_engine: Engine | None = None
_execution_engine: Engine | None = None
_lock = threading.Lock()

# Per connection (``conn.connection.info``): whether the ledger may prepare statements on
# this database session (DATABASE_PREPARED_STATEMENTS), and which it prepared already.
PREPARE_KEY = "teamdesk_prepare"
PREPARED_KEY = "teamdesk_prepared"


def sqlalchemy_url(url: str) -> str:
    """DATABASE_URL with the psycopg2 driver named (SQLAlchemy 2.1 defaults to psycopg 3).

    libpq's list of hosts (``postgresql://u@h1:5432,h2:5432/db?target_session_attrs=
    read-write``, a primary and its standbys, tried in order) is written in SQLAlchemy's
    form, one ``host`` query parameter per host (``postgresql+psycopg2://u@/db?host=h1:5432
    &host=h2:5432&...``); the driver hands libpq the same list."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg2://" + url[len(prefix) :]
    hosts = database_hosts(url)
    if len(hosts) == 1:
        return url
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    query = "&".join([*(f"host={host}" for host in hosts), *filter(None, [parts.query])])
    return urlunsplit((parts.scheme, f"{user}@" if user else "", parts.path, query, ""))


def make_engine(url: str, prepared_statements: bool = True, **kwargs: object) -> Engine:
    """An engine whose connections give up quickly when PostgreSQL is away.
    ``prepared_statements``: whether the ledger may prepare statements on its sessions
    (off behind PgBouncer in transaction pooling)."""
    url = sqlalchemy_url(url)
    connect_args = {"connect_timeout": 5, "application_name": "teamdesk-tasks"}
    options: dict[str, Any] = {
        "pool_recycle": 1800,
        "pool_size": 5,
        "max_overflow": 10,
        "connect_args": connect_args,
    }
    options.update(kwargs)
    options["connect_args"] = {**KEEPALIVES, **options["connect_args"]}
    engine = sa.create_engine(url, **options)

    @sa.event.listens_for(engine, "connect")
    def _mark(_dbapi: object, record: sa.pool.ConnectionPoolEntry) -> None:
        record.info[PREPARE_KEY] = prepared_statements

    @sa.event.listens_for(engine, "checkout")
    def _refuse_hung_up(dbapi: Any, _record: object, _proxy: object) -> None:
        if hung_up(dbapi):
            raise sa.exc.DisconnectionError(MSG_HUNG_UP)

    return engine


MSG_HUNG_UP = "PostgreSQL closed this pooled connection while it was idle"


def hung_up(dbapi: Any) -> bool:
    """Whether the server closed this idle psycopg2 connection (a restart, a failover,
    ``pg_terminate_backend``, an idle timeout), told without a round trip. A server that
    ends a session sends its reason (a FATAL message) and closes the socket, so an idle
    connection with something to read has been hung up on, unless what waits is only a
    notification (a ``LISTEN``): libpq reads whatever is there (``poll``), and the server's
    last word arrives as a notice, or the end of the stream raises.

    This replaces SQLAlchemy's pre-ping (a ``SELECT 1`` round trip at every checkout, a
    third of an export's round trips). A pooled connection dropped since its last use is
    still replaced before anything is sent on it; a flow that a NAT or load balancer
    dropped silently is kept alive by TCP keepalives (``KEEPALIVES``); neither check can
    tell a frozen or unreachable server from a slow one, which the statement timeouts
    bound."""
    try:
        for _ in range(_POLLS):
            if dbapi.closed:
                return True
            poller = select.poll()
            poller.register(dbapi.fileno(), select.POLLIN)
            if not poller.poll(0):
                return False
            notices = len(dbapi.notices), (dbapi.notices[-1] if dbapi.notices else None)
            dbapi.poll()
            if (len(dbapi.notices), dbapi.notices[-1] if dbapi.notices else None) != notices:
                return True  # a notice while idle: the server's reason for closing
    except (psycopg2.Error, OSError):
        return True
    return True  # still something to read after every poll: not an idle session


_POLLS = 3  # a notification or two may wait; more than that is not an idle session

# TCP keepalives on every connection: an idle pooled connection keeps its flow open
# through NATs and load balancers that drop silent flows after a few minutes (the next
# packet would get a reset, so the first statement after the idle time would fail), and
# a peer that vanished is noticed within about 90 s.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 60,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def bound_transactions(engine: Engine, statement_timeout_ms: int, **settings: str) -> Engine:
    """Open every transaction of ``engine`` with its bounds, as settings of that
    transaction only (``set_config(..., true)``, one round trip): what startup parameters
    would do, which PgBouncer refuses, and what a session-wide setting must not do behind
    a pooler in transaction mode (the next client of that server connection would
    inherit it). ``settings``: more of them, e.g. ``synchronous_commit``.
    For engines whose connections run transactions (not autocommit)."""
    values = {"statement_timeout": f"{int(statement_timeout_ms)}ms", **settings}
    statement = "SELECT " + ", ".join(
        f"set_config('{name}', '{value}', true)" for name, value in values.items()
    )

    @sa.event.listens_for(engine, "begin")
    def _bound(conn: Connection) -> None:
        conn.exec_driver_sql(statement)

    return engine


# Errors that mean "PostgreSQL is unreachable or stuck", not a bug (the ledger's hot-path
# statements run on the driver's cursor, so the driver's own errors count too).
DATABASE_ERRORS = (
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.TimeoutError,
    psycopg2.OperationalError,
    psycopg2.InterfaceError,
)


def select_one(database_url: str, *, timeout_s: float, application_name: str) -> bool:
    """Whether PostgreSQL answers ``SELECT 1`` on a new, short-lived connection (no pool:
    nothing crosses a fork), connect and statement each bounded by ``timeout_s``; raises
    when it cannot be reached."""
    conn = psycopg2.connect(
        libpq_url(database_url),
        connect_timeout=max(2, math.ceil(timeout_s)),  # libpq: whole seconds, 2 at least
        application_name=application_name,
    )
    try:
        return answers(conn, timeout_s)
    finally:
        conn.close()


def libpq_url(url: str) -> str:
    """DATABASE_URL as libpq reads it (it does not know SQLAlchemy's ``+driver``)."""
    return url.replace("postgresql+psycopg2://", "postgresql://", 1)


# One round trip, one transaction: the bound is set for this transaction only (never a
# startup option: PgBouncer refuses those; never the session's: a pooler passes it on).
BOUNDED_SELECT_ONE = "SELECT set_config('statement_timeout', %s, true); SELECT 1"


def answers(conn: Any, timeout_s: float) -> bool:
    """Whether ``conn`` (a psycopg2 connection, not in autocommit) answers ``SELECT 1``
    within ``timeout_s``; ends its transaction either way."""
    try:
        with conn.cursor() as cur:
            cur.execute(BOUNDED_SELECT_ONE, (f"{max(1, round(timeout_s * 1000))}ms",))
            return bool(cur.fetchone() == (1,))
    finally:
        conn.rollback()


def may_prepare(info: dict[object, object]) -> bool:
    """Whether statements may be prepared on the session whose ``connection.info`` this is
    (an engine not made here: yes)."""
    return bool(info.get(PREPARE_KEY, True))


@contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    """A connection of ``engine``'s pool whose driver connection is in autocommit for this
    checkout, for statements sent straight to the driver (ledger/prepared.py): each commits
    by itself, with no BEGIN or COMMIT round trip. psycopg2 switches autocommit without a
    statement (SQLAlchemy's isolation-level option would reset the session on return:
    one more round trip), and it is switched back before the connection returns to the
    pool, so the next checkout finds it as the pool made it. Only for statements sent to
    the driver: SQLAlchemy's own ``execute`` would begin a transaction of its own (and,
    on an engine with ``bound_transactions``, bound only that one). A connection left
    inside a transaction is dropped rather than returned."""
    with engine.connect() as conn:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        dbapi.autocommit = True
        try:
            yield conn
        finally:
            if conn.invalidated or dbapi.closed:
                pass
            elif dbapi.info.transaction_status != TRANSACTION_STATUS_IDLE:
                conn.invalidate()  # a transaction left open (an explicit BEGIN): not reusable
            else:
                dbapi.autocommit = False


def get_engine() -> Engine:
    global _engine
    with _lock:
        if _engine is None:
            settings = get_settings()
            _engine = make_engine(settings.database_url, settings.database_prepared_statements)
        return _engine


def get_execution_engine() -> Engine:
    """The pool of task executions' own connections: autocommit from the start, so a
    checkout and a return cost no statement (a connection switched to autocommit for one
    checkout is switched back when it returns: one more round trip). Each ledger write of
    an execution is one statement that commits by itself; a reminder opens and ends its
    transaction explicitly."""
    global _execution_engine
    with _lock:
        if _execution_engine is None:
            settings = get_settings()
            _execution_engine = make_engine(
                settings.database_url,
                settings.database_prepared_statements,
                isolation_level="AUTOCOMMIT",
            )
        return _execution_engine


def reset_engine(dispose: bool = True) -> None:
    """Forget the engines (after a fork, or when settings change in tests)."""
    global _engine, _execution_engine
    with _lock:
        for engine in (_engine, _execution_engine):
            if engine is not None and dispose:
                engine.dispose(close=False)
        _engine = _execution_engine = None
