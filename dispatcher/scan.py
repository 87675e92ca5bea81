"""The dispatcher scan (SPEC §7): recover, reconcile, dispatch, re-dispatch, purge.

:func:`run_once` runs the five steps in that order, each over at most ``batch`` rows and
each in its own short transaction (every SQL statement is in :mod:`ledger.dispatch`).
Overlapping scans are safe: every selection locks its rows ``FOR UPDATE SKIP LOCKED``,
so two scans split the due rows instead of sharing them, and every write is conditional.

Ledger first, then the queue: a row's ``dispatched_at`` is stamped and committed before
its message is published, so a second scan no longer sees the row as due while the
first publishes it. A publish that fails clears the stamp again (guarded by the stamp
itself), and the next scan retries. The first failed publish ends publishing for this
scan (the broker is down: trying every row would only add timeouts); the remaining
stamped rows are cleared the same way.

Which Redis is which: ``redis_client`` is ``REDIS_URL`` (heartbeats, result states); the
queued markers and the messages go through :mod:`tasks.queueing`, i.e. the broker's
Redis. A Redis error ends the queue steps (reconcile, dispatch, re-dispatch) of this scan
and is reported in :attr:`ScanCounts.redis_error`; recovery and purge need only
PostgreSQL and still run. A PostgreSQL error ends the scan with :class:`ScanUnavailable`.

Known limit of step 4: it looks at the ``batch`` oldest published rows. If more than
``batch`` rows older than ``STALE_AFTER_S`` still have their marker (a real backlog), a
lost message behind them is found only as the backlog drains. A Redis restart that
loses messages also loses their markers (same server), so the oldest go first then.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
import sqlalchemy.exc
from celery import Celery, states
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy.engine import Connection, Engine

from dispatcher.errors import ScanUnavailable
from dispatcher.heartbeat import lease_holders_alive, redis_uptime_s
from ledger import dispatch
from ledger.dispatch import RunRef
from tasks import queueing
from teamdesk.config import Settings, get_settings
from teamdesk.db import get_engine
from teamdesk.logs import log_event

log = logging.getLogger("teamdesk.dispatcher")

SCAN_BATCH = 200  # rows per step per scan
STATEMENT_TIMEOUT_S = 10.0  # any one scan statement
REDIS_TIMEOUT_S = 2.0  # connect / read of the REDIS_URL client

# Errors that mean "PostgreSQL is unreachable or stuck", not a bug in the scan.
DATABASE_ERRORS = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
)

Uptime = Callable[[redis.Redis], float]


@dataclass
class ScanCounts:
    """What one scan did.

    ``redis_error``: the class of the Redis or broker error this scan ran into (heartbeat
    read, result states, markers or a publish), else None. The queue steps stop at such
    an error; a heartbeat read that failed only turns the heartbeat rule off.
    """

    recovered: int = 0
    failed_recoveries: int = 0
    reconciled: int = 0
    dispatched: int = 0
    publish_failed: int = 0
    redispatched: int = 0
    purged: int = 0
    heartbeat_rule: bool = False
    redis_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def did_something(self) -> bool:
        return any(v for k, v in self.as_dict().items() if k != "heartbeat_rule")

    def summary(self) -> str:
        text = (
            f"recovered {self.recovered} (failed {self.failed_recoveries}), "
            f"reconciled {self.reconciled}, dispatched {self.dispatched}, "
            f"publish failed {self.publish_failed}, re-dispatched {self.redispatched}, "
            f"purged {self.purged}; heartbeat rule {'on' if self.heartbeat_rule else 'off'}"
        )
        return text + (f"; Redis unreachable ({self.redis_error})" if self.redis_error else "")


@dataclass(frozen=True)
class HeartbeatView:
    """The live heartbeat members, and whether "absent" may be read as "dead"."""

    live: frozenset[str]
    trusted: bool
    error: str | None = None


def read_heartbeats(
    client: redis.Redis, prefix: str, ttl_s: float, uptime: Uptime = redis_uptime_s
) -> HeartbeatView:
    """Trusted only when the read worked and Redis has been up for more than one TTL
    (after a restart, live workers need one TTL to register again). Never raises."""
    try:
        live = lease_holders_alive(client, prefix)
        up_s = uptime(client)
    except redis.RedisError as exc:
        return HeartbeatView(frozenset(), trusted=False, error=type(exc).__name__)
    return HeartbeatView(frozenset(live), trusted=up_s > ttl_s)


_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def results_redis(settings: Settings) -> redis.Redis:
    """A ``REDIS_URL`` client with short timeouts, one per process and URL."""
    with _clients_lock:
        client = _clients.get(settings.redis_url)
        if client is None:
            client = redis.Redis.from_url(
                settings.redis_url,
                socket_timeout=REDIS_TIMEOUT_S,
                socket_connect_timeout=REDIS_TIMEOUT_S,
                # One quick retry (a pooled connection cut by a Redis restart), no backoff:
                # the next scan is only SCAN_INTERVAL_S away.
                retry=Retry(NoBackoff(), 1),
            )
            _clients[settings.redis_url] = client
        return client


def run_once(
    app: Celery,
    *,
    now: datetime | None = None,
    settings: Settings | None = None,
    redis_client: redis.Redis | None = None,
    engine: Engine | None = None,
    batch: int = SCAN_BATCH,
    uptime: Uptime = redis_uptime_s,
    purge: bool = True,
) -> ScanCounts:
    """One scan. Raises :class:`ScanUnavailable` when PostgreSQL cannot be reached."""
    settings = settings or get_settings()
    scan = _Scan(
        app=app,
        settings=settings,
        engine=engine or get_engine(),
        results=redis_client or results_redis(settings),
        now=now or datetime.now(UTC),
        batch=batch,
        uptime=uptime,
    )
    try:
        scan.recover()
        scan.queue_steps()
        if purge:
            scan.purge()
    except DATABASE_ERRORS as exc:
        raise ScanUnavailable("PostgreSQL", _error_class(exc)) from exc
    return scan.counts


def purge_once(
    *, now: datetime | None = None, engine: Engine | None = None, batch: int = SCAN_BATCH
) -> int:
    """Step 5 alone (beat runs it less often than the scan)."""
    try:
        with _transaction(engine or get_engine()) as conn:
            return dispatch.purge_expired(conn, now=now or datetime.now(UTC), batch=batch)
    except DATABASE_ERRORS as exc:
        raise ScanUnavailable("PostgreSQL", _error_class(exc)) from exc


def _error_class(exc: Exception) -> str:
    """The driver's error class when SQLAlchemy wrapped one (never its message)."""
    return type(getattr(exc, "orig", None) or exc).__name__


