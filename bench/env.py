"""The bench's own world: a migrated template database cloned per part, a Redis key prefix
per part, real ``celery -A tasks`` subprocesses, and the measurements read back from them.

Everything created here is named ``tdbench<pid>_<hex>...`` (databases) or
``tdbench-<hex>-<part>`` (Redis keys), and :meth:`BenchEnv.close` drops / deletes it all.
The ``teamdesk`` demo database is never touched. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from harness import databases
from harness.processes import Proc, celery_argv, settings_env, worker_argv
from harness.waiting import wait_for
from teamdesk import config, db
from teamdesk.config import Settings

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
HOOKS_MODULE = "bench.worker_hooks"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _local_only(url: str) -> None:
    if "127.0.0.1" not in url and "localhost" not in url:
        raise SystemExit(f"bench: refusing a non-local service URL ({url.split('@')[-1]})")


@dataclass
class Part:
    """One bench part's database, key prefix and settings."""

    label: str
    db_name: str
    database_url: str
    prefix: str
    settings: Settings
    engine: sa.Engine
    app: Celery | None = None
    procs: list[Proc] = field(default_factory=list)


class BenchEnv:
    def __init__(self) -> None:
        _local_only(databases.ADMIN_URL)
        _local_only(REDIS_URL)
        self.run_id = f"tdbench{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.key_root = f"tdbench-{uuid.uuid4().hex[:8]}"
        self.workdir = Path(tempfile.mkdtemp(prefix="teamdesk-bench-"))
        self.redis = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        self.template: str | None = None
        self.db_names: list[str] = []
        self.parts: list[Part] = []
        self.extra_worker_args: list[str] = []  # bench.run --worker-arg (experiments only)

    # ---- databases, prefixes, settings -------------------------------------------------
    def ensure_template(self) -> str:
        if self.template is None:
            self.template = databases.create_template(self.run_id)
        return self.template

    def part(self, label: str, **overrides: Any) -> Part:
        """A fresh database (clone of the migrated template) and Redis prefix; the
        process-wide settings and engine point at them until the next part."""
        name, url = databases.clone_database(self.ensure_template(), self.run_id)
        self.db_names.append(name)
        prefix = f"{self.key_root}-{label}"
        settings = config.load_settings(
            {
                "DATABASE_URL": url,
                "REDIS_URL": REDIS_URL,
                "QUEUE_PREFIX": prefix,
                "WORKER_INSTANCE_ID": f"bench-{label}",
            }
        ).with_overrides(**overrides)
        part = Part(label, name, url, prefix, settings, db.make_engine(url))
        self.parts.append(part)
        self.activate(part)
        return part

    def activate(self, part: Part) -> Celery:
        from tasks.celery_app import create_app

        config.set_settings(part.settings)
        db.reset_engine()
        if part.app is None:
            part.app = create_app(part.settings)
        return part.app

    def close(self) -> None:
        for part in self.parts:
            for proc in part.procs:
                proc.kill()
            if part.app is not None:
                part.app.close()
            part.engine.dispose()
        db.reset_engine()
        config.set_settings(None)
        for name in self.db_names:
            with suppress(Exception):
                databases.drop_database(name)
        if self.template is not None:
            with suppress(Exception):
                databases.drop_database(self.template)
            with suppress(Exception):  # the template granted it (harness/databases.py)
                databases.drop_api_role()
        with suppress(Exception):
            keys = list(self.redis.scan_iter(match=f"{self.key_root}*", count=5000))
            for i in range(0, len(keys), 1000):
                self.redis.delete(*keys[i : i + 1000])
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- processes ---------------------------------------------------------------------
    def worker(
        self,
        part: Part,
        name: str,
        *,
        concurrency: int = 2,
        hooks: str | None = HOOKS_MODULE,
        stats: Path | None = None,
        **extra_env: Any,
    ) -> Proc:
        env_extra: dict[str, object] = dict(extra_env)
        if hooks:
            env_extra["TEAMDESK_TEST_HOOKS"] = hooks
        if stats is not None:
            stats.mkdir(parents=True, exist_ok=True)
            env_extra["BENCH_STATS_DIR"] = str(stats)
        env = settings_env(part.settings, **env_extra)
        argv = worker_argv(name, concurrency=concurrency) + self.extra_worker_args
        proc = Proc(name, argv, env, self.workdir).start()
        part.procs.append(proc)
        return proc

    def beat(self, part: Part, name: str | None = None, **extra_env: Any) -> Proc:
        """``celery -A tasks beat``: the dispatcher (leader lock, LISTEN, window, scans)."""
        proc = Proc(
            name or f"beat-{part.label}",
            celery_argv("beat"),
            settings_env(part.settings, **extra_env),
            self.workdir,
        ).start()
        part.procs.append(proc)
        return proc

    def stats_dir(self, label: str) -> Path:
        path = self.workdir / "stats" / label
        path.mkdir(parents=True, exist_ok=True)
        return path

    # ---- broker ------------------------------------------------------------------------
    def backlog(self, part: Part, queues: tuple[str, ...] = ("exports", "reminders")) -> int:
        """Messages still in the queues or delivered and not yet acknowledged."""
        with self.redis.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.llen(f"{part.prefix}:{queue}")
            pipe.hlen(f"{part.prefix}:unacked")
            return int(sum(pipe.execute()))


