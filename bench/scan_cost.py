"""P3: one dispatcher scan (``dispatcher.scan.scan``: recover, re-publish lost messages,
fill the window, purge) over a ledger of 10,000 and then 1,000,000 rows: almost all
COMPLETED (1 % still holding a CSV, a few FAILED / CANCELLED), plus 50 due WAITING rows
and 10 RUNNING rows silent for 10 minutes.

The table is built with set-based SQL and analysed. Each ledger gets one
``dispatcher.context.Cluster`` and ``dispatcher.window.Window`` (warm handles, as in a
running dispatcher) and one heartbeat member offering ``SLOTS`` worker processes on both
task queues, so the window (two per process) has room for all 60 runs and the queues are
consumed (no "no consumers" check). Between timed scans the 60 working rows are put back
(50 due, 10 stale), the queue lists the scan wrote are cleared and the heartbeat renewed,
so every timed scan recovers 10 rows and publishes 60 messages (its lost-message check
finds no published run past the grace, so it does not look at the broker). The median of
several scans is reported, with the part spent publishing (``queueing.publish_batch``)
shown apart.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from bench.env import BenchEnv, Part
from dispatcher import scan as scan_module
from dispatcher.context import Cluster
from dispatcher.scan import ScanCounts, scan
from dispatcher.window import WINDOW_PER_SLOT, Window, limits_for
from ledger import dispatch
from tasks import queueing
from tasks.names import TASK_QUEUES
from teamdesk import config
from teamdesk.heartbeat import Heartbeat, WorkerSlots

DUE = 50
STALE = 10
SCANS = 15
SLOTS = 40  # worker processes the heartbeat offers on each queue: a window of 80 >= 60
SPLIT_SCANS = 5  # extra scans per ledger with every step timed (not in the headline)
LAST_STATEMENTS: dict[str, int] = {}  # the SQL statements of the last timed scan

FILL = sa.text("""
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status, run,
                                  attempts, progress, result_csv, result_summary, expires_at,
                                  last_error, dispatched_at, run_at, created_at, updated_at)
    SELECT CASE WHEN g % 3 = 0 THEN 'REMINDER' ELSE 'EXPORT' END, :team, :owner, 'TEAM',
           '{}'::jsonb,
           CASE WHEN g % 100 = 7 THEN 'FAILED' WHEN g % 100 = 8 THEN 'CANCELLED'
                ELSE 'COMPLETED' END,
           0, 1, 100,
           CASE WHEN g % 100 = 1 THEN 'id,title\n' END,
           '1 rows',
           CASE WHEN g % 100 = 1 THEN now() + interval '12 hours'
                ELSE now() - interval '30 days' + g * interval '1 second' END,
           CASE WHEN g % 100 = 7 THEN 'The task failed after 3 attempts.' END,
           now() - interval '31 days' + g * interval '1 second',
           now() - interval '31 days' + g * interval '1 second',
           now() - interval '31 days' + g * interval '1 second',
           now() - interval '30 days' + g * interval '1 second'
      FROM generate_series(:first, :last) g
""")

ADD_WORKING = sa.text("""
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)
    SELECT 'EXPORT', :team, :owner, 'TEAM', '{}'::jsonb FROM generate_series(1, :n)
    RETURNING id
""")

RESET_DUE = sa.text("""
    UPDATE background_tasks
       SET status = 'WAITING', dispatched_at = NULL, run_at = now() - interval '1 second',
           execution_id = NULL, lease_holder = NULL, recoveries = 0, updated_at = now()
     WHERE id = ANY(CAST(:ids AS uuid[]))
""")

RESET_STALE = sa.text("""
    UPDATE background_tasks
       SET status = 'RUNNING', execution_id = gen_random_uuid(), attempts = 1,
           dispatched_at = now() - interval '10 minutes', recoveries = 0,
           updated_at = now() - interval '10 minutes'
     WHERE id = ANY(CAST(:ids AS uuid[]))
