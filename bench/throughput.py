"""P1 (ledger tasks vs bare Celery tasks, same worker) and the worker-process scaling curve.

Rows are created through ``ledger.service``. The dispatcher publishes at most its window
(two messages per live worker process), so a pre-filled queue is published here directly,
the way the dispatcher publishes a window (:func:`publish_ready`): every ready row is
stamped (``dispatched_at = now()``) in one statement and committed, then its messages
(``{id}-{run}``) go out with ``tasks.queueing.publish_batch``, in chunks of
``PUBLISH_CHUNK``. Every message the worker gets is the one the dispatcher would have
sent for that row; no dispatcher runs during a drain. All
messages are in the queue before the worker starts; throughput is counted inside the
worker, from its first task start to its last task end.

P1 also drains small exports with the worker's Prometheus metrics on (``METRICS_PORT``,
multiprocess mode, ``/metrics`` scraped every second) next to the same exports with them
off: ``p1_metrics_cost`` is the ratio of the two throughputs (issue 15: at least 0.97);
and with the worker's traces on (the ``OTEL_*`` variables, every execution sampled and
exported to a receiver in this process): ``p1_tracing_cost`` (issue 39: at least 0.97).
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from bench import FLUSH_EVERY_S, NOOP_TASK, body_cost, metrics_cost
from bench.env import BenchEnv, Part, cpu_snapshot, read_stats, stop, wait_until
from harness import databases
from harness.otlp_receiver import start_receiver
from harness.processes import free_port
from ledger import dispatch, service
from ledger.dispatch import RunRef
from ledger.states import KINDS
from tasks import queueing
from tasks.names import EXPORTS_QUEUE

TEAMS = 100
TICKETS_PER_TEAM = 50  # 5,000 tickets: one per export and one per reminder
WORKER_START_TIMEOUT_S = 120
DRAIN_TIMEOUT_S = 600
NOISY_CORES = 0.5  # other load during a P1 batch above which it is run once more
MAX_RERUNS = 3  # ... at most this many times per run (the 15-minute budget)
PUBLISH_CHUNK = 500  # messages per publish_batch call (one pipeline each)
STAMP_ALL = 100_000  # runs stamped per dispatch.stamp_ready call: a whole pre-filled queue
SCRAPE_EVERY_S = 1.0  # a metrics-on worker is scraped this often while it drains


@dataclass(frozen=True)
class TicketRef:
    team_id: uuid.UUID
    staff_id: uuid.UUID
    ticket_id: uuid.UUID
    token: str  # unique inside every title: an export with {"q": token} matches one ticket


def seed_world(engine: sa.Engine) -> list[TicketRef]:
    """TEAMS teams, one staff member each (also every ticket's assignee), set-based."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("""
            WITH t AS (
                INSERT INTO teams (name) SELECT 'Bench team ' || g FROM generate_series(1, :teams) g
                RETURNING id, name),
            u AS (
                INSERT INTO users (email, name)
                SELECT 'staff-' || md5(t.name) || '@bench.test', 'Staff of ' || t.name FROM t
                RETURNING id, name)
            INSERT INTO memberships (team_id, user_id, role)
            SELECT t.id, u.id, 'STAFF' FROM t JOIN u ON u.name = 'Staff of ' || t.name"""),
            {"teams": TEAMS},
        )
        conn.execute(
            sa.text("""
            INSERT INTO tickets (team_id, title, requester_id, assignee_id, created_at, updated_at)
            SELECT m.team_id,
                   'Printer on floor ' || g || ' jams #T'
                       || lpad((row_number() OVER ())::text, 5, '0') || '#',
                   m.user_id, m.user_id,
                   now() - g * interval '1 minute', now() - g * interval '1 minute'
              FROM memberships m CROSS JOIN generate_series(1, :per) g"""),
            {"per": TICKETS_PER_TEAM},
        )
        rows = conn.execute(
            sa.text("""
            SELECT t.team_id, t.requester_id, t.id, substring(t.title from '#T[0-9]+#') AS token
              FROM tickets t ORDER BY token""")
        )
        return [TicketRef(r[0], r[1], r[2], r[3]) for r in rows]


def create_exports(engine: sa.Engine, refs: list[TicketRef], n: int) -> list[uuid.UUID]:
    ids: list[uuid.UUID] = []
    with engine.begin() as conn:
        for i in range(n):
            ref = refs[i % len(refs)]
            ids.append(
                service.create_export(conn, ref.team_id, ref.staff_id, "TEAM", {"q": ref.token})
            )
    return ids


def create_reminders(engine: sa.Engine, refs: list[TicketRef], n: int) -> list[uuid.UUID]:
    ids: list[uuid.UUID] = []
    with engine.begin() as conn:
        for i in range(n):
            ref = refs[i % len(refs)]
            ids.append(service.create_reminder(conn, ref.team_id, ref.staff_id, ref.ticket_id))
    return ids


def publish_ready(part: Part, app: Celery, chunk: int = PUBLISH_CHUNK) -> tuple[int, float]:
    """Publish every ready row of ``part`` (a pre-filled queue, no window): stamp them with
    the dispatcher's own statement (``dispatch.stamp_ready``, with room for all of them,
    in its publish order) and commit, then ``publish_batch`` per chunk. Returns (count,
    seconds)."""
    started = time.perf_counter()
    refs: list[RunRef] = []
    with part.engine.begin() as conn:
        for kind in KINDS:
            while stamped := dispatch.stamp_ready(conn, kind=kind, n=STAMP_ALL, team_cap=0).refs:
                refs += stamped
    for i in range(0, len(refs), chunk):
        queueing.publish_batch(app, refs[i : i + chunk])
    return len(refs), time.perf_counter() - started


def publish_noops(app: Celery, n: int) -> tuple[int, float]:
    """The baseline's messages: same app, queue and id shape, no ledger row."""
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for _ in range(n):
            task_id = str(uuid.uuid4())
            app.send_task(
                NOOP_TASK,
                args=[task_id, 0],
                task_id=f"{task_id}-0",
                queue=EXPORTS_QUEUE,
                producer=producer,
            )
    return n, time.perf_counter() - started


