"""The bench's outputs: machine facts, goal checks, the printed table, ``RESULTS.md`` and the
chart (scan time vs ledger size, throughput vs worker processes)."""

from __future__ import annotations

import hashlib
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

RESULTS_DIR = Path(__file__).with_name("results")
RESULTS_MD = Path(__file__).with_name("RESULTS.md")

# key, goal text, test on the results
GOALS: list[tuple[str, str, Any]] = [
    ("p1_export_ratio", ">= 0.75", lambda r: r["p1_export_ratio"] >= 0.75),
    ("p1_reminder_ratio", ">= 0.6", lambda r: r["p1_reminder_ratio"] >= 0.6),
    ("p1_overhead_cpu_us", "<= 2000 us", lambda r: r["p1_overhead_cpu_us"] <= 2000),
    ("p1_metrics_cost", ">= 0.97", lambda r: r["p1_metrics_cost"] >= 0.97),
    ("p1_tracing_cost", ">= 0.97", lambda r: r["p1_tracing_cost"] >= 0.97),
    (
        "p1_export_vs_procrastinate",
        ">= 1.0",
        lambda r: r["p1_export_vs_procrastinate"] >= 1.0,
    ),
    ("p2_export_ratio_to_copy", ">= 0.6", lambda r: r["p2_export_ratio_to_copy"] >= 0.6),
    (
        "p2_export_ratio_to_copy_s3",
        ">= 0.6",
        lambda r: r["p2_export_ratio_to_copy_s3"] >= 0.6,
    ),
    ("p3_scan_ratio_1m_10k", "<= 1.5", lambda r: r["p3_scan_ratio_1m_10k"] <= 1.5),
    ("p3_scan_ms_1m", "< 10 ms", lambda r: r["p3_scan_ms_1m"] < 10),
    ("p4_recovery_s", "<= 26 s", lambda r: r["p4_recovery_s"] <= 26),
    ("p5_heartbeat_gone_s", "<= 2 s", lambda r: r["p5_heartbeat_gone_s"] <= 2),
    ("p5_idle_exit_s", "<= 3 s", lambda r: r["p5_idle_exit_s"] <= 3),
    ("p6_start_ms_p50", "<= 20 ms", lambda r: r["p6_start_ms_p50"] <= 20),
    ("p6_start_ms_p95", "<= 100 ms", lambda r: r["p6_start_ms_p95"] <= 100),
    ("p6_scheduled_late_ms_p95", "<= 200 ms", lambda r: r["p6_scheduled_late_ms_p95"] <= 200),
    ("p6_dispatch_ratio_1w", ">= 0.9", lambda r: r["p6_dispatch_ratio_1w"] >= 0.9),
    ("p6_dispatch_ratio_3w", ">= 0.9", lambda r: r["p6_dispatch_ratio_3w"] >= 0.9),
    ("p6_fair_start_s", "<= 2 s", lambda r: r["p6_fair_start_s"] <= 2),
    (
        "p6_broker_depth_max",
        "<= window cap (4 x live worker processes)",
        lambda r: r["p6_broker_depth_max"] <= r["p6_broker_depth_bound"],
    ),
    ("p7_api_creates_per_s", ">= 400/s", lambda r: r["p7_api_creates_per_s"] >= 400),
    ("p8_claim_ratio_10m_audit", "<= 1.2", lambda r: r["p8_claim_ratio_10m_audit"] <= 1.2),
    ("p8_scan_ratio_10m_audit", "<= 1.2", lambda r: r["p8_scan_ratio_10m_audit"] <= 1.2),
    ("p9_fill_ms_empty", "<= 5 ms", lambda r: r["p9_fill_ms_empty"] <= 5),
    ("p9_fill_ms_100k_future", "<= 5 ms", lambda r: r["p9_fill_ms_100k_future"] <= 5),
    ("p9_fill_ratio_100k_future", "<= 1.5", lambda r: r["p9_fill_ratio_100k_future"] <= 1.5),
    ("p9_fill_ms_10k_ready", "<= 10 ms", lambda r: r["p9_fill_ms_10k_ready"] <= 10),
    ("p9_capped_fills", "1 fill", lambda r: r["p9_capped_fills"] == 1),
    (
        "p9_reminder_start_p50_ms_100k_future",
        "<= 20 ms",
        lambda r: r["p9_reminder_start_p50_ms_100k_future"] <= 20,
    ),
    ("p9_capped_start_s", "<= 1 s", lambda r: r["p9_capped_start_s"] <= 1),
]

