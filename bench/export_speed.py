"""P2: a 10,000-row export's execution vs a plain ``COPY (same query) TO STDOUT WITH CSV
HEADER`` of the same rows, and the executing process's peak RSS for 100,000 rows.

The export runs in a real worker (``-c 1``) and is timed inside it: ``execute()``, i.e.
claim, read, per-batch progress and the completion (whose guard checks the owner's
role). The COPY runs in this process on its own connection, right after, on the same
(warm) rows; its output is checked against the export's CSV, so both did the same work.
"""

from __future__ import annotations

import io
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg2
import sqlalchemy as sa

from bench import FLUSH_EVERY_S
from bench.env import BenchEnv, Part, read_stats, stop, wait_until
from bench.throughput import publish_ready
from harness.s3_server import s3_server
from ledger import service
from tasks.export import COPY_OPTIONS, csv_columns

SMALL_ROWS = 10_000
BIG_ROWS = 100_000
REPEATS = 9
EXPORT_TIMEOUT_S = 300


def seed_team(engine: sa.Engine, rows: int, label: str) -> tuple[uuid.UUID, uuid.UUID]:
    """One team, one staff member, ``rows`` tickets with realistic text: commas, quotes,
    newlines, formula-like starts, NULL assignees and due dates."""
    with engine.begin() as conn:
        team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES (:n) RETURNING id"), {"n": label}
        ).scalar_one()
        user = conn.execute(
            sa.text("INSERT INTO users (email, name) VALUES (:e, 'Export owner') RETURNING id"),
            {"e": f"owner-{uuid.uuid4().hex[:8]}@bench.test"},
        ).scalar_one()
        conn.execute(
            sa.text("INSERT INTO memberships (team_id, user_id, role) VALUES (:t, :u, 'STAFF')"),
            {"t": team, "u": user},
        )
        conn.execute(
            sa.text("""
            INSERT INTO tickets (team_id, title, status, priority, requester_id, assignee_id,
                                 due_at, created_at, updated_at)
            SELECT :team,
                   CASE g % 7
                     WHEN 0 THEN '=SUM(A' || g || ') formula-looking title'
                     WHEN 1 THEN 'Printer "jams", again #' || g
                     WHEN 2 THEN E'Two\\nlines ' || g
                     ELSE 'Customer cannot log in after password reset, ticket ' || g END,
                   (ARRAY['OPEN','PENDING','RESOLVED','CLOSED'])[1 + g % 4],
                   (ARRAY['LOW','NORMAL','HIGH','URGENT'])[1 + g % 4],
                   :user, CASE WHEN g % 3 = 0 THEN NULL ELSE :user END,
                   CASE WHEN g % 2 = 0 THEN now() + g * interval '1 minute' END,
                   timestamptz '2026-01-05 09:00Z' + g * interval '1 second',
                   timestamptz '2026-01-05 09:00Z' + g * interval '1 second'
              FROM generate_series(1, :rows) g"""),
            {"team": team, "user": user, "rows": rows},
        )
    with engine.connect() as conn:
        conn.execute(sa.text("ANALYZE tickets"))
    return team, user


def run_exports(
    env: BenchEnv,
    part: Part,
    label: str,
    team: uuid.UUID,
    user: uuid.UUID,
    count: int,
    between: Callable[[], None] | None = None,
    **env_extra: Any,
) -> tuple[list[float], list[dict[str, Any]], list[uuid.UUID]]:
    """``count`` exports one after another through one fresh ``-c 1`` worker; ``between``
    runs after each one completed (the side-by-side COPY)."""
    app = env.activate(part)
    stats_dir = env.stats_dir(label)
    worker = env.worker(part, f"w-{label}", concurrency=1, stats=stats_dir, **env_extra)
    worker.wait_event("worker.started", timeout=120)
    ids = []
    for _ in range(count):
        with part.engine.begin() as conn:
            task_id = service.create_export(conn, team, user, "TEAM", {})
        ids.append(task_id)
        sent, _ = publish_ready(part, app)
        assert sent == 1
        wait_until(
            lambda t=task_id: status_of(part.engine, t) in ("COMPLETED", "FAILED"),
            EXPORT_TIMEOUT_S,
            0.05,
            f"{label} export",
        )
        if status_of(part.engine, task_id) != "COMPLETED":
            raise RuntimeError(f"bench: the {label} export did not complete")
        if between is not None:
            between()
    time.sleep(3 * FLUSH_EVERY_S)  # the child writes its stats every FLUSH_EVERY_S
    stop(worker)
    stats = [s for s in read_stats(stats_dir) if "count" in s]
    durations = [d for s in stats for d in s["execute_s"]]
    return durations, stats, ids


def status_of(engine: sa.Engine, task_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT status FROM background_tasks WHERE id = :id"), {"id": task_id}
            ).scalar_one()
        )


def result_csv(engine: sa.Engine, task_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                sa.text(
                    "SELECT convert_from(string_agg(c.data, ''::bytea ORDER BY c.seq), 'UTF8')"
                    " FROM background_tasks t JOIN export_chunks c"
                    " ON c.task_id = t.id AND c.execution_id = t.result_key WHERE t.id = :id"
                ),
                {"id": task_id},
            ).scalar_one()
        )


