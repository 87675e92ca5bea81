"""SQLAlchemy engines: one per process (per child after a fork), created on first use."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from teamdesk.config import get_settings

_engine: Engine | None = None
_lock = threading.Lock()


def sqlalchemy_url(url: str) -> str:
    """DATABASE_URL with the psycopg2 driver named (SQLAlchemy 2.1 defaults to psycopg 3)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix) :]
    return url


def make_engine(url: str, **kwargs: object) -> Engine:
    """An engine whose connections give up quickly when PostgreSQL is away."""
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
    return sa.create_engine(url, **options)


def get_engine() -> Engine:
    global _engine
    with _lock:
        if _engine is None:
            _engine = make_engine(get_settings().database_url)
        return _engine


def reset_engine(dispose: bool = True) -> None:
    """Forget the engine (after a fork, or when settings change in tests)."""
    global _engine
    with _lock:
        if _engine is not None and dispose:
            _engine.dispose(close=False)
        _engine = None
