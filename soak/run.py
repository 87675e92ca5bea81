"""``make soak``: ``python -m soak.run [--seed N] [--tasks N] [--faults N] [--short] [--keep]``.

1. Its own PostgreSQL server (initdb, a free port, soak/postgres.py) with a fresh database
   migrated from ``ledger/migrations`` (plus the soak's own ``soak_marks`` and, filled by a
   trigger, ``soak_takeovers``: soak/leases.py), a fresh key prefix, and its own Redis
   under Sentinel (a master, a replica, three sentinels on free 127.0.0.1 ports:
   soak/sentinel.py).
2. The seeded world (soak/world.py), one plan per task (soak/workload.py) and the fault
   schedule (soak/chaos.py).
3. Three ``celery -A tasks worker -Q exports,reminders`` processes (prefork) and one
   ``celery -A tasks beat`` (the dispatcher), all configured through the configuration
   variables (docs/design.md, "Configuration") only.
4. During the chaos window: tasks are created at their planned times, the soak's users
   cancel and retry, and faults land at seeded random times (soak/faults.py).
   Two of the fault kinds are Celery's own command line (``purge``, ``revoke``:
   soak/tools.py); one kills a pool process under a live worker (``poolkill``:
   soak/poolkill.py).
5. Wait (bounded) until nothing is WAITING or RUNNING, then check from PostgreSQL, the
   timeline of faults and the workers' logs (soak/checks.py, soak/leases.py) and print
   ``soak: N tasks, F faults, V violations``.

Exit status: 0 when there is no violation; 1 on a violation or a quiescence timeout;
2 when the soak itself could not run.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import redis
import sqlalchemy as sa

from harness.processes import settings_env
from ledger.migrate import upgrade
from soak import beacons, checks, hooks, logscan, tools, workload
from soak import world as W
from soak.chaos import Chaos, Planned, Timings, plan
from soak.cluster import Cluster
from soak.faults import Injector
from soak.gate import DbGate
from soak.leases import RECORD_TAKEOVERS, LeaseJudge
from soak.options import (
    EXPORT_BATCH_SIZE,
    EXPORT_MAX_ROWS,
    SENTINEL_DOWN_AFTER_MS,
    SENTINEL_MASTER,
    Options,
    parse,
    soak_settings,
)
from soak.postgres import SoakPostgres
from soak.report import Report
from soak.sentinel import SentinelGroup
from soak.timeline import Timeline
from teamdesk.config import Settings
from teamdesk.db import make_engine

HOOKS_MODULE = "soak.hooks"
SOAK_APPLICATION = "teamdesk-soak"  # the soak's own connections; pgkill spares them
WORKERS, CONCURRENCY = 3, 2
EXPORT_PAUSE_S = 0.06  # per batch of 12 rows (soak/hooks.py): exports take 0.1-1 s
REMINDER_PAUSE_S = 0.05  # inside the reminder's transaction, after its side effects
SUBMIT_SHARE = 0.8  # tasks are created during the first 80 % of the chaos window
WORKER_START_TIMEOUT_S = 60.0
# A longterm fault: its export starts (up to options.TASK_WAIT_S), runs and drains (< 1 min)
SETTLE_TIMEOUT_S = 240.0

ACTIVE = sa.text("""
    SELECT id, status, run, attempts, recoveries, dispatched_at, updated_at, lease_holder
      FROM background_tasks WHERE status IN ('WAITING', 'RUNNING') ORDER BY updated_at
