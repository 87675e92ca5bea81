"""Faults at seeded random times: what each one does and how the cluster comes back.

Kinds (each appears about equally often; the seed decides the order, the times, the
target and the details):

- ``kill``   SIGKILL a worker's whole process group (a lost host); restart it.
- ``term``   SIGTERM a worker's main process (a deploy); wait for its exit, restart it.
- ``stop``   SIGSTOP a worker (the whole group, or only its main process) for longer than
             ``HEARTBEAT_TTL_S``, sometimes longer than ``STALE_AFTER_S``; then SIGCONT.
- ``pgkill`` ``pg_terminate_backend`` on the workers' PostgreSQL connections
             (``application_name = 'teamdesk-tasks'``; the soak's own are named otherwise),
             in 1-4 rounds: the ones running a statement, or a random share of all.
- ``redis``  SIGTERM or SIGKILL the soak's Redis, then start it again on the same port
             (it keeps nothing on disk: queued messages and markers are lost).

A fault that needs a worker takes one the cluster is not already faulting; its recovery
(restart, SIGCONT) runs in a thread so the schedule keeps its times.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from soak.cluster import STOP_TIMEOUT_S, Cluster, SoakRedis

KINDS = ("kill", "term", "stop", "pgkill", "redis")
WORKER_KINDS = frozenset({"kill", "term", "stop"})

WORKER_CONNECTIONS = sa.text("""
    SELECT pid, state FROM pg_stat_activity
     WHERE datname = current_database() AND application_name = 'teamdesk-tasks'
       AND pid <> pg_backend_pid()
