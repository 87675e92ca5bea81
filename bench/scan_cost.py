"""P3: one dispatcher scan (``dispatcher.scan.run_once``, all five steps) over a ledger of
10,000 and then 1,000,000 rows: almost all COMPLETED (1 % still holding a CSV, a few
FAILED / CANCELLED), plus 50 due WAITING rows and 10 RUNNING rows silent for 10 minutes.

The table is built with set-based SQL and analysed; between timed scans the 60 working
rows are put back (50 due, 10 stale) and the broker keys the scan wrote are cleared, so
every timed scan recovers 10 rows and publishes 60 messages. The median of several scans
is reported, with the part spent publishing (marker + message per row) shown apart.
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
from dispatcher.scan import run_once
from tasks import queueing
from teamdesk import config

DUE = 50
STALE = 10
SCANS = 15
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
    """Times the scan's publishing (``queueing.publish`` and ``publish_many``, whichever it
    calls; nested calls count once): markers + messages."""

    NAMES = ("publish", "publish_many")

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


def clear_broker(env: BenchEnv, part: Part) -> None:
    keys = list(env.redis.scan_iter(match=f"{part.prefix}:*", count=5000))
    if keys:
        env.redis.delete(*keys)


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


def scan_once(env: BenchEnv, part: Part, ledger: Ledger) -> tuple[float, float]:
    """One timed scan of ``part``'s ledger: (total seconds, seconds spent publishing)."""
    assert part.app is not None
    ledger.reset()
    clear_broker(env, part)
    config.set_settings(part.settings)  # queueing reads the prefix from the settings
    with PublishClock() as clock, StatementCount(part.engine) as statements:
        started = time.perf_counter()
        counts = run_once(part.app, settings=part.settings, engine=part.engine)
        elapsed = time.perf_counter() - started
    if (counts.recovered, counts.dispatched) != (STALE, DUE + STALE):
        raise RuntimeError(f"bench: unexpected scan result: {counts.summary()}")
    LAST_STATEMENTS.clear()
    LAST_STATEMENTS.update(statements.counts)
    return elapsed, clock.seconds


def idle_scans(part: Part, scans: int = 5) -> float:
    """Median ms of a scan with nothing to do (every row finished or just published)."""
    assert part.app is not None
    config.set_settings(part.settings)
    times = []
    for _ in range(scans):
        started = time.perf_counter()
        counts = run_once(part.app, settings=part.settings, engine=part.engine)
        times.append(time.perf_counter() - started)
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
    parts, ledgers, build = [], [], {}
    for label, rows in (("p3-10k", small), ("p3-1m", large)):
        part = env.part(label)
        env.activate(part)
        ledger = Ledger(part)
        build[label] = round(ledger.grow_to(rows), 1)
        parts.append(part)
        ledgers.append(ledger)
    samples: list[list[tuple[float, float]]] = [[], []]
    for i in range(SCANS + 1):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            sample = scan_once(env, parts[k], ledgers[k])
            if i:  # the first round warms connections and caches
                samples[k].append(sample)
    idle = [idle_scans(part) for part in parts]
    for part in parts:
        clear_broker(env, part)
    assert scan_module.SCAN_BATCH >= DUE + STALE
    at_small, at_large = summary(small, samples[0]), summary(large, samples[1])
    at_small["idle_scan_ms"], at_large["idle_scan_ms"] = idle
    return {
        "p3_scan_ms_10k": at_small["scan_ms"],
        "p3_scan_ms_1m": at_large["scan_ms"],
        "p3_scan_ratio_1m_10k": round(at_large["scan_ms"] / at_small["scan_ms"], 3),
        "p3_detail": {
            "per_scan": f"{STALE} recovered + {DUE + STALE} published (all five steps)",
            "10k": at_small,
            "1m": at_large,
            "build_s": build,
            "sql_statements_per_scan": dict(LAST_STATEMENTS),
        },
    }
