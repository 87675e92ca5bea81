"""What the API holds open (settings, engines, Redis), created on first use so that building
the app needs no server (docs/design.md, "HTTP API").
"""

from __future__ import annotations

import threading
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from api.bounded import SharedCheck
from api.downloads import Slots
from teamdesk.config import Settings, get_settings
from teamdesk.db import bound_transactions, make_engine, sqlalchemy_url
from teamdesk.redis_client import redis_client

DB_CONNECT_TIMEOUT_S = 3  # libpq takes whole seconds (2 at least)
DB_STATEMENT_TIMEOUT_MS = 10_000
DB_POOL_TIMEOUT_S = 5.0
# Kept open: an overflow connection is closed when returned, and a new backend per
# request cost about 3.5 ms of CPU per creation (P7, 8 clients on one process).
DB_POOL_SIZE = 10
DB_MAX_OVERFLOW = 10

# Health probes: bounded well below an orchestrator's probe timeout.
HEALTH_CONNECT_TIMEOUT_S = 2
HEALTH_STATEMENT_TIMEOUT_MS = 2_000
REDIS_TIMEOUT_S = 1.0
HEALTH_CACHE_S = 1.0
# 0: an operator starting or stopping a process expects the next answer to show it.
WORKERS_HEALTH_CACHE_S = 0.0


class Resources:
    """Lazily opened connections for one app; ``settings=None`` means the process-wide ones."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._health_engine: Engine | None = None
        self._redis: redis.Redis | None = None
        # Each has its own threads: a frozen Redis cannot take the slots /api/health needs.
        self.database_check: SharedCheck[None] = SharedCheck(fresh_s=HEALTH_CACHE_S)
        self.roles_check: SharedCheck[dict[str, Any]] = SharedCheck(fresh_s=WORKERS_HEALTH_CACHE_S)
        self.downloads = Slots()  # the CSVs this process streams now (api/downloads.py)

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = get_settings()
        return self._settings

    @property
    def engine(self) -> Engine:
        """The pool the task routes use (statement timeout, short pool wait)."""
        with self._lock:
            if self._engine is None:
                self._engine = bound_transactions(
                    make_engine(
                        self.settings.database_url,
                        self.settings.database_prepared_statements,
                        pool_timeout=DB_POOL_TIMEOUT_S,
                        pool_size=DB_POOL_SIZE,
                        max_overflow=DB_MAX_OVERFLOW,
                        connect_args=_connect_args("teamdesk-api", DB_CONNECT_TIMEOUT_S),
                    ),
                    DB_STATEMENT_TIMEOUT_MS,
                )
            return self._engine

    @property
    def health_engine(self) -> Engine:
        """No pool: each health check proves that a new connection can be made."""
        with self._lock:
            if self._health_engine is None:
                self._health_engine = bound_transactions(
                    sa.create_engine(
                        sqlalchemy_url(self.settings.database_url),
                        poolclass=NullPool,
                        connect_args=_connect_args("teamdesk-api-health", HEALTH_CONNECT_TIMEOUT_S),
                    ),
                    HEALTH_STATEMENT_TIMEOUT_MS,
                )
            return self._health_engine

    @property
    def redis(self) -> redis.Redis:
        """Short socket timeouts and no retries: a frozen Redis must not hold a request."""
        with self._lock:
            if self._redis is None:
                self._redis = redis_client(self.settings, self.settings.redis_url, REDIS_TIMEOUT_S)
            return self._redis

    def close(self) -> None:
        """Close whatever was opened (a later use opens it again); safe to call twice."""
        with self._lock:
            engines = [e for e in (self._engine, self._health_engine) if e is not None]
            client = self._redis
            self._engine = self._health_engine = None
            self._redis = None
        for engine in engines:
            engine.dispose()
        if client is not None:
            client.close()


def _connect_args(name: str, connect_timeout_s: int) -> dict[str, object]:
    """No startup ``options``: PgBouncer refuses them; the statement timeout is set per
    transaction (teamdesk.db.bound_transactions)."""
    return {"connect_timeout": connect_timeout_s, "application_name": name}
