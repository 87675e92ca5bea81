"""SQLAlchemy engines: one per process (per child after a fork), created on first use."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from teamdesk.config import get_settings

_engine: Engine | None = None
_lock = threading.Lock()

# Per connection (``conn.connection.info``): whether the ledger may prepare statements on
# this database session (DATABASE_PREPARED_STATEMENTS), and which it prepared already.
PREPARE_KEY = "teamdesk_prepare"
PREPARED_KEY = "teamdesk_prepared"


def sqlalchemy_url(url: str) -> str:
    """DATABASE_URL with the psycopg2 driver named (SQLAlchemy 2.1 defaults to psycopg 3)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix) :]
    return url


def make_engine(url: str, prepared_statements: bool = True, **kwargs: object) -> Engine:
    """An engine whose connections give up quickly when PostgreSQL is away.
    ``prepared_statements``: whether the ledger may prepare statements on its sessions
    (off behind PgBouncer in transaction pooling)."""
    url = sqlalchemy_url(url)
    connect_args = {"connect_timeout": 5, "application_name": "teamdesk-tasks"}
    # Pre-ping costs a round trip per checkout, but without it every pooled connection
    # that PostgreSQL dropped (a restart, a failover, pg_terminate_backend) fails its next
    # use, one task attempt each, in every worker process.
    options: dict[str, object] = {
        "pool_pre_ping": True,
        "pool_recycle": 1800,
        "pool_size": 5,
        "max_overflow": 10,
        "connect_args": connect_args,
    }
    options.update(kwargs)
    engine = sa.create_engine(url, **options)

    @sa.event.listens_for(engine, "connect")
    def _mark(_dbapi: object, record: sa.pool.ConnectionPoolEntry) -> None:
        record.info[PREPARE_KEY] = prepared_statements

    return engine


def may_prepare(info: dict[object, object]) -> bool:
    """Whether statements may be prepared on the session whose ``connection.info`` this is
    (an engine not made here: yes)."""
    return bool(info.get(PREPARE_KEY, True))


def get_engine() -> Engine:
    global _engine
    with _lock:
        if _engine is None:
            settings = get_settings()
            _engine = make_engine(settings.database_url, settings.database_prepared_statements)
        return _engine


def reset_engine(dispose: bool = True) -> None:
    """Forget the engine (after a fork, or when settings change in tests)."""
    global _engine
    with _lock:
        if _engine is not None and dispose:
            _engine.dispose(close=False)
        _engine = None