ROWS: list[tuple[str, str, str]] = [  # key, what, unit
    ("p1_export_ratio", "P1 small exports / bare Celery tasks (throughput)", "ratio"),
    ("p1_reminder_ratio", "P1 reminders / bare Celery tasks (throughput)", "ratio"),
    ("p1_bare_tasks_per_s", "P1 bare no-op tasks, -c 2", "tasks/s"),
    ("p1_export_tasks_per_s", "P1 small exports, -c 2", "tasks/s"),
    ("p1_reminder_tasks_per_s", "P1 reminders, -c 2", "tasks/s"),
    ("p1_overhead_cpu_us", "P1 CPU per small export over a bare task, all processes", "us"),
    (
        "p1_export_vs_procrastinate",
        "P1 small exports / procrastinate's no-op jobs, same count, 2 processes each",
        "ratio",
    ),
    ("p1_procrastinate_jobs_per_s", "P1 procrastinate no-op jobs, 2 worker processes", "jobs/s"),
    ("p1_body_us_export", "P1 a small export's body alone (claim to commit), wall", "us"),
    ("p1_body_cpu_us_export", "P1 a small export's body alone, CPU (worker + PostgreSQL)", "us"),
    ("p1_body_us_reminder", "P1 a reminder's body alone (claim to commit), wall", "us"),
    ("p1_body_cpu_us_reminder", "P1 a reminder's body alone, CPU (worker + PostgreSQL)", "us"),
    ("p1_metrics_cost", "P1 small exports, worker metrics on / off (throughput)", "ratio"),
    ("p1_tracing_cost", "P1 small exports, worker traces on / off (throughput)", "ratio"),
    ("p1_tracing_cpu_us", "P1 CPU per small export, traces on minus off", "us"),
    ("p1_export_metrics_tasks_per_s", "P1 small exports, -c 2, metrics on", "tasks/s"),
    ("p1_metrics_cpu_us", "P1 CPU per small export, metrics on minus off", "us"),
    ("p1_metrics_us_per_task", "P1 metrics' CPU per task in the pool child (direct)", "us"),
    ("p1_metrics_share", "P1 that CPU / a pool child's time per small export", "ratio"),
    ("p2_export_ratio_to_copy", "P2 COPY time / 10k-row export execution time", "ratio"),
    (
        "p2_export_ratio_to_copy_s3",
        "P2 the same, EXPORT_STORE=s3:// (moto's server on 127.0.0.1)",
        "ratio",
    ),
    ("p2_export_10k_ms", "P2 10k-row export, claim to completion", "ms"),
    ("p2_copy_10k_ms", "P2 COPY (same query, same CSV options) TO STDOUT", "ms"),
    ("p2_peak_rss_mib", "P2 peak RSS of the process running a 100k-row export", "MiB"),
    ("p3_scan_ms_10k", "P3 one scan, 10k-row ledger", "ms"),
    ("p3_scan_ms_1m", "P3 one scan, 1M-row ledger", "ms"),
    ("p3_scan_ratio_1m_10k", "P3 scan time 1M / 10k", "ratio"),
    ("p4_recovery_s", "P4 SIGKILL mid-export -> COMPLETED by another worker", "s"),
    ("p5_heartbeat_gone_s", "P5 SIGTERM -> heartbeat member removed (idle)", "s"),
    ("p5_idle_exit_s", "P5 SIGTERM -> process exited (idle)", "s"),
    ("p6_start_ms_p50", "P6 export created -> claimed, idle cluster, p50", "ms"),
    ("p6_start_ms_p95", "P6 export created -> claimed, idle cluster, p95", "ms"),
    ("p6_scheduled_late_ms_p95", "P6 reminder run_at -> claimed, p95", "ms"),
    ("p6_dispatch_ratio_1w", "P6 tasks/s created while running / pre-filled, 1 worker", "ratio"),
    ("p6_dispatch_ratio_3w", "P6 tasks/s created while running / pre-filled, 3 workers", "ratio"),
    (
        "p6_dispatch_ratio_precreated_1w",
        "P6 tasks/s created first, then dispatched / pre-filled, 1 worker",
        "ratio",
    ),
    (
        "p6_dispatch_ratio_precreated_3w",
        "P6 tasks/s created first, then dispatched / pre-filled, 3 workers",
        "ratio",
    ),
    ("p6_fair_start_s", "P6 team B created -> claimed behind team A's backlog (max)", "s"),
    ("p6_broker_depth_max", "P6 broker lists (exports + reminders) while 10k drain, max", "msgs"),
    ("p6_broker_depth_bound", "P6 window cap: 4 x live worker processes", "msgs"),
    ("p7_api_creates_per_s", "P7 API export creations, 8 clients, 2 API processes", "/s"),
    ("p8_claim_ratio_10m_audit", "P8 claim + completion, 10M audit rows / empty trail", "ratio"),
    ("p8_scan_ratio_10m_audit", "P8 dispatcher scan, 10M audit rows / empty trail", "ratio"),
    ("p9_fill_ms_empty", "P9 one fill of 64 reminders, one team", "ms"),
    ("p9_fill_ms_100k_future", "P9 the same, 100k more teams with a reminder tomorrow", "ms"),
    ("p9_fill_ratio_100k_future", "P9 fill time, 100k future teams / none", "ratio"),
    ("p9_fill_ms_10k_ready", "P9 one fill of 64, 10k teams with ready reminders", "ms"),
    ("p9_capped_fills", "P9 fills until a new team is served, 20 teams at cap", "fills"),
    (
        "p9_reminder_start_p50_ms_100k_future",
        "P9 reminder created -> claimed, beat + 1 worker, 100k future teams, p50",
        "ms",
    ),
    ("p9_capped_start_s", "P9 new team's export created -> claimed, 20 teams at cap", "s"),
]


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "-"


