"""P8: claim + completion time with 10 million ``task_audit`` rows present, over the same
with an empty audit trail (``p8_claim_ratio_10m_audit``), and the retention purge's cost
on the large trail.

Two databases of the same part: one whose ``task_audit`` is empty, one holding
``AUDIT_ROWS`` rows (written in one ``INSERT ... SELECT``, spread over a thousand finished
tasks, dated a day ago). In each, ``TASKS`` WAITING exports are claimed and completed one
after the other on one connection, as a worker does (``lease.claim`` then
``lease.complete_export``: each writes its audit row). The two databases take turns,
``ROUNDS`` times, so neither gets the warmer cache; the figure is the ratio of the median
per-task times. One retention purge call (``teamdesk_purge_ledger``, nothing past its
retention: a read of the trail's head) is timed on each. Then one dispatcher scan of each
(P3's scan: 10 stale RUNNING rows recovered, each writing its audit row, 60 runs
published, the purge step) is timed ``SCANS`` times after ``SCAN_WARMUP`` untimed rounds,
alternating:
``p8_scan_ratio_10m_audit`` is the ratio of the medians.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.env import BenchEnv, Part
from bench.scan_cost import Ledger, Scanner, clear_broker, scan_once
from ledger import lease
from ledger.retention import Retention, purge_retired

AUDIT_ROWS = 10_000_000
TASKS = 500
ROUNDS = 3
FILLER_TASKS = 1000
SCANS = 9
# Untimed scans of each part first: right after the fill, the first scans of the 10M trail
# are slower (40-44 ms for four rounds in one run, 34-43 ms for eight in another; later
# ones 14-24 ms, as the empty trail's); the figure is meant for a dispatcher that has been
# scanning every few seconds, and is reported as measured either way.
SCAN_WARMUP = 4


def seed_owner(engine: sa.Engine) -> tuple[uuid.UUID, uuid.UUID]:
    with engine.begin() as conn:
        team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES ('p8') RETURNING id")
        ).scalar_one()
        user = conn.execute(
            sa.text("INSERT INTO users (email, name) VALUES ('p8@bench.test', 'p8') RETURNING id")
        ).scalar_one()
        conn.execute(
            sa.text("INSERT INTO memberships (team_id, user_id, role) VALUES (:t, :u, 'STAFF')"),
            {"t": team, "u": user},
        )
    return team, user


def insert_tasks(
    engine: sa.Engine, owner: tuple[uuid.UUID, uuid.UUID], n: int, status: str
) -> list[uuid.UUID]:
    with engine.begin() as conn:
        rows = conn.execute(
            sa.text("""
                INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status)
                SELECT 'EXPORT', :t, :u, 'TEAM', '{}'::jsonb, :status FROM generate_series(1, :n)
                RETURNING id"""),
            {"t": owner[0], "u": owner[1], "n": n, "status": status},
        )
        return [r[0] for r in rows]


def fill_audit(engine: sa.Engine, owner: tuple[uuid.UUID, uuid.UUID], rows: int) -> float:
    """``rows`` audit rows of FILLER_TASKS finished tasks, in one statement; seconds taken."""
    fillers = insert_tasks(engine, owner, FILLER_TASKS, "COMPLETED")
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL synchronous_commit = off"))
        conn.execute(
            sa.text("""
                INSERT INTO task_audit (task_id, run, event, execution_id, at)
                SELECT (CAST(:ids AS uuid[]))[1 + g % :k], 0,
                       CASE WHEN g % 2 = 0 THEN 'CLAIM' ELSE 'COMPLETE' END,
                       NULL, now() - interval '1 day'
                  FROM generate_series(1, :rows) g"""),
            {"ids": [str(i) for i in fillers], "k": len(fillers), "rows": rows},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE task_audit"))
        # The fill dirtied about a gigabyte of pages: write them out now, so the timed
        # rounds measure a ledger holding 10M rows, not a checkpoint flushing them.
        conn.execute(sa.text("CHECKPOINT"))
    return time.perf_counter() - started


def claim_and_complete(engine: sa.Engine, task_ids: list[uuid.UUID]) -> float:
    """Median seconds per task of claim + completion, one connection, autocommit."""
    times = []
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for task_id in task_ids:
            started = time.perf_counter()
            claimed = lease.claim(conn, task_id, 0)
            assert claimed is not None
            lease.complete_export(conn, claimed.lease, "id\n", "0 rows")
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def purge_ms(engine: sa.Engine) -> float:
    started = time.perf_counter()
    with engine.begin() as conn:
        purge_retired(conn, Retention(), batch=1000)
    return (time.perf_counter() - started) * 1000


def scan_seconds(env: BenchEnv, parts: dict[str, Part]) -> dict[str, list[float]]:
    """Seconds per dispatcher scan of each part, the parts taking turns (the first
    ``SCAN_WARMUP`` rounds untimed: they warm connections and caches)."""
    ledgers: dict[str, Ledger] = {}
    scanners: dict[str, Scanner] = {}
    times: dict[str, list[float]] = {name: [] for name in parts}
    try:
        for name, part in parts.items():
            env.activate(part)
            ledgers[name] = Ledger(part)
        for name, part in parts.items():
            scanners[name] = Scanner(env, part)
        names = list(parts)
        for i in range(SCAN_WARMUP + SCANS):
            for name in names if i % 2 == 0 else names[::-1]:
                elapsed, _ = scan_once(env, scanners[name], ledgers[name])
                if i >= SCAN_WARMUP:
                    times[name].append(elapsed)
    finally:
        for scanner in scanners.values():
            clear_broker(env, scanner.part)
            scanner.close()
    return times


def run_p8(env: BenchEnv, audit_rows: int = AUDIT_ROWS) -> dict[str, Any]:
    parts: dict[str, Part] = {"empty": env.part("p8-empty"), "full": env.part("p8-full")}
    owners = {name: seed_owner(part.engine) for name, part in parts.items()}
    fill_s = fill_audit(parts["full"].engine, owners["full"], audit_rows)
    medians: dict[str, list[float]] = {"empty": [], "full": []}
    purges: dict[str, list[float]] = {"empty": [], "full": []}
    for _ in range(ROUNDS):
        for name, part in parts.items():
            tasks = insert_tasks(part.engine, owners[name], TASKS, "WAITING")
            medians[name].append(claim_and_complete(part.engine, tasks))
            purges[name].append(purge_ms(part.engine))
    empty, full = statistics.median(medians["empty"]), statistics.median(medians["full"])
    scans = scan_seconds(env, parts)
    scan_empty, scan_full = (statistics.median(scans[name]) for name in ("empty", "full"))
    return {
        "p8_claim_ratio_10m_audit": round(full / empty, 3),
        "p8_scan_ratio_10m_audit": round(scan_full / scan_empty, 3),
        "p8_detail": {
            "audit_rows": audit_rows,
            "fill_s": round(fill_s, 1),
            "tasks_per_round": TASKS,
            "claim_complete_ms_empty": [round(m * 1000, 3) for m in medians["empty"]],
            "claim_complete_ms_10m": [round(m * 1000, 3) for m in medians["full"]],
            "purge_ms_empty": [round(p, 2) for p in purges["empty"]],
            "purge_ms_10m": [round(p, 2) for p in purges["full"]],
            "scan_ms_empty": [round(t * 1000, 2) for t in scans["empty"]],
            "scan_ms_10m": [round(t * 1000, 2) for t in scans["full"]],
        },
    }