""")
TERMINATE = sa.text("SELECT pg_terminate_backend(pid) FROM unnest(CAST(:pids AS int[])) AS pid")


@dataclass(frozen=True)
class Planned:
    at_s: float  # seconds after the chaos started
    kind: str


@dataclass
class Record:
    at_s: float
    kind: str
    target: str = ""
    detail: str = ""

    def line(self) -> str:
        return f"{self.at_s:7.1f}s {self.kind:6} {self.target:5} {self.detail}"


def plan(
    rng: random.Random, count: int, window_s: float, kinds_used: tuple[str, ...] = KINDS
) -> list[Planned]:
    """``count`` faults over ``window_s``: kinds in equal shares, shuffled; random times."""
    kinds = [kinds_used[i % len(kinds_used)] for i in range(count)]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.03, 0.97) * window_s for _ in range(count))
    return [Planned(at, kind) for at, kind in zip(times, kinds, strict=True)]


@dataclass
class Timings:
    heartbeat_ttl_s: float
    stale_after_s: float


@dataclass
class Injector:
    cluster: Cluster
    redis_server: SoakRedis
    engine: sa.Engine
    rng: random.Random
    timings: Timings
    records: list[Record] = field(default_factory=list)
    term_exit_codes: list[int | None] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _redis_lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, schedule: list[Planned], stop: threading.Event) -> None:
        started = time.monotonic()
        for fault in schedule:
            delay = fault.at_s - (time.monotonic() - started)
            if delay > 0 and stop.wait(delay):
                return
            record = Record(round(time.monotonic() - started, 1), fault.kind)
            self._inject(record, stop)
            self.records.append(record)

    def _inject(self, record: Record, stop: threading.Event) -> None:
        if record.kind in WORKER_KINDS:
            name = self._free_worker(stop)
            if name is None:
                record.detail = "skipped: no worker free"
                return
            record.target = name
            getattr(self, f"_{record.kind}")(name, record)
        elif record.kind == "pgkill":
            self._pgkill(record)
        else:
            self._redis(record)

    def _free_worker(self, stop: threading.Event) -> str | None:
        """A running worker no other fault holds (waits a little for one to come back)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not stop.is_set():
            names = self.cluster.worker_names
            for name in self.rng.sample(names, len(names)):
                if self.cluster.hold(name) is not None:
                    return name
            stop.wait(0.2)
        return None

    def _later(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---- worker faults ------------------------------------------------------------------
    def _pid(self, name: str) -> int:
        proc = self.cluster.members[name].proc
        assert proc is not None
        return proc.pid

    def _kill(self, name: str, record: Record) -> None:
        pid = self._pid(name)
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        down_s = round(self.rng.uniform(0.2, 3.0), 1)
        record.detail = f"pid {pid}, group SIGKILL, restart after {down_s}s"
        self._later(self._restart_after, name, down_s)

    def _restart_after(self, name: str, down_s: float) -> None:
        proc = self.cluster.members[name].proc
        assert proc is not None and proc.popen is not None
        with suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)
        time.sleep(down_s)
        self.cluster.release(name, restart=True)

    def _term(self, name: str, record: Record) -> None:
        pid = self._pid(name)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        record.detail = f"pid {pid}, SIGTERM, restart after exit"
        self._later(self._restart_after_exit, name)

    def _restart_after_exit(self, name: str) -> None:
        proc = self.cluster.members[name].proc
        assert proc is not None and proc.popen is not None
        try:
            code: int | None = proc.popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
            proc.kill()
        self.term_exit_codes.append(code)
        self.cluster.release(name, restart=True)

    def _stop(self, name: str, record: Record) -> None:
        pid = self._pid(name)
        whole = self.rng.random() < 0.7
        ttl, stale = self.timings.heartbeat_ttl_s, self.timings.stale_after_s
        frozen_s = round(self.rng.uniform(ttl + 1.0, stale + 2.0), 1)
        with suppress(ProcessLookupError):
            if whole:
                os.killpg(pid, signal.SIGSTOP)
            else:
                os.kill(pid, signal.SIGSTOP)
        record.detail = f"pid {pid}, SIGSTOP {'group' if whole else 'main'} for {frozen_s}s"
        self._later(self._continue_after, name, pid, frozen_s)

    def _continue_after(self, name: str, pid: int, frozen_s: float) -> None:
        time.sleep(frozen_s)
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)
        self.cluster.release(name, restart=False)

    # ---- PostgreSQL and Redis -------------------------------------------------------------
    def _pgkill(self, record: Record) -> None:
        """1-4 rounds 0.25 s apart; each ends either the connections running a statement
        (a claim, a progress write, a commit in flight) or a random share of them all."""
        rounds = self.rng.randint(1, 4)
        ended = []
        for n in range(rounds):
            if n:
                time.sleep(0.25)
            active_only = self.rng.random() < 0.5
            ended.append(self._terminate(active_only))
        record.detail = f"{rounds} rounds, terminated {ended} worker connections"

    def _terminate(self, active_only: bool) -> int:
        with self.engine.connect() as conn:
            rows = list(conn.execute(WORKER_CONNECTIONS))
            if active_only:
                chosen = [int(r.pid) for r in rows if r.state == "active"]
            else:
                pids = [int(r.pid) for r in rows]
                chosen = self.rng.sample(pids, self.rng.randint(1, len(pids))) if pids else []
            if chosen:
                conn.execute(TERMINATE, {"pids": chosen})
            conn.commit()
        return len(chosen)

    def _redis(self, record: Record) -> None:
        if not self._redis_lock.acquire(timeout=20):  # the previous restart first
            record.detail = "skipped: Redis is still restarting"
            return
        sig = signal.SIGKILL if self.rng.random() < 0.5 else signal.SIGTERM
        down_s = round(self.rng.uniform(0.0, 2.0), 1)
        self.redis_server.stop(sig)
        record.detail = f"{sig.name}, down {down_s}s, restart #{self.redis_server.starts}"
        self._later(self._redis_back, down_s)

    def _redis_back(self, down_s: float) -> None:
        try:
            time.sleep(down_s)
            self.redis_server.start()
        finally:
            self._redis_lock.release()

    def settle(self, timeout_s: float = 60.0) -> bool:
        """Wait for every recovery (restart, SIGCONT, Redis start) to finish."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
