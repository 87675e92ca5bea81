"""``make soak``: ``python -m soak.run [--seed N] [--tasks N] [--faults N] [--short] [--keep]``.

1. A fresh database (created and migrated from ``ledger/migrations``), a fresh key
   prefix, and a dedicated ``redis-server`` on a free 127.0.0.1 port.
2. The seeded world (soak/world.py) and one plan per task (soak/workload.py).
3. Three ``celery -A tasks worker -Q exports,reminders`` processes (prefork) and one
   ``celery -A tasks beat`` (the dispatcher), all configured through the configuration
   variables (docs/design.md, "Configuration")
   only.
4. During the chaos window: tasks are created at their planned times, the soak's users
   cancel and retry, and faults land at seeded random times (soak/faults.py).
5. Wait (bounded) until nothing is WAITING or RUNNING, then check from PostgreSQL alone
   (soak/checks.py) and print ``soak: N tasks, F faults, V violations``.

Exit status: 0 when there is no violation; 1 on a violation or a quiescence timeout;
2 when the soak itself could not run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import redis
import sqlalchemy as sa

from ledger.migrate import upgrade
from soak import checks, faults, hooks, workload
from soak import world as W
from soak.cluster import Cluster, SoakRedis
from soak.faults import KINDS as FAULT_KINDS
from soak.report import Report
from teamdesk.config import Settings
from teamdesk.db import make_engine
from tests.support import databases
from tests.support.processes import settings_env

HOOKS_MODULE = "soak.hooks"
SOAK_APPLICATION = "teamdesk-soak"  # the soak's own connections; pgkill spares them
WORKERS, CONCURRENCY = 3, 2
EXPORT_MAX_ROWS = 300  # below a whole export team (400 tickets): "too many rows" cases
EXPORT_PAUSE_S = 0.2  # per batch of 50 rows (soak/hooks.py): exports take 0.2-0.8 s
REMINDER_PAUSE_S = 0.05  # inside the reminder's transaction, after its side effects
SUBMIT_SHARE = 0.8  # tasks are created during the first 80 % of the chaos window
WORKER_START_TIMEOUT_S = 60.0

ACTIVE = sa.text("""
    SELECT id, status, run, attempts, recoveries, dispatched_at, updated_at, lease_holder
      FROM background_tasks WHERE status IN ('WAITING', 'RUNNING') ORDER BY updated_at