def completed(engine: sa.Engine, ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM background_tasks "
                    "WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'COMPLETED'"
                ),
                {"ids": [str(i) for i in ids]},
            ).scalar_one()
        )


class Scraper:
    """GETs a worker's ``/metrics`` every :data:`SCRAPE_EVERY_S` from a thread (more often
    than a Prometheus would), so a metrics-on drain pays for serving them too."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.scrapes = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-scraper", daemon=True)
        self._thread.start()

    def get(self) -> str:
        with urllib.request.urlopen(self.url, timeout=5) as answer:
            return str(answer.read().decode())

    def _loop(self) -> None:
        while not self._stop.wait(SCRAPE_EVERY_S):
            try:
                self.get()
                self.scrapes += 1
            except OSError:
                self.failures += 1

    def completed(self) -> float:
        """Stops the thread; one last scrape: executions counted ``completed``."""
        self._stop.set()
        self._thread.join()
        return sum(
            sample.value
            for family in text_string_to_metric_families(self.get())
            if family.name == "teamdesk_task_duration_seconds"
            for sample in family.samples
            if sample.name.endswith("_count") and sample.labels.get("outcome") == "completed"
        )


def metrics_env(env: BenchEnv, label: str) -> dict[str, Any]:
    """A worker's metrics on (docs/observability.md): a loopback port, multiprocess mode in a
    directory of the bench's own."""
    directory = env.workdir / "prometheus" / label
    directory.mkdir(parents=True, exist_ok=True)
    return {"METRICS_PORT": free_port(), "PROMETHEUS_MULTIPROC_DIR": str(directory)}