def machine(engine: sa.Engine, client: redis.Redis) -> dict[str, Any]:
    with engine.connect() as conn:
        pg = conn.execute(sa.text("SHOW server_version")).scalar_one()
        sync = conn.execute(sa.text("SHOW synchronous_commit")).scalar_one()
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "billiard": _version("billiard"),
        "redis_py": _version("redis"),
        "sqlalchemy": _version("sqlalchemy"),
        "psycopg2": _version("psycopg2-binary"),
        "postgresql": str(pg),
        "postgresql_synchronous_commit": str(sync),
        "redis_server": str(client.info("server")["redis_version"]),
    }


CODE_DIRS = ("tasks", "ledger", "dispatcher", "worker", "teamdesk")


def code_fingerprint() -> dict[str, str]:
    """sha256 (12 hex) of every module the figures depend on: which code was measured."""
    root = Path(__file__).resolve().parents[1]
    out = {}
    for folder in CODE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
            out[str(path.relative_to(root))] = digest
    return out


def goals(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, text, test in GOALS:
        if key in results:
            out[key] = {"value": results[key], "goal": text, "met": bool(test(results))}
    return out


def table(results: dict[str, Any]) -> str:
    met = results.get("goals", {})
    lines = ["| figure | value | unit | goal | met |", "|---|---:|---|---|---|"]
    for key, what, unit in ROWS:
        if key not in results:
            continue
        goal = met.get(key, {})
        ok = "" if not goal else ("yes" if goal["met"] else "**no**")
        lines.append(
            f"| {what} (`{key}`) | {results[key]} | {unit} | {goal.get('goal', '')} | {ok} |"
        )
    for point in results.get("scaling", []):
        lines.append(
            f"| scaling: small exports, `-c {point['processes']}` | {point['tasks_per_s']} "
            "| tasks/s | shape only | |"
        )
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    p3 = results.get("p3_detail", {})
    sizes = [p3[k]["rows"] for k in ("10k", "1m") if k in p3]
    totals = [p3[k]["scan_ms"] for k in ("10k", "1m") if k in p3]
    without = [p3[k]["without_publish_ms"] for k in ("10k", "1m") if k in p3]
    left.plot(sizes, totals, "o-", label="whole scan")
    left.plot(sizes, without, "s--", label="without publishing")
    left.axhline(10, color="grey", linestyle=":", label="goal: 10 ms")
    left.set_xscale("log")
    left.set_xlabel("ledger rows (background_tasks)")
    left.set_ylabel("ms per scan (median)")
    left.set_title("Dispatcher scan: 50 due + 10 stale rows")
    left.set_ylim(bottom=0)
    left.legend()
    points = results.get("scaling", [])
    right.plot(
        [p["processes"] for p in points],
        [p["tasks_per_s"] for p in points],
        "o-",
        label="small exports",
    )
    if "p1_bare_tasks_per_s" in results:
        right.axhline(
            results["p1_bare_tasks_per_s"],
            color="grey",
            linestyle=":",
            label="bare Celery, -c 2 (P1)",
        )
    right.set_xlabel("worker processes (-c)")
    right.set_ylabel("tasks/s")
    right.set_xticks([p["processes"] for p in points])
    right.set_title(f"Throughput vs processes ({os.cpu_count()} cores)")
    right.set_ylim(bottom=0)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


HOW_MEASURED = """\
## How measured

`make bench` (`.venv/bin/python -m bench.run`) creates its own databases (a template
migrated with the Alembic revisions, one clone per part, all dropped at the end) and its
own Redis key prefix (`tdbench-<hex>-<part>`, deleted at the end); it never touches the
`teamdesk` database. Every figure is a ratio of two things measured in the same run.

- **P1** — 100 teams x 50 tickets. 5,000 exports `{"q": "#Tnnnnn#"}` (one matching
  ticket each, TEAM scope, created with `ledger.service.create_export`) and 5,000
  reminders, each on a different ticket (assignee set, so each sends a notification, bumps the
  version, writes an event) are published before the worker starts, the way the
  dispatcher publishes a window but all at once (the dispatcher itself publishes at most
  its window): every ready row stamped `dispatched_at = now()` in one statement, then
  `tasks.queueing.publish_batch` in chunks of 500; no dispatcher runs during a drain.
  The baseline is 5,000
  `bench.noop` tasks (registered on the same app by `bench/worker_hooks.py`, loaded
  through `TEAMDESK_TEST_HOOKS`, same options as the real tasks, empty body), published to
  the same queue. Each batch is drained by one fresh `celery -A tasks worker -c 2 --pool
  prefork -Q exports,reminders,maintenance --without-mingle --without-gossip`, LOG_LEVEL
  info. Throughput = tasks / (last task end - first task start), taken inside the pool
  children (Celery `task_prerun`/`task_postrun`). Order: (bare, exports, exports with
  metrics on, exports with traces on, reminders) x 2, the three export batches reversed
  in the second round, then bare once more; each ratio is the median of its kind over
  the median of the bare runs.
  *Metrics cost* (`p1_metrics_cost`): 5,000 small exports drained by a worker with
  `METRICS_PORT` set (prometheus_client's multiprocess mode, its directory under the
  bench's work directory), whose `/metrics` this process GETs every second meanwhile
  (Prometheus's default interval is a minute, 15 s a common setting); the median of
  these runs over the median of the metrics-off export runs; the last scrape must count
  every export `completed`.
  *Tracing cost* (`p1_tracing_cost`): the same with the worker's traces on instead
  (`OTEL_EXPORTER_OTLP_ENDPOINT` to an OTLP/HTTP receiver in the bench process,
  `parentbased_always_on`, the SDK's default batches): one span per export (its
  execution) with three events (claimed, read, completed); the median over the
  metrics-off exports' median. The three
  export batches run in reverse order in the second round.
  Under that ratio, which moves by several per cent between batches, the direct figure
  (`p1_metrics_us_per_task`, bench/metrics_cost.py): CPU per task of what a pool child
  records for one small export, in multiprocess mode, 20,000 times in a fresh process;
  `p1_metrics_share` is it over a child's time per small export (2 / exports per s). A
  batch during which other processes kept more than 0.5 cores busy is run once more (at
  most 3 reruns) and the quieter of the two kept. CPU per task is read from /proc
  for the worker's processes and the PostgreSQL backends of the bench database, and from
  `INFO cpu` for Redis; `foreign_cpu_cores` is what the rest of the machine used meanwhile.
  *The bodies alone* (`p1_body_*`, bench/body_cost.py): after the batches, 2,000 one-ticket
  exports and then 2,000 reminders (50 of each first, not counted)
  are claimed and run one after the other on one autocommit execution connection in this
  process, without Celery or the broker: wall time per task, and this process's CPU plus
  the PostgreSQL backend's (from /proc) per task.
- **P2** — 10,000 and 100,000 tickets with commas, quotes, newlines, formula-like starts
  and NULLs. A `-c 1` worker runs the 10k export 10 times; after each one completes, this
  process runs `COPY (same SELECT) TO STDOUT WITH (FORMAT csv, FORCE_QUOTE *, HEADER)`
  into memory over psycopg2 (export, COPY, export, COPY, ...). Medians of the last 9 of
  each (the first warms the caches): `execute()` (claim to completion, timed in the child)
  vs COPY. The export's CSV
  body is checked equal to COPY's. Peak RSS = `ru_maxrss` of the fresh
  pool child that ran one 100k export (EXPORT_MAX_ROWS=100000).
- **P3** — two ledgers, 10k and 1M rows (set-based `generate_series`, `VACUUM ANALYZE`),
  each with 50 due WAITING and 10 RUNNING rows silent for 10 minutes, and a heartbeat
  member offering 40 worker processes on both queues (a window of 80, room for all 60).
  `dispatcher.scan.scan(cluster, window, purge=True)` (recover, lost-message check,
  fill, purge; in this process, on one warm `Cluster` + `Window` per ledger) alternates
  between them; before each scan the 60 rows are reset and the queue lists cleared;
  median of 15 timed scans after a warm-up. Every timed scan recovers 10 rows and
  publishes 60 (no published run is past the 5 s grace, so the lost-message check does
  not look at the broker). `publish_ms` is the time inside `queueing.publish_batch`;
  `idle_scan_ms` is a scan with nothing to do (median of 5).
- **P4** — as `tests/process/test_kill_recovery.py`: default timings, real beat, worker 1
  parked at the `export.after_read` gate, worker 2 running; SIGKILL worker 1; time until
  the row is COMPLETED (polled every 20 ms).
- **P5** — idle `-c 2` worker; SIGTERM; poll its member in
  `<prefix>:worker-heartbeat:active` every 2 ms, then wait for exit; median of 3.
- **scaling** — 1,500 small exports per point, `-c 1/2/4`, same method as P1.
- **P6** — the dispatch path: real `celery -A tasks worker -c 2` and `celery -A tasks
  beat` (the dispatcher) subprocesses, default settings (window = 2 x live worker
  processes, from the heartbeats); every time is the database's clock (`created_at`,
  `run_at`, `task_audit.at`). *Start latency*: one worker + beat, 100 small exports
  created one at a time with `ledger.service.create_export` in a transaction of their own
  (after 4 warm-up tasks); after each one completed a 0.1 s pause, so the cluster is idle
  when the next is created; `created_at` (the creating transaction's `now()`) -> first
  `CLAIM`, split in the detail at `dispatched_at` (the `now()` of the dispatcher's fill
  transaction). *Scheduled*: 20 reminders due
  1 s after the first was created, 0.25 s apart; first `CLAIM` - `run_at`. *Dispatch
  ratio*, with 1 worker and then 3 (each `-c 2`, running and idle, no beat): 2,000 small
  exports published in one go as in P1 (tasks/s from the first CLAIM to the last
  COMPLETE); then 2,000 created while no beat runs, then beat started (the dispatcher
  alone feeds the workers: the *pre-created* ratio, first CLAIM to last COMPLETE); then 4
  threads create 2,000 more while beat runs (one transaction each, over their own teams,
  faster than the workers drain them; tasks/s from the first `created_at` to the last
  COMPLETE). Ratio = dispatcher-fed / pre-filled; on 2 cores the creating threads and
  their inserts compete with the workers for the CPU in the dispatcher-fed run. A pair during
  which other processes kept more than 0.5 cores busy is run once more and the quieter
  kept. *Fairness*: 3 workers + beat; team A gets 10,000 waiting exports (one set-based
  insert of the rows the service writes); once every worker process has taken work, team
  B creates 5 exports one at a time; `created_at` -> CLAIM, the max is reported.
  *Broker depth*: `LLEN <prefix>:exports` + `LLEN <prefix>:reminders` every 50 ms during
  that whole drain; the bound is the window's cap, 4 x the live worker processes in the
  heartbeats (2 per process, up to 4 when 50 ms of the tasks' throughput is more).
- **P7** — `POST /api/teams/{team}/exports` through real `teamdesk-tasks api` processes
  (one uvicorn process each, 2 as deploy/k8s/api.yaml's replicas, and 1 in the detail),
  8 client threads, each with its own token, team and keep-alive connection, sent to the
  processes in turn; the rate limit stays on with a budget no client reaches; no worker
  runs; creations counted for 5 s after a 1 s warm-up.
- **P8** — two databases, one with an empty `task_audit`, one with 10,000,000 rows
  (one `INSERT ... SELECT`, over 1,000 finished tasks, dated a day ago). *Claim*: 500
  WAITING exports claimed and completed one after the other on one connection
  (`lease.claim`, `lease.complete_export`), the databases taking turns 3 times; ratio of
  the median per-task times. *Scan*: P3's scan (10 stale RUNNING rows recovered, 60 runs
  published, the purge step) on each, alternating, 9 timed after 4 untimed rounds
  (right after the fill the first scans of the 10M trail are slower); ratio of the
  medians. One retention purge call is timed on each (detail).
"""


def _median_cpu(runs: list[dict[str, Any]]) -> dict[str, int]:
    keys = ("worker_main", "worker_children", "postgres", "redis")
    out = {}
    for key in keys:
        values = sorted(r["cpu_us_per_task"][key] for r in runs)
        out[key] = values[len(values) // 2]
    return out


def details_md(results: dict[str, Any]) -> list[str]:
    """Where the time goes, from the same run's detail (and its profile, when run)."""
    lines: list[str] = []
    runs = results.get("p1_detail", {}).get("runs", {})
    if runs:
        lines += [
            "## P1: CPU per task (µs, median of the runs)",
            "",
            "| kind | worker main | pool children | PostgreSQL | Redis | total | "
            "cores busy (of 2) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for kind in ("noop", "export", "export_metrics", "reminder"):
            if not runs.get(kind):
                continue
            cpu = _median_cpu(runs[kind])
            busy = sorted(r["cpu_busy_of_2_cores"] for r in runs[kind])[len(runs[kind]) // 2]
            lines.append(
                f"| {kind} | {cpu['worker_main']} | {cpu['worker_children']} | "
                f"{cpu['postgres']} | {cpu['redis']} | {sum(cpu.values())} | {busy} |"
            )
        lines.append("")
    split = results.get("profile_split_us")
    if split:
        kinds = [k for k in ("noop", "export", "reminder", "export_10k") if k in split]
        parts = sorted({p for k in kinds for p in split[k]})
        lines += [
            "## Pool child wall time per task (µs, traced run: `--profile`)",
            "",
            "| part | " + " | ".join(kinds) + " |",
            "|---|" + "---:|" * len(kinds),
        ]
        for part in parts:
            lines.append(
                f"| {part} | " + " | ".join(str(split[k].get(part, "")) for k in kinds) + " |"
            )
        lines += ["", "Every traced call: `results/profile.txt`.", ""]
    p3 = results.get("p3_detail", {})
    if "1m" in p3:
        lines += [
            "## P3: inside one scan (ms, medians)",
            "",
            "| ledger | whole scan | publishing 60 messages | the rest | scan with nothing to do |",
            "|---|---:|---:|---:|---:|",
        ]
        for key in ("10k", "1m"):
            d = p3[key]
            lines.append(
                f"| {d['rows']:,} rows | {d['scan_ms']} | {d['publish_ms']} | "
                f"{d['without_publish_ms']} | {d.get('idle_scan_ms', '-')} |"
            )
        split = {key: p3[key].get("steps_ms") for key in ("10k", "1m")}
        if all(split.values()):
            order = ("recover", "capacity", "lost_check", "fill", "publish", "purge")
            steps = [k for k in order if k in split["1m"]]
            steps += [k for k in split["1m"] if k not in steps]  # "whole scan", anything new
            lines += [
                "",
                "Per step (ms, medians of 5 more scans with every step timed; `fill` includes "
                "`publish`, `capacity` is the heartbeat read of the window):",
                "",
                "| ledger | " + " | ".join(steps) + " |",
                "|---|" + "---:|" * len(steps),
            ]
            for key in ("10k", "1m"):
                lines.append(
                    f"| {p3[key]['rows']:,} rows | "
                    + " | ".join(str(split[key].get(step, "")) for step in steps)
                    + " |"
                )
        statements = p3.get("sql_statements_per_scan", {})
        lines += ["", f"SQL statements per scan: {sum(statements.values())} ({statements}).", ""]
    lines += p6_md(results.get("p6_detail", {}))
    lines += p7_md(results.get("p7_detail", {}))
    p2 = results.get("p2_detail", {})
    if p2:
        lines += [
            "## P2: memory",
            "",
            f"Peak RSS of the pool child: {p2.get('rss_before_first_task_mib_100k')} MiB before "
            f"its first task, {p2.get('peak_rss_mib_10k')} MiB after a 10k-row export "
            f"({p2.get('csv_bytes_10k', 0) // 1024} KiB of CSV), {results.get('p2_peak_rss_mib')} "
            f"MiB after a 100k-row export ({p2.get('csv_bytes_100k', 0) // 1024} KiB of CSV, "
            f"{p2.get('export_100k_ms')} ms).",
            "",
        ]
    return lines


def p7_md(p7: dict[str, Any]) -> list[str]:
    """P7's detail: creations per second and CPU per creation, by side."""
    runs = [r for r in p7.get("runs", []) if "cpu_us_per_create" in r]
    if not runs:
        return []
    sides = list(runs[0]["cpu_us_per_create"])
    lines = [
        "## P7: what an API creation costs (CPU µs per creation, /proc)",
        "",
        "| API processes | creations/s | " + " | ".join(sides) + " |",
        "|---:|---:|" + "---:|" * len(sides),
    ]
    for run in runs:
        cpu = run["cpu_us_per_create"]
        lines.append(
            f"| {run['processes']} | {run['creates_per_s']} | "
            + " | ".join(str(cpu.get(side, "")) for side in sides)
            + " |"
        )
    return [*lines, ""]


def p6_md(p6: dict[str, Any]) -> list[str]:
    """P6's detail: where the start latency goes, both sides of each ratio, fairness."""
    if "start" not in p6:
        return []
    start, scheduled = p6["start"], p6["scheduled"]
    lines = [
        "## P6: the dispatch path (database clock)",
        "",
        "| idle cluster, ms | p50 | p95 | max |",
        "|---|---:|---:|---:|",
    ]
    for key, what in (
        ("start_ms", "export created -> claimed"),
        ("created_to_stamped_ms", "created -> stamped by the dispatcher"),
        ("stamped_to_claimed_ms", "stamped -> claimed (broker, worker)"),
    ):
        d = start[key]
        lines.append(f"| {what} | {d['p50']} | {d['p95']} | {d['max']} |")
    late = scheduled["late_ms"]
    lines.append(f"| reminder run_at -> claimed | {late['p50']} | {late['p95']} | {late['max']} |")
    lines += [
        "",
        "| workers | pre-filled tasks/s | dispatcher-fed tasks/s | ratio | creation / drain | "
        "cores: beat + its PostgreSQL | cores: other load |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in ("ratio_1w", "ratio_3w"):
        if key not in p6:
            continue
        r = p6[key]
        pre, fed = r["prefilled"], r["dispatched"]
        lines.append(
            f"| {r['workers']} x `-c 2` | {pre['tasks_per_s']} | {fed['tasks_per_s']} | "
            f"{r['ratio']} | {fed['creation_share_of_drain']} | {fed['beat_cpu_cores']} + "
            f"{fed.get('dispatcher_pg_cpu_cores', '-')} | {r['foreign_cpu_cores']} |"
        )
    fair, depth, backlog = p6.get("fair"), p6.get("depth"), p6.get("backlog")
    if fair and depth and backlog:
        lines += [
            "",
            f"Team B behind team A's backlog of {backlog['tasks']:,}: created -> claimed "
            f"{fair['b_start_s_all']} s (team A's runs not yet published / in the window "
            f"when B created: {fair['team_a_when_b_created']}). Broker lists during the drain "
            f"({depth['samples']} samples): max {depth['lists_max']}, mean "
            f"{depth['lists_mean']}, bound {depth['bound']} ({depth['processes']} processes); "
            f"max unacknowledged {depth['unacked_max']}. The backlog drained at "
            f"{backlog['tasks_per_s']} tasks/s.",
        ]
    logs = p6.get("logs")
    if logs:
        lines += [
            "",
            f"Logged meanwhile: warnings/errors {logs['warnings'] or 'none'}; workers "
            f"{logs['worker_events'] or 'nothing unusual'}; beat's scans repaired "
            f"{logs['scans']}.",
        ]
    return [*lines, ""]


def write_results_md(results: dict[str, Any]) -> None:
    m = results["machine"]
    lines = [
        "# Bench results (last run)",
        "",
        f"Run at {results['finished_at']} in {results['duration_s']} s (`{results['command']}`).",
        "",
        table(results),
        "",
        "![scan time vs ledger size; throughput vs worker processes](results/chart.png)",
        "",
        "## Machine",
        "",
        f"{m['cpu_count']} x {m['cpu_model']}, {m['memory_gib']} GiB, Linux {m['kernel']}; "
        f"Python {m['python']}, Celery {m['celery']}, kombu {m['kombu']}, billiard "
        f"{m['billiard']}, redis-py {m['redis_py']}, SQLAlchemy {m['sqlalchemy']}, psycopg2 "
        f"{m['psycopg2']}; PostgreSQL {m['postgresql']} (synchronous_commit="
        f"{m['postgresql_synchronous_commit']}), Redis {m['redis_server']}.",
        "",
        f"Other load on the machine during P1 (cores busy outside the measurement): "
        f"{results.get('p1_foreign_cpu_cores', '-')}.",
        "",
        *details_md(results),
        HOW_MEASURED,
    ]
    notes = results.get("notes")
    if notes:
        lines += ["## Notes on this run", "", *[f"- {n}" for n in notes], ""]
    RESULTS_MD.write_text("\n".join(lines))


def main() -> None:
    """Re-render RESULTS.md and chart.png from results/latest.json (no measuring)."""
    import json

    results = json.loads((RESULTS_DIR / "latest.json").read_text())
    chart(results, RESULTS_DIR / "chart.png")
    write_results_md(results)


if __name__ == "__main__":
    main()