""")


@dataclass(frozen=True)
class Options:
    seed: int
    tasks: int
    faults: int
    fault_gap_s: float
    quiesce_timeout_s: float
    keep: bool
    short: bool
    kinds: tuple[str, ...] = FAULT_KINDS

    @property
    def window_s(self) -> float:
        return self.faults * self.fault_gap_s


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tasks", type=int, help="tasks to submit (default 2000; --short 200)")
    parser.add_argument("--faults", type=int, help="faults to inject (default 50; --short 10)")
    parser.add_argument("--short", action="store_true", help="the quick variant for make test")
    parser.add_argument("--keep", action="store_true", help="keep the database and the logs")
    parser.add_argument("--fault-gap", type=float, help="mean seconds between faults")
    parser.add_argument("--quiesce-timeout", type=float, help="seconds to wait for quiet")
    parser.add_argument(
        "--kinds",
        default=",".join(faults.KINDS),
        help=f"comma-separated fault kinds to inject (default: all of {','.join(faults.KINDS)})",
    )
    args = parser.parse_args(argv)
    short = bool(args.short)
    return Options(
        seed=args.seed,
        tasks=args.tasks or (200 if short else 2000),
        faults=args.faults if args.faults is not None else (12 if short else 50),
        fault_gap_s=args.fault_gap or 4.0,
        quiesce_timeout_s=args.quiesce_timeout or (60.0 if short else 180.0),
        keep=bool(args.keep),
        short=short,
        kinds=_kinds(parser, args.kinds),
    )


def _kinds(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = set(kinds) - set(faults.KINDS)
    if unknown or not kinds:
        parser.error(f"--kinds: choose from {','.join(faults.KINDS)}")
    return kinds


def soak_settings(database_url: str, redis_url: str, prefix: str) -> Settings:
    """Shortened timings, through configuration variables only (see soak/README.md for why)."""
    return Settings(
        database_url=database_url,
        redis_url=redis_url,
        broker_url=redis_url,
        queue_prefix=prefix,
        log_level="info",
        worker_instance_id="soak",
        max_task_attempts=3,
        retry_base_delay_s=1.0,  # attempts >= 1 s apart: one pgkill burst (< 1 s) hits one
        stale_after_s=6.0,
        scan_interval_s=1.0,
        heartbeat_ttl_s=3.0,
        max_recoveries=10,
        export_max_rows=EXPORT_MAX_ROWS,
        export_batch_size=50,
        shutdown_timeout_s=5.0,
    )


class Soak:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"teamdesk-soak-{opts.seed}-"))
        self.run_id = f"soak_{opts.seed}_{uuid.uuid4().hex[:8]}"
        self.db_name: str | None = None
        self.database_url = ""
        self.settings = Settings()
        self.engine: sa.Engine | None = None
        self.redis: SoakRedis | None = None
        self.cluster: Cluster | None = None
        self.out: list[str] = []

    def say(self, line: str) -> None:
        self.out.append(line)
        print(line, flush=True)

    # ---- setup -------------------------------------------------------------------------
    def database(self) -> sa.Engine:
        self.db_name, url = databases.empty_database(self.run_id)
        self.database_url = url
        upgrade(url)
        self.engine = make_engine(
            url, connect_args={"connect_timeout": 5, "application_name": SOAK_APPLICATION}
        )
        with self.engine.begin() as conn:
            conn.execute(workload.CREATE_MARKS)
        return self.engine

    def start_cluster(self, settings: Settings) -> Cluster:
        env = settings_env(
            settings,
            TEAMDESK_TEST_HOOKS=HOOKS_MODULE,
            **{hooks.EXPORT_PAUSE_ENV: EXPORT_PAUSE_S, hooks.REMINDER_PAUSE_ENV: REMINDER_PAUSE_S},
        )
        logdir = self.workdir / "logs"
        logdir.mkdir()
        self.cluster = Cluster(env, logdir, WORKERS, CONCURRENCY)
        self.cluster.start_all()
        for name in self.cluster.worker_names:
            proc = self.cluster.members[name].proc
            assert proc is not None
            proc.wait_event("worker.started", timeout=WORKER_START_TIMEOUT_S)
        return self.cluster

    # ---- the run -----------------------------------------------------------------------
    def run(self) -> int:
        started = time.monotonic()
        world, plans, tickets_before = self.prepare()
        cluster = self.start_cluster(self.settings)
        injector, operator, settled = self.chaos(plans)
        chaos_done = time.monotonic()
        quiet, waited = self.quiesce(operator)
        operator.stop.set()
        verifier = checks.Verifier(
            self.engine_(),
            plans,
            [t.id for t in world.reminder_teams],
            self.settings.max_task_attempts,
        )
        found = verifier.run(tickets_before, [t.id for t in world.export_teams])
        self.say(f"soak: final stop exit codes {cluster.stop_all()}")
        report = Report(self.say, self.workdir, self.engine_(), cluster)
        report.counts(plans, injector, operator)
        unprinted = report.violations(found, verifier)
        self.say(
            f"soak: chaos {chaos_done - started:.0f} s, quiet after {waited:.0f} s more, "
            f"total {time.monotonic() - started:.0f} s"
        )
        if not quiet:
            self.say(f"soak: TIMEOUT: still not quiet after {self.opts.quiesce_timeout_s:.0f} s")
        if not settled:
            self.say("soak: TIMEOUT: a fault's recovery (restart, SIGCONT, Redis) did not finish")
        created = sum(1 for p in plans if p.task_id is not None)
        injected = sum(1 for r in injector.records if not r.detail.startswith("skipped"))
        self.say(f"soak: {created} tasks, {injected} faults, {len(found)} violations")
        (self.workdir / "report.txt").write_text("\n".join([*self.out, *unprinted]) + "\n")
        return 1 if found or not quiet or not settled else 0

    def engine_(self) -> sa.Engine:
        assert self.engine is not None
        return self.engine

    def prepare(self) -> tuple[W.World, list[workload.TaskPlan], tuple[int, str]]:
        """Database, world, plans and Redis; returns the exported tickets' checksum too."""
        opts = self.opts
        engine = self.database()
        world, plans = workload.build(
            self.rng, opts.tasks, opts.window_s * SUBMIT_SHARE, EXPORT_MAX_ROWS
        )
        with engine.begin() as conn:
            W.insert(conn, world)
        tickets_before = checks.fingerprint(engine, [t.id for t in world.export_teams])
        self.redis = SoakRedis(self.workdir)
        self.redis.start()
        self.settings = soak_settings(self.database_url, self.redis.url, self.run_id)
        self.say(
            f"soak: seed {opts.seed}, {opts.tasks} tasks, {opts.faults} faults over "
            f"{opts.window_s:.0f} s; database {self.db_name}, redis port {self.redis.port}, "
            f"logs {self.workdir}"
        )
        return world, plans, tickets_before

    def chaos(
        self, plans: list[workload.TaskPlan]
    ) -> tuple[faults.Injector, workload.Operator, bool]:
        """Submit the tasks and inject the faults; the users keep acting until stopped.
        Returns once every fault's recovery finished (or its bound passed: False)."""
        assert self.cluster is not None and self.redis is not None
        engine, settings = self.engine_(), self.settings
        schedule = faults.plan(self.rng, self.opts.faults, self.opts.window_s, self.opts.kinds)
        timings = faults.Timings(settings.heartbeat_ttl_s, settings.stale_after_s)
        injector = faults.Injector(self.cluster, self.redis, engine, self.rng, timings)
        submitter = workload.Submitter(engine, plans)
        operator = workload.Operator(engine, plans)
        stop = threading.Event()
        threads = [
            threading.Thread(target=submitter.run, args=(stop,), daemon=True),
            threading.Thread(target=injector.run, args=(schedule, stop), daemon=True),
        ]
        threading.Thread(target=operator.run, daemon=True).start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return injector, operator, injector.settle()

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
                        f"{self.queue_state(row.id, row.run)}"
                    )
                return False, time.monotonic() - started
            time.sleep(0.5)

    def queue_state(self, task_id: uuid.UUID, run: int) -> str:
        """Diagnosis only (the verdict reads PostgreSQL alone): the run's queued marker and
        its message's result state in the soak's Redis."""
        assert self.redis is not None
        message = f"{task_id}-{run}"
        prefix = self.run_id
        client = redis.Redis.from_url(self.redis.url, socket_timeout=2, decode_responses=True)
        try:
            marker = bool(client.exists(f"{prefix}:queued:{message}"))
            meta = client.get(f"{prefix}:celery-task-meta-{message}")
        except redis.RedisError as exc:
            return f"Redis unreadable ({type(exc).__name__})"
        finally:
            client.close()
        state = json.loads(meta).get("status") if meta else None
        return f"queued marker {'present' if marker else 'absent'}, message state {state}"

    def close(self, passed: bool) -> None:
        if self.cluster is not None:
            self.cluster.kill_all()
        if self.redis is not None:
            self.redis.stop()
        if self.engine is not None:
            self.engine.dispose()
        if self.db_name is not None and not self.opts.keep:
            with suppress(Exception):
                databases.drop_database(self.db_name)
        if passed and not self.opts.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.db_name is not None:
            kept = f"database {self.db_name} kept, " if self.opts.keep else ""
            print(f"soak: {kept}logs kept in {self.workdir}", flush=True)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    # SIGTERM (a CI timeout) cleans up like Ctrl-C: every process, the Redis, the database.
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