def tracing_env(endpoint: str) -> dict[str, Any]:
    """A worker's traces on (docs/design.md, "Tracing"): the standard variables, every
    execution sampled, exported over OTLP/HTTP to a receiver in this process, in the
    SDK's default batches."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }


def drain(
    env: BenchEnv,
    part: Part,
    label: str,
    n: int,
    concurrency: int = 2,
    extra_env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Start one worker on the pre-filled queues, wait until it drained them, stop it.
    With ``METRICS_PORT`` in ``extra_env``, its ``/metrics`` is scraped meanwhile."""
    stats_dir = env.stats_dir(label)
    extra = {"METRICS_PORT": 0, **(extra_env or {})}  # off unless asked for
    worker = env.worker(part, f"w-{label}", concurrency=concurrency, stats=stats_dir, **extra)
    worker.wait_event("worker.started", timeout=WORKER_START_TIMEOUT_S)
    scraper = Scraper(int(extra["METRICS_PORT"])) if extra["METRICS_PORT"] else None
    before = cpu_snapshot(env, part, worker)
    wait_until(lambda: env.backlog(part) == 0, DRAIN_TIMEOUT_S, 0.1, f"{label} to drain")
    time.sleep(0.2)
    wait_until(lambda: env.backlog(part) == 0, DRAIN_TIMEOUT_S, 0.1, f"{label} to drain")
    after = cpu_snapshot(env, part, worker)
    cpu = after.minus(before)
    time.sleep(3 * FLUSH_EVERY_S)  # the children write their stats every FLUSH_EVERY_S
    scraped = None if scraper is None else scraper.completed()
    exit_code = stop(worker)
    stats = [s for s in read_stats(stats_dir) if "count" in s]
    count = sum(s["count"] for s in stats)
    first = min(s["first_start"] for s in stats if s["first_start"])
    last = max(s["last_end"] for s in stats if s["last_end"])
    wall = last - first
    durations = sorted(d for s in stats for d in s["execute_s"])
    result: dict[str, Any] = {
        "label": label,
        "tasks": count,
        "expected": n,
        "concurrency": concurrency,
        "seconds": round(wall, 3),
        "tasks_per_s": round(count / wall, 1),
        "worker_exit_code": exit_code,
        "stats_dir": str(stats_dir),
        "cpu_us_per_task": {k: round(v * 1e6 / max(count, 1)) for k, v in cpu.items()},
        "cpu_busy_of_2_cores": round(sum(cpu.values()) / wall / 2, 2),
        "foreign_cpu_cores": round(after.foreign_cores(before), 2),
    }
    if durations:
        result["execute_ms_median"] = round(durations[len(durations) // 2] * 1000, 2)
    if scraper is not None:
        result["metrics"] = {
            "scrapes": scraper.scrapes,
            "scrape_failures": scraper.failures,
            "completed_counted": scraped,
        }
    if count != n:
        result["error"] = f"worker ran {count} tasks, expected {n}"
    return result


def one_batch(
    env: BenchEnv, part: Part, app: Celery, refs: list[TicketRef], kind: str, n: int, label: str
) -> tuple[dict[str, Any], float]:
    """Publish ``n`` messages of ``kind`` and drain them; returns (result, publish seconds).
    ``export_metrics``: small exports drained by a worker with its metrics on."""
    ids: list[uuid.UUID] = []
    if kind == "noop":
        _, publish_s = publish_noops(app, n)
    else:
        create = create_reminders if kind == "reminder" else create_exports
        ids = create(part.engine, refs, n)
        sent, publish_s = publish_ready(part, app)
        assert sent == n, f"published {sent} of {n}"
    on = metrics_env(env, label) if kind == "export_metrics" else None
    receiver = start_receiver() if kind == "export_tracing" else None
    if receiver is not None:
        on = tracing_env(receiver.endpoint)
    try:
        result = drain(env, part, label, n, extra_env=on)
    finally:
        if receiver is not None:
            result_spans = len(receiver.received())
            receiver.close()
    if receiver is not None:
        # One span per export: its execution (the claim, read and completion are events).
        result["spans_received"] = result_spans
        if result_spans < n:
            result["error"] = f"the receiver got {result_spans} spans for {n} exports"
    if ids:
        done = completed(part.engine, ids)
        if done != n:
            result["error"] = f"{done} of {n} rows COMPLETED"
    counted = result.get("metrics", {}).get("completed_counted")
    if on is not None and counted != n:
        result["error"] = f"the worker's /metrics counted {counted} completed of {n}"
    return result, publish_s


def p1_order(rounds: int) -> list[str]:
    """Bare no-ops, exports with metrics off and on (the pair's order swapped every other
    round, so a drift of the machine does not favour one side), reminders; x rounds, then
    bare no-ops again: the baseline brackets the runs."""
    order: list[str] = []
    for i in range(rounds):
        trio = ["export", "export_metrics", "export_tracing"]
        order += ["noop", *(trio if i % 2 == 0 else trio[::-1]), "reminder"]
    return [*order, "noop"]


BODY_TASKS = 2000  # of each kind, for the bodies alone (bench/body_cost.py)


def run_p1(env: BenchEnv, n: int = 5000, rounds: int = 2) -> dict[str, Any]:
    """The batches of :func:`p1_order`. A batch during which the rest of the machine kept
    more than NOISY_CORES busy is run once more and the quieter of the two kept (both are
    in the detail)."""
    part = env.part("p1")
    app = env.activate(part)
    refs = seed_world(part.engine)
    runs: dict[str, list[dict[str, Any]]] = {
        "noop": [],
        "export": [],
        "export_metrics": [],
        "export_tracing": [],
        "reminder": [],
    }
    publish: dict[str, float] = {}
    order = p1_order(rounds)
    reruns = MAX_RERUNS
    for index, kind in enumerate(order):
        label = f"p1-{index}-{kind}"
        result, publish[kind] = one_batch(env, part, app, refs, kind, n, label)
        if result["foreign_cpu_cores"] > NOISY_CORES and reruns > 0:
            reruns -= 1
            again, _ = one_batch(env, part, app, refs, kind, n, f"{label}-again")
            quieter, louder = sorted((result, again), key=lambda r: r["foreign_cpu_cores"])
            quieter["discarded_noisy_run"] = {
                k: louder[k] for k in ("tasks_per_s", "foreign_cpu_cores", "label")
            }
            result = quieter
        runs[kind].append(result)
    summary = summarise_p1(runs, n, publish)
    summary.update(body_cost.run_body_cost(part, min(n, BODY_TASKS)))
    summary.update(run_peer(n, rounds, summary["p1_export_tasks_per_s"]))
    return summary


def run_peer(n: int, rounds: int, export_per_s: float) -> dict[str, Any]:
    """The nearest peer on the same PostgreSQL: procrastinate draining ``n`` no-op jobs with
    two worker processes (bench/peer_procrastinate.py), ``rounds`` times; the median."""
    # procrastinate is in the bench extra only (make bench installs it), as matplotlib
    # is for the chart: the tests import this module without it.
    from bench import peer_procrastinate

    peers = [
        peer_procrastinate.procrastinate_noop_jobs_per_s(databases.ADMIN_URL, n, concurrency=2)
        for _ in range(rounds)
    ]
    rate = float(statistics.median(p["jobs_per_s"] for p in peers))
    return {
        "p1_procrastinate_jobs_per_s": round(rate, 1),
        "p1_export_vs_procrastinate": round(export_per_s / rate, 3),
        "p1_peer_detail": peers,
    }


def _median_rate(results: list[dict[str, Any]]) -> float:
    return float(statistics.median(r["tasks_per_s"] for r in results))


def _median_cpu_us(results: list[dict[str, Any]]) -> float:
    return float(statistics.median(sum(r["cpu_us_per_task"].values()) for r in results))


def summarise_p1(
    runs: dict[str, list[dict[str, Any]]], n: int, publish: dict[str, float]
) -> dict[str, Any]:
    """Medians of each kind's runs (a noisy outlier moves a median least)."""
    bare = _median_rate(runs["noop"])
    export = _median_rate(runs["export"])
    reminder = _median_rate(runs["reminder"])
    rates = [r["tasks_per_s"] for r in runs["noop"]]
    bare_cpu = _median_cpu_us(runs["noop"])
    with_metrics: dict[str, Any] = {}
    if runs.get("export_metrics"):
        on = _median_rate(runs["export_metrics"])
        with_metrics = {
            # Issue 15: small exports with the worker's metrics on (multiprocess mode,
            # scraped every SCRAPE_EVERY_S) over the same exports with them off.
            "p1_metrics_cost": round(on / export, 3),
            "p1_export_metrics_tasks_per_s": round(on, 1),
            "p1_metrics_cpu_us": round(
                _median_cpu_us(runs["export_metrics"]) - _median_cpu_us(runs["export"])
            ),
        }
        # The direct figure under that noisy ratio: CPU the metrics take per task in the
        # pool child, over the child's time per small export (concurrency / throughput).
        child_us = metrics_cost.per_task_us()
        with_metrics["p1_metrics_us_per_task"] = round(child_us, 1)
        children = runs["export"][0]["concurrency"]
        with_metrics["p1_metrics_share"] = round(child_us * export / (children * 1e6), 5)
    if runs.get("export_tracing"):
        traced = _median_rate(runs["export_tracing"])
        with_metrics.update(
            {
                # Issue 39: small exports with the worker's traces on (a span each,
                # exported over OTLP/HTTP) over the same exports with them off.
                "p1_tracing_cost": round(traced / export, 3),
                "p1_export_tracing_tasks_per_s": round(traced, 1),
                "p1_tracing_cpu_us": round(
                    _median_cpu_us(runs["export_tracing"]) - _median_cpu_us(runs["export"])
                ),
            }
        )
    return {
        **with_metrics,
        # CPU per small export of every process (worker main + children, PostgreSQL, Redis)
        # over a bare task's, medians of the runs.
        "p1_overhead_cpu_us": round(_median_cpu_us(runs["export"]) - bare_cpu),
        "p1_reminder_overhead_cpu_us": round(_median_cpu_us(runs["reminder"]) - bare_cpu),
        "p1_bare_tasks_per_s": round(bare, 1),
        "p1_export_tasks_per_s": round(export, 1),
        "p1_reminder_tasks_per_s": round(reminder, 1),
        "p1_export_ratio": round(export / bare, 3),
        "p1_reminder_ratio": round(reminder / bare, 3),
        "p1_detail": {
            "tasks_per_run": n,
            "bare_spread": round(max(rates) / min(rates), 2),
            "runs": runs,
            "publish_s_last": {k: round(v, 2) for k, v in publish.items()},
        },
    }


def run_scaling(
    env: BenchEnv, n: int = 1500, processes: tuple[int, ...] = (1, 2, 4)
) -> dict[str, Any]:
    """Small exports with -c 1/2/4 (shape only: the machine has 2 cores)."""
    part = env.part("scaling")
    app = env.activate(part)
    refs = seed_world(part.engine)
    points = []
    for c in processes:
        create_exports(part.engine, refs, n)
        sent, _ = publish_ready(part, app)
        assert sent == n
        result = drain(env, part, f"scaling-c{c}", n, concurrency=c)
        points.append({"processes": c, "tasks_per_s": result["tasks_per_s"], "detail": result})
    return {"scaling": points}
