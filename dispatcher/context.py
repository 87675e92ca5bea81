"""What every dispatcher pass works with: the app (to publish), the settings, a database
engine of its own and the ``REDIS_URL`` client (heartbeats, the leader lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis
from celery import Celery
from sqlalchemy.engine import Connection, Engine

from teamdesk.config import Settings, is_redis_url
from teamdesk.db import bound_transactions, make_engine
from teamdesk.redis_client import redis_client

STATEMENT_TIMEOUT_S = 10.0  # any one dispatcher statement
REDIS_TIMEOUT_S = 2.0  # connect / read of the REDIS_URL client
APPLICATION_NAME = "teamdesk-dispatcher"


def dispatcher_engine(settings: Settings) -> Engine:
    engine = make_engine(
        settings.database_url,
        settings.database_prepared_statements,
        pool_size=2,
        max_overflow=2,
        connect_args={"connect_timeout": 5, "application_name": APPLICATION_NAME},
    )
    # No WAL flush: a stamp lost in a crash makes its run ready again (a duplicate message
    # at worst, which the lease absorbs).
    return bound_transactions(engine, round(STATEMENT_TIMEOUT_S * 1000), synchronous_commit="off")


def results_redis(settings: Settings) -> redis.Redis:
    """A ``REDIS_URL`` client with short timeouts and one quick retry (a pooled connection
    cut by a Redis restart), no backoff: the next pass is moments away."""
    return redis_client(settings, settings.redis_url, REDIS_TIMEOUT_S, retries=1)


def broker_redis(settings: Settings) -> redis.Redis | None:
    """The broker's Redis, as :func:`results_redis` (None when the broker is not Redis:
    the broker look then asks the broker through the Celery app)."""
    if not is_redis_url(settings.broker_url):
        return None
    return redis_client(settings, settings.broker_url, REDIS_TIMEOUT_S, retries=1)


@dataclass
class Cluster:
    """The dispatcher's handles on the cluster; :meth:`close` releases them."""

    app: Celery
    settings: Settings
    engine: Engine = field(default=None)  # type: ignore[assignment]
    results: redis.Redis = field(default=None)  # type: ignore[assignment]
    broker: redis.Redis | None = field(init=False, default=None)  # the broker look's
    # The object store's sweep: where it goes on from, and its thread (dispatcher/objects.py).
    object_sweep_after: str = ""
    object_purges: OnePassAtATime = field(
        default_factory=lambda: OnePassAtATime("teamdesk-object-purge")
    )

    def __post_init__(self) -> None:
        if self.engine is None:
            self.engine = dispatcher_engine(self.settings)
        if self.results is None:
            self.results = results_redis(self.settings)
        self.broker = broker_redis(self.settings)

    def close(self) -> None:
        self.object_purges.close(PASS_JOIN_S)  # a scan command ends with its purge done
        self.engine.dispose()
        self.results.close()
        if self.broker is not None:
            self.broker.close()


PASS_JOIN_S = 60.0  # how long closing waits for a pass under way (its calls are bounded)


class OnePassAtATime:
    """Runs a callable on a thread of its own, one run at a time: a poke while one runs
    is skipped (the caller pokes again at its next turn)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def poke(self, run: Callable[[], None]) -> bool:
        """Start ``run`` unless a run is under way; True when it started."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            self._thread = threading.Thread(target=run, name=self.name, daemon=True)
            self._thread.start()
            return True

    def running(self) -> bool:
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def close(self, timeout_s: float) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)


@contextmanager
def transaction(engine: Engine) -> Iterator[Connection]:
    with engine.begin() as conn:
        yield conn


def error_class(exc: BaseException) -> str:
    """The driver's error class when SQLAlchemy wrapped one (never its message)."""
    return type(getattr(exc, "orig", None) or exc).__name__