def stop(proc: Proc, timeout: float = 60) -> int:
    """Warm shutdown (SIGTERM) and wait; SIGKILL the group if it does not end."""
    if proc.popen is None or proc.popen.poll() is not None:
        return proc.popen.returncode if proc.popen else 0
    proc.send(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except Exception:
        proc.kill()
        return -9


def read_stats(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def wait_until(probe: Any, timeout: float, interval: float = 0.05, what: str = "") -> Any:
    """The tests' polling helper (a deadline, never an ordering)."""
    return wait_for(probe, timeout=timeout, interval=interval, what=f"bench: {what}")


# ---- CPU accounting from /proc (same host) ------------------------------------------------
def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def children(pid: int) -> list[int]:
    found: list[int] = []
    with suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
            found += [int(c) for c in text.split()]
    return found


def backend_pids(engine: sa.Engine, db_name: str) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"
            ),
            {"d": db_name},
        )
        return [int(r[0]) for r in rows]


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used (all cores, not idle/iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


@dataclass
class CpuSnapshot:
    """CPU seconds used so far: the worker's main process, its pool children, the
    PostgreSQL backends of the part's database (per pid) and the whole Redis server."""

    main: float
    children: float
    postgres: dict[int, float]
    redis: float
    machine: float
    at: float

    def minus(self, before: CpuSnapshot) -> dict[str, float]:
        ours = {
            "worker_main": self.main - before.main,
            "worker_children": self.children - before.children,
            "postgres": sum(v - before.postgres.get(pid, 0.0) for pid, v in self.postgres.items()),
            "redis": self.redis - before.redis,
        }
        return ours

    def foreign_cores(self, before: CpuSnapshot) -> float:
        """Cores busy with anything but this measurement (other users of the machine)."""
        ours = sum(self.minus(before).values())
        wall = max(self.at - before.at, 1e-6)
        return max(0.0, (self.machine - before.machine - ours) / wall)


def cpu_snapshot(env: BenchEnv, part: Part, worker: Proc) -> CpuSnapshot:
    kids = children(worker.pid)
    return CpuSnapshot(
        main=cpu_seconds(worker.pid),
        children=sum(cpu_seconds(c) for c in kids),
        postgres={p: cpu_seconds(p) for p in backend_pids(part.engine, part.db_name)},
        redis=redis_cpu(env.redis),
        machine=machine_busy_s(),
        at=time.monotonic(),
    )


@contextmanager
def timer() -> Iterator[list[float]]:
    box: list[float] = []
    started = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - started)