@contextmanager
def _transaction(engine: Engine) -> Iterator[Connection]:
    with engine.begin() as conn:
        dispatch.limit_statement_time(conn, STATEMENT_TIMEOUT_S)
        yield conn


@dataclass
class _Scan:
    app: Celery
    settings: Settings
    engine: Engine
    results: redis.Redis  # REDIS_URL: heartbeats and result states
    now: datetime
    batch: int
    uptime: Uptime

    def __post_init__(self) -> None:
        self.counts = ScanCounts()

    def recover(self) -> None:
        """Step 1. The members are read inside the transaction, after the database clock
        was read, so a process that registers and claims later is not taken for dead."""
        stale_before = self.now - timedelta(seconds=self.settings.stale_after_s)
        with _transaction(self.engine) as conn:
            seen_at = dispatch.database_now(conn)
            view = read_heartbeats(
                self.results, self.settings.queue_prefix, self.settings.heartbeat_ttl_s, self.uptime
            )
            refs = dispatch.recover_stale(
                conn,
                stale_before=stale_before,
                live_members=view.live,
                use_heartbeats=view.trusted,
                holders_seen_at=seen_at,
                max_recoveries=self.settings.max_recoveries,
                batch=self.batch,
            )
        self.counts.heartbeat_rule = view.trusted
        self.counts.redis_error = view.error
        for ref in refs:
            failed = ref.status == "FAILED"
            self.counts.failed_recoveries += failed
            self.counts.recovered += not failed
            log_event(
                log,
                "task.stalled",
                logging.WARNING,
                task_id=str(ref.task_id),
                run=ref.run,
                outcome=ref.status,
            )

    def queue_steps(self) -> None:
        """Steps 2-4; a Redis error ends them for this scan (recorded, not raised)."""
        try:
            if self._reconcile_and_dispatch():
                self._redispatch_lost()
        except redis.RedisError as exc:
            self.counts.redis_error = type(exc).__name__

    def purge(self) -> None:
        """Step 5."""
        with _transaction(self.engine) as conn:
            self.counts.purged = dispatch.purge_expired(conn, now=self.now, batch=self.batch)

    def _reconcile_and_dispatch(self) -> bool:
        """Steps 2 and 3 over the same locked due rows; False when a publish failed."""
        with _transaction(self.engine) as conn:
            due = dispatch.lock_due(conn, now=self.now, batch=self.batch)
            failed = self._failed_messages(due)
            for ref in due:
                if ref in failed and dispatch.reconcile_failed(conn, ref):
                    self.counts.reconciled += 1
                    log_event(
                        log,
                        "task.failed",
                        logging.WARNING,
                        task_id=str(ref.task_id),
                        run=ref.run,
                        exhausted=True,
                        reason=dispatch.MSG_QUEUE_FAILED,
                    )
            fresh = [ref for ref in due if ref not in failed]
            stamped = dispatch.mark_many_dispatched(conn, fresh, self.now)
        self.counts.dispatched = self._publish(stamped)
        return self.counts.publish_failed == 0

    def _redispatch_lost(self) -> None:
        """Step 4: only rows whose queued marker is gone (a backlog keeps its markers)."""
        before = self.now - timedelta(seconds=self.settings.stale_after_s)
        stamped: list[RunRef] = []
        with _transaction(self.engine) as conn:
            published = dispatch.lock_published_before(conn, before=before, batch=self.batch)
            for ref in self._without_marker(published):
                if dispatch.mark_redispatched(conn, ref, now=self.now, before=before):
                    stamped.append(ref)
        self.counts.redispatched = self._publish(stamped)

    def _failed_messages(self, refs: Sequence[RunRef]) -> set[RunRef]:
        """The rows whose message ``{id}-{run}`` ended FAILURE, in one MGET."""
        if not refs:
            return set()
        backend = self.app.backend
        keys = [backend.get_key_for_task(queueing.message_id(r.task_id, r.run)) for r in refs]
        metas = self.results.mget(keys)
        return {
            ref
            for ref, raw in zip(refs, metas, strict=True)
            if raw is not None and backend.decode_result(raw).get("status") == states.FAILURE
        }

    def _without_marker(self, refs: Sequence[RunRef]) -> list[RunRef]:
        if not refs:
            return []
        prefix = self.settings.queue_prefix
        with queueing.marker_redis().pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.exists(queueing.marker_key(ref.task_id, ref.run, prefix))
            present = pipe.execute()
        return [ref for ref, found in zip(refs, present, strict=True) if not found]

    def _publish(self, refs: Sequence[RunRef]) -> int:
        """Publish the stamped rows; on the first failure clear it and every row after it."""
        runs = [(ref.task_id, ref.run, ref.kind) for ref in refs]
        try:
            done = queueing.publish_many(self.app, runs)
        except queueing.PublishFailed as exc:  # broker or marker Redis down
            self.counts.redis_error = exc.error
            self.counts.publish_failed += len(refs) - exc.published
            self._clear(refs[exc.published :])
            return exc.published
        return done

    def _clear(self, refs: Sequence[RunRef]) -> None:
        with _transaction(self.engine) as conn:
            for ref in refs:
                dispatch.clear_dispatched(conn, ref, self.now)