""")


@dataclass
class Prepared:
    world: W.World
    plans: list[workload.TaskPlan]
    schedule: list[Planned]
    tickets_before: tuple[int, str]


class Soak:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"teamdesk-soak-{opts.seed}-"))
        self.run_id = f"soak_{opts.seed}_{uuid.uuid4().hex[:8]}"
        self.postgres: SoakPostgres | None = None
        self.settings = Settings()
        self.engine: sa.Engine | None = None
        self.redis: SentinelGroup | None = None
        self.cluster: Cluster | None = None
        self.timeline = Timeline()
        self.gate = DbGate()
        self.out: list[str] = []

    def say(self, line: str) -> None:
        self.out.append(line)
        print(line, flush=True)

    # ---- setup -------------------------------------------------------------------------
    def database(self) -> sa.Engine:
        """Its own PostgreSQL server, a fresh database in it, migrated, plus soak_marks."""
        self.postgres = SoakPostgres(self.workdir)
        self.postgres.create()
        url = self.postgres.create_database(self.run_id)
        upgrade(url)
        self.engine = make_engine(
            url, connect_args={"connect_timeout": 5, "application_name": SOAK_APPLICATION}
        )
        with self.engine.begin() as conn:
            conn.execute(workload.CREATE_MARKS)
            for statement in RECORD_TAKEOVERS:
                conn.execute(statement)
        self.timeline.measure(self.engine)
        return self.engine

    def start_cluster(self, settings: Settings) -> Cluster:
        beacon_dir = self.workdir / "beacons"
        beacon_dir.mkdir()
        env = settings_env(
            settings,
            TEAMDESK_TEST_HOOKS=HOOKS_MODULE,
            **{
                hooks.EXPORT_PAUSE_ENV: EXPORT_PAUSE_S,
                hooks.REMINDER_PAUSE_ENV: REMINDER_PAUSE_S,
                hooks.LONG_EXPORT_ENV: self.opts.long_export_s,
                beacons.BEACON_DIR_ENV: beacon_dir,
            },
        )
        logdir = self.workdir / "logs"
        logdir.mkdir()
        self.cluster = Cluster(env, logdir, WORKERS, CONCURRENCY, self.timeline)
        self.cluster.start_all()
        for name in self.cluster.worker_names:
            proc = self.cluster.members[name].proc
            assert proc is not None
            proc.wait_event("worker.started", timeout=WORKER_START_TIMEOUT_S)
        return self.cluster

    # ---- the run -----------------------------------------------------------------------
    def run(self) -> int:
        started = time.monotonic()
        prepared = self.prepare()
        cluster = self.start_cluster(self.settings)
        injector, chaos, operator, settled = self.chaos(prepared)
        chaos_done = time.monotonic()
        quiet, waited = self.quiesce(operator)
        operator.stop.set()
        self.say(f"soak: final stop exit codes {cluster.stop_all()}")
        verifier = self.verify(prepared, chaos)
        report = Report(self.say, self.workdir, self.engine_(), cluster)
        report.counts(prepared.plans, injector.records, chaos, operator)
        report.leases(verifier)
        report.tools(verifier)
        report.pool_kills(verifier)
        unprinted = report.violations(verifier.violations, verifier)
        self.say(
            f"soak: chaos {chaos_done - started:.0f} s, quiet after {waited:.0f} s more, "
            f"total {time.monotonic() - started:.0f} s"
        )
        if not quiet:
            self.say(f"soak: TIMEOUT: still not quiet after {self.opts.quiesce_timeout_s:.0f} s")
        if not settled:
            self.say("soak: TIMEOUT: a fault's recovery (restart, SIGCONT, Redis) did not finish")
        for failure in chaos.unrecovered:
            self.say(f"soak: NOT RECOVERED: {failure}")
        found = verifier.violations
        created = sum(1 for p in prepared.plans if p.task_id is not None)
        injected = sum(1 for r in injector.records if r.injected)
        self.say(f"soak: {created} tasks, {injected} faults, {len(found)} violations")
        (self.workdir / "report.txt").write_text("\n".join([*self.out, *unprinted]) + "\n")
        return 1 if found or not quiet or not settled or chaos.unrecovered else 0

    def verify(self, prepared: Prepared, chaos: Chaos) -> checks.Verifier:
        assert self.cluster is not None
        incarnations = self.cluster.incarnations()
        logs = logscan.scan(incarnations, self.timeline.offset_s)
        grace_s = self.settings.heartbeat_ttl_s + self.settings.scan_interval_s
        verifier = checks.Verifier(
            self.engine_(),
            prepared.plans,
            [t.id for t in prepared.world.reminder_teams],
            self.settings.max_task_attempts,
            LeaseJudge(logs, self.timeline, grace_s, self.settings.stale_after_s),
            chaos.revokes,
            chaos.purges,
            chaos.pool_kills,
        )
        verifier.run(
            prepared.tickets_before, [t.id for t in prepared.world.export_teams], incarnations
        )
        return verifier

    def engine_(self) -> sa.Engine:
        assert self.engine is not None
        return self.engine

    def prepare(self) -> Prepared:
        """Database, schedule, world, plans and Redis; the exported tickets' checksum too."""
        opts = self.opts
        engine = self.database()
        schedule = plan(self.rng, opts.faults, opts.window_s, opts.kinds)
        kinds = Counter(p.kind for p in schedule)
        sizes = workload.Sizes(
            opts.tasks,
            long=kinds["longterm"],
            frozen=kinds["txfreeze"],
            spare=kinds["revoke"] + kinds["poolkill"],
            max_rows=EXPORT_MAX_ROWS,
            batch_size=EXPORT_BATCH_SIZE,
        )
        world, plans = workload.build(self.rng, sizes, opts.window_s * SUBMIT_SHARE)
        with engine.begin() as conn:
            W.insert(conn, world)
        tickets_before = checks.fingerprint(engine, [t.id for t in world.export_teams])
        self.redis = SentinelGroup(self.workdir / "redis", SENTINEL_MASTER, SENTINEL_DOWN_AFTER_MS)
        self.redis.start()
        assert self.postgres is not None
        self.settings = soak_settings(self.postgres.url(self.run_id), self.redis.url(), self.run_id)
        ports = ",".join(str(port) for port in self.redis.sentinel_ports)
        self.say(
            f"soak: seed {opts.seed}, {opts.tasks} tasks, {opts.faults} faults over "
            f"{opts.window_s:.0f} s; database {self.run_id} on its own PostgreSQL (port "
            f"{self.postgres.port}), Redis master port {self.redis.master_port}, replica "
            f"{self.redis.replica_port}, sentinels {ports}; logs {self.workdir}"
        )
        return Prepared(world, plans, schedule, tickets_before)

    def chaos(self, prepared: Prepared) -> tuple[Injector, Chaos, workload.Operator, bool]:
        """Submit the tasks and inject the faults; the users keep acting until stopped.
        Returns once every fault's recovery finished (or its bound passed: False)."""
        assert self.cluster is not None and self.redis is not None and self.postgres is not None
        engine, settings = self.engine_(), self.settings
        chaos = Chaos(
            self.cluster,
            self.redis,
            self.postgres,
            engine,
            self.gate,
            self.timeline,
            self.rng,
            Timings(
                settings.heartbeat_ttl_s,
                settings.stale_after_s,
                self.opts.task_wait_s,
                settings.max_task_attempts,
                settings.retry_base_delay_s,
            ),
            self.workdir / "beacons",
        )
        chaos.plans = prepared.plans
        for case in workload.FAULT_CASES:
            chaos.supply[case] = [p for p in prepared.plans if p.case == case]
        injector = Injector(chaos)
        submitter = workload.Submitter(engine, self.gate, prepared.plans)
        operator = workload.Operator(engine, self.gate, prepared.plans)
        stop = threading.Event()
        threads = [
            threading.Thread(target=submitter.run, args=(stop,), daemon=True),
            threading.Thread(target=injector.run, args=(prepared.schedule, stop), daemon=True),
        ]
        threading.Thread(target=operator.run, daemon=True).start()
        self.timeline.origin = self.timeline.now()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return injector, chaos, operator, chaos.settle(SETTLE_TIMEOUT_S)

    def quiesce(self, operator: workload.Operator) -> tuple[bool, float]:
        """Wait until no task is WAITING or RUNNING and the users have nothing left to do."""
        started = time.monotonic()
        while True:
            with self.engine_().connect() as conn:
                active = list(conn.execute(ACTIVE))
            if not active and operator.pending() == 0:
                return True, time.monotonic() - started
            if time.monotonic() - started > self.opts.quiesce_timeout_s:
                pending = operator.pending()
                self.say(f"soak: {len(active)} tasks still active, {pending} user actions pending:")
                for row in active[:20]:
                    self.say(
                        f"  {row.id} {row.status} run {row.run} attempts {row.attempts} "
                        f"recoveries {row.recoveries} dispatched_at {row.dispatched_at} "
                        f"updated_at {row.updated_at} holder {row.lease_holder}; "
                        f"{self.queue_state(row.id, row.run, row.dispatched_at)}"
                    )
                return False, time.monotonic() - started
            time.sleep(0.5)

    def queue_state(self, task_id: uuid.UUID, run: int, stamp: datetime | None) -> str:
        """Diagnosis only (the verdict reads PostgreSQL alone): whether the broker holds the
        run's message - waiting in a task queue's list, or taken by a worker and not yet
        acknowledged (kombu's unacked hash) - and whether that is the publish its row
        carries (``stamp``, its ``dispatched_at``); and the message's result state, in the
        soak's Redis. The dispatcher publishes a WAITING run again once two of its looks a
        scan apart miss the message of the row's publish (tasks/broker_view.py)."""
        assert self.redis is not None
        message = f"{task_id}-{run}"
        prefix = self.run_id
        client = self.redis.client(2.0)
        try:
            held = tools.held_messages(client, prefix, task_id, run)
            meta = client.get(f"{prefix}:celery-task-meta-{message}")
        except redis.RedisError as exc:
            return f"Redis unreadable ({type(exc).__name__})"
        finally:
            client.close()
        state = json.loads(meta).get("status") if meta else None
        where = ", ".join(
            f"{place} ({'this publish' if at == stamp else f'stamp {at.isoformat()}'})"
            for place, at in held
        )
        return f"broker holds its message: {where or 'no'}; message state {state}"

    def close(self, passed: bool) -> None:
        if self.cluster is not None:
            self.cluster.kill_all()
        if self.redis is not None:
            self.redis.stop()
        if self.engine is not None:
            self.engine.dispose()
        if self.postgres is not None:
            if self.opts.keep:
                self.postgres.stop("fast")
            else:
                self.postgres.destroy()
        if passed and not self.opts.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            return
        kept = ""
        if self.opts.keep and self.postgres is not None:
            kept = f"PostgreSQL data kept in {self.postgres.data} (port {self.postgres.port}), "
        print(f"soak: {kept}logs kept in {self.workdir}", flush=True)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv, (__doc__ or "").split("\n")[0])
    # SIGTERM (a CI timeout) cleans up like Ctrl-C: every process, Redis, PostgreSQL.
    signal.signal(signal.SIGTERM, _interrupt)
    soak = Soak(opts)
    code = 2
    try:
        code = soak.run()
    except KeyboardInterrupt:
        print("soak: interrupted", flush=True)
        code = 2
    finally:
        soak.close(passed=code == 0)
    return code


if __name__ == "__main__":
    sys.exit(main())