""")


class Ledger:
    def __init__(self, part: Part) -> None:
        self.part = part
        self.rows = 0
        with part.engine.begin() as conn:
            self.team = conn.execute(
                sa.text("INSERT INTO teams (name) VALUES ('Scan team') RETURNING id")
            ).scalar_one()
            self.owner = conn.execute(
                sa.text("INSERT INTO users (email, name) VALUES (:e, 'Owner') RETURNING id"),
                {"e": f"scan-{uuid.uuid4().hex[:8]}@bench.test"},
            ).scalar_one()
            conn.execute(
                sa.text(
                    "INSERT INTO memberships (team_id, user_id, role) VALUES (:t, :u, 'STAFF')"
                ),
                {"t": self.team, "u": self.owner},
            )
            ids = [r[0] for r in conn.execute(ADD_WORKING, self._who(n=DUE + STALE))]
        self.due, self.stale = [str(i) for i in ids[:DUE]], [str(i) for i in ids[DUE:]]
        self.rows = DUE + STALE

    def _who(self, **extra: Any) -> dict[str, Any]:
        return {"team": self.team, "owner": self.owner, **extra}

    def grow_to(self, total: int, chunk: int = 250_000) -> float:
        """Add finished rows until the table holds ``total``; returns seconds taken."""
        started = time.perf_counter()
        while self.rows < total:
            last = min(total, self.rows + chunk)
            with self.part.engine.begin() as conn:
                conn.execute(FILL, self._who(first=self.rows + 1, last=last))
            self.rows = last
        with self.part.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE background_tasks"))
        return time.perf_counter() - started

    def reset(self) -> None:
        with self.part.engine.begin() as conn:
            conn.execute(RESET_DUE, {"ids": self.due})
            conn.execute(RESET_STALE, {"ids": self.stale})


class PublishClock:
    """Times the scan's publishing: the time inside ``queueing.publish_batch`` (a nested
    call counts once)."""

    NAMES = ("publish_batch",)

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0
        self.real = {
            name: getattr(queueing, name) for name in self.NAMES if hasattr(queueing, name)
        }

    def _timed(self, real: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - started

        return timed

    def __enter__(self) -> PublishClock:
        for name, real in self.real.items():
            setattr(queueing, name, self._timed(real))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self.real.items():
            setattr(queueing, name, real)


class StepClock:
    """Times the scan's steps, for the detail only (the wrappers cost a little): recover
    (with the heartbeat read), the window read, the lost-message check, the fill (with
    its publish), the publish alone and the purge statement."""

    # (owner, attribute, step): module functions the scan calls through its globals
    TARGETS = (
        (scan_module, "_recover", "recover"),
        (scan_module, "_republish_lost", "lost_check"),
        (scan_module, "fill", "fill"),
        (dispatch, "purge_expired", "purge"),
        (queueing, "publish_batch", "publish"),
    )

    def __init__(self, window: Window) -> None:
        self.window = window
        self.seconds: dict[str, float] = {}

    def _timed(self, real: Any, step: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.seconds[step] = self.seconds.get(step, 0.0) + elapsed

        return timed

    def __enter__(self) -> StepClock:
        self.saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self.TARGETS]
        for owner, name, step in self.TARGETS:
            setattr(owner, name, self._timed(getattr(owner, name), step))
        self.window.slots = self._timed(self.window.slots, "window")  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self.saved):
            setattr(owner, name, real)
        del self.window.slots


def split_scans(env: BenchEnv, scanner: Scanner, ledger: Ledger) -> dict[str, float]:
    """Median ms per step over SPLIT_SCANS scans like the timed ones."""
    per_step: dict[str, list[float]] = {}
    for _ in range(SPLIT_SCANS):
        ledger.reset()
        clear_broker(env, scanner.part)
        with StepClock(scanner.window) as steps:
            _, elapsed = scanner.scan()
        steps.seconds["whole scan"] = elapsed
        for step, seconds in steps.seconds.items():
            per_step.setdefault(step, []).append(seconds)
    return {step: round(statistics.median(v) * 1000, 2) for step, v in per_step.items()}


def clear_broker(env: BenchEnv, part: Part) -> None:
    """The keys a scan writes: the queue lists (the broker's bindings and the heartbeat
    stay)."""
    env.redis.delete(*(f"{part.prefix}:{queue}" for queue in TASK_QUEUES))


class Scanner:
    """One ledger's warm dispatcher handles and the heartbeat that gives it a window."""

    def __init__(self, env: BenchEnv, part: Part) -> None:
        assert part.app is not None
        self.env, self.part = env, part
        self.cluster = Cluster(part.app, part.settings)
        self.window = Window(self.cluster)
        self.heartbeat = Heartbeat(
            env.redis,
            part.prefix,
            "bench-p3",
            part.settings.heartbeat_ttl_s,
            WorkerSlots(TASK_QUEUES, SLOTS),
        )
        self.heartbeat.renew()
        self.limits = limits_for(self.window.slots(refresh=True), part.settings)
        if min(self.limits.values()) < DUE + STALE:
            raise RuntimeError(f"bench: the P3 window is too small: {self.limits}")

    def scan(self) -> tuple[ScanCounts, float]:
        config.set_settings(self.part.settings)  # the broker view's client reads it
        self.heartbeat.renew()  # untimed: its TTL must outlive a long build or a slow scan
        started = time.perf_counter()
        counts = scan(self.cluster, self.window, purge=True)
        return counts, time.perf_counter() - started

    def close(self) -> None:
        self.heartbeat.remove()
        self.cluster.close()


