"""SQLAlchemy engines, one per process (per child after a fork), created on first use
(docs/design.md, "Lease", connections and bounds per transaction)."""

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
    """DATABASE_URL with the psycopg2 driver named (SQLAlchemy 2.1 defaults to psycopg 3),
    and libpq's list of hosts as SQLAlchemy's ``?host=h1:5432&host=h2:5432``."""
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
    """An engine whose connections give up quickly when PostgreSQL is away, and whose
    checkout refuses a hung-up connection (:func:`hung_up`)."""
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
    """Whether the server closed this idle psycopg2 connection, told without a round trip:
    readable data that is not only a notification is the server's last word (a notice
    after ``poll``, or an error at the end of the stream)."""
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

# Keep idle pooled flows open through NATs and load balancers that drop silent ones; a
# vanished peer is noticed within about 90 s.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 60,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def bound_transactions(engine: Engine, statement_timeout_ms: int, **settings: str) -> Engine:
    """Open every transaction of ``engine`` with its bounds, set for that transaction only
    (``set_config(..., true)``); ``settings``: more, e.g. ``synchronous_commit``. Not for
    autocommit engines."""
    values = {"statement_timeout": f"{int(statement_timeout_ms)}ms", **settings}
    statement = "SELECT " + ", ".join(
        f"set_config('{name}', '{value}', true)" for name, value in values.items()
    )

    @sa.event.listens_for(engine, "begin")
    def _bound(conn: Connection) -> None:
        conn.exec_driver_sql(statement)

    return engine


# "PostgreSQL is unreachable or stuck", not a bug; hot-path statements raise psycopg2's own.
DATABASE_ERRORS = (
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.TimeoutError,
    psycopg2.OperationalError,
    psycopg2.InterfaceError,
)


def select_one(database_url: str, *, timeout_s: float, application_name: str) -> bool:
    """Whether PostgreSQL answers ``SELECT 1`` on a new connection (no pool: nothing crosses
    a fork), connect and statement each bounded by ``timeout_s``; raises when unreachable."""
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


# One round trip; the bound is for this transaction only.
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
    """A pooled connection with psycopg2's autocommit on for this checkout (no statement
    sent), switched back on return; one left inside a transaction is dropped instead.
    Only for statements sent straight to the driver (ledger/prepared.py): SQLAlchemy's
    ``execute`` would begin a transaction of its own."""
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
    """The pool of task executions' own connections, in autocommit from the start; a
    reminder opens and ends its transaction explicitly."""
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