class Copier:
    """``COPY (the export's SELECT) TO STDOUT`` with the export's own columns and CSV
    options (tasks/export.py) and a header, into memory, timed, on one psycopg2 connection
    of this process."""

    def __init__(self, database_url: str, team: uuid.UUID) -> None:
        self.query = (
            f"COPY (SELECT {csv_columns()} FROM tickets WHERE team_id = '{team}' "
            f"ORDER BY created_at, id) TO STDOUT WITH ({COPY_OPTIONS}, HEADER)"
        )
        self.conn = psycopg2.connect(
            database_url.replace("postgresql+psycopg2://", "postgresql://")
        )
        self.conn.autocommit = True
        self.times: list[float] = []
        self.text = ""

    def __call__(self) -> None:
        out = io.StringIO()
        with self.conn.cursor() as cur:
            started = time.perf_counter()
            cur.copy_expert(self.query, out)
            self.times.append(time.perf_counter() - started)
        self.text = out.getvalue()

    def close(self) -> None:
        self.conn.close()


def same_rows(export_csv: str, copy_csv: str) -> bool:
    """Bodies equal (the headers differ: COPY names the expressions, not the contract)."""
    return export_csv.split("\n", 1)[1] == copy_csv.split("\n", 1)[1]


def run_p2(env: BenchEnv) -> dict[str, Any]:
    part = env.part("p2")
    small_team, small_user = seed_team(part.engine, SMALL_ROWS, "Export team 10k")
    big_team, big_user = seed_team(part.engine, BIG_ROWS, "Export team 100k")
    copier = Copier(part.database_url, small_team)
    try:  # export, COPY, export, COPY, ...: both see the same machine at the same time
        durations, small_stats, ids = run_exports(
            env, part, "p2-10k", small_team, small_user, REPEATS + 1, between=copier
        )
    finally:
        copier.close()
    export_s = statistics.median(durations[1:])  # the first of each warms the caches
    copies = copier.times[1:]
    copy_s = statistics.median(copies)
    identical = same_rows(result_csv(part.engine, ids[-1]), copier.text)
    s3 = run_p2_s3(env, part, small_team, small_user)
    _, big_stats, big_ids = run_exports(
        env, part, "p2-100k", big_team, big_user, 1, EXPORT_MAX_ROWS=BIG_ROWS
    )
    big = big_stats[0]
    return {
        **s3,
        "p2_export_ratio_to_copy": round(copy_s / export_s, 3),
        "p2_export_10k_ms": round(export_s * 1000, 1),
        "p2_copy_10k_ms": round(copy_s * 1000, 1),
        "p2_peak_rss_mib": round(big["maxrss_kib"] / 1024, 1),
        "p2_detail": {
            "export_10k_ms_all": [round(d * 1000, 1) for d in durations],
            "copy_10k_ms_all": [round(c * 1000, 1) for c in copies],
            "export_csv_equals_copy": identical,
            "csv_bytes_10k": len(copier.text.encode()),
            "peak_rss_mib_10k": round(small_stats[0]["maxrss_kib"] / 1024, 1),
            "rss_before_first_task_mib_100k": round((big["hwm_before_kib"] or 0) / 1024, 1),
            "export_100k_ms": round(big["execute_s"][0] * 1000, 1),
            "csv_bytes_100k": len(result_csv(part.engine, big_ids[0]).encode()),
        },
    }


def run_p2_s3(env: BenchEnv, part: Part, team: uuid.UUID, user: uuid.UUID) -> dict[str, Any]:
    """The same 10k-row exports with ``EXPORT_STORE=s3://...`` against moto's S3 server on
    127.0.0.1 (harness/s3_server.py), export and COPY taking turns as above. The server is
    a Python process on the same two cores: what it costs is in the figure."""
    copier = Copier(part.database_url, team)
    try:
        with s3_server() as server:
            bucket = server.new_bucket()
            durations, _, ids = run_exports(
                env,
                part,
                "p2-10k-s3",
                team,
                user,
                REPEATS + 1,
                between=copier,
                EXPORT_STORE=f"s3://{bucket}/bench",
                **server.env,
            )
            with part.engine.connect() as conn:
                location = conn.execute(
                    sa.text("SELECT result_object FROM background_tasks WHERE id = :id"),
                    {"id": ids[-1]},
                ).scalar_one()
            key = str(location).removeprefix(f"s3://{bucket}/")
            stored = server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    finally:
        copier.close()
    export_s = statistics.median(durations[1:])
    copy_s = statistics.median(copier.times[1:])
    return {
        "p2_export_ratio_to_copy_s3": round(copy_s / export_s, 3),
        "p2_export_10k_s3_ms": round(export_s * 1000, 1),
        "p2_s3_detail": {
            "export_10k_ms_all": [round(d * 1000, 1) for d in durations],
            "copy_10k_ms_all": [round(c * 1000, 1) for c in copier.times[1:]],
            "export_csv_equals_copy": same_rows(stored.decode(), copier.text),
        },
    }