class StatementCount:
    """SQL statements the scan sends (round trips besides BEGIN/COMMIT), by first words."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.counts: dict[str, int] = {}

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        words = " ".join(statement.split()[:4])
        self.counts[words] = self.counts.get(words, 0) + 1

    def __enter__(self) -> StatementCount:
        event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)


def scan_once(env: BenchEnv, scanner: Scanner, ledger: Ledger) -> tuple[float, float]:
    """One timed scan of a ledger: (total seconds, seconds spent publishing)."""
    ledger.reset()
    clear_broker(env, scanner.part)
    with PublishClock() as clock, StatementCount(scanner.cluster.engine) as statements:
        counts, elapsed = scanner.scan()
    expected = (STALE, 0, DUE + STALE, 0, None)
    got = (
        counts.recovered,
        counts.redispatched,
        counts.dispatched,
        counts.publish_failed,
        counts.redis_error,
    )
    if got != expected:
        raise RuntimeError(f"bench: unexpected scan result: {counts.summary()}")
    LAST_STATEMENTS.clear()
    LAST_STATEMENTS.update(statements.counts)
    return elapsed, clock.seconds


def idle_scans(scanner: Scanner, scans: int = 5) -> float:
    """Median ms of a scan with nothing to do (every row finished or just published)."""
    times = []
    for _ in range(scans):
        counts, elapsed = scanner.scan()
        times.append(elapsed)
        if counts.did_something:
            raise RuntimeError(f"bench: an idle scan did work: {counts.summary()}")
    return round(statistics.median(times) * 1000, 2)


def summary(rows: int, samples: list[tuple[float, float]]) -> dict[str, Any]:
    totals = [t for t, _ in samples]
    return {
        "rows": rows,
        "scan_ms": round(statistics.median(totals) * 1000, 2),
        "publish_ms": round(statistics.median(p for _, p in samples) * 1000, 2),
        "without_publish_ms": round(statistics.median(t - p for t, p in samples) * 1000, 2),
        "scan_ms_all": [round(t * 1000, 2) for t in totals],
    }


def run_p3(env: BenchEnv, small: int = 10_000, large: int = 1_000_000) -> dict[str, Any]:
    """Two ledgers side by side, scanned alternately (a noisy machine then slows both)."""
    scanners: list[Scanner] = []
    ledgers, build = [], {}
    try:
        for label, rows in (("p3-10k", small), ("p3-1m", large)):
            part = env.part(label)
            env.activate(part)
            ledger = Ledger(part)
            build[label] = round(ledger.grow_to(rows), 1)
            ledgers.append(ledger)
        for ledger in ledgers:  # after the builds: the heartbeat must not lapse meanwhile
            scanners.append(Scanner(env, ledger.part))
        samples: list[list[tuple[float, float]]] = [[], []]
        for i in range(SCANS + 1):
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                sample = scan_once(env, scanners[k], ledgers[k])
                if i:  # the first round warms connections and caches
                    samples[k].append(sample)
        idle = [idle_scans(scanner) for scanner in scanners]
        steps = [split_scans(env, sc, lg) for sc, lg in zip(scanners, ledgers, strict=True)]
        limits = scanners[0].limits
    finally:
        for scanner in scanners:
            clear_broker(env, scanner.part)
            scanner.close()
    at_small, at_large = summary(small, samples[0]), summary(large, samples[1])
    at_small["idle_scan_ms"], at_large["idle_scan_ms"] = idle
    at_small["steps_ms"], at_large["steps_ms"] = steps
    return {
        "p3_scan_ms_10k": at_small["scan_ms"],
        "p3_scan_ms_1m": at_large["scan_ms"],
        "p3_scan_ratio_1m_10k": round(at_large["scan_ms"] / at_small["scan_ms"], 3),
        "p3_detail": {
            "per_scan": f"{STALE} recovered + {DUE + STALE} published (recover, lost-message "
            "check, fill, purge)",
            "window": {
                "worker_processes": SLOTS,
                "per_slot": WINDOW_PER_SLOT,
                "limits": limits,
            },
            "10k": at_small,
            "1m": at_large,
            "build_s": build,
            "sql_statements_per_scan": dict(LAST_STATEMENTS),
        },
    }
