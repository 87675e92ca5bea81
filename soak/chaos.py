"""What every fault works with: the schedule, its records and the cluster it acts on
(soak/faults.py lists the kinds; soak/outages.py, soak/probes.py, soak/tools.py and
soak/poolkill.py hold the Redis, PostgreSQL, hook, faketime, Celery-command-line and
pool-process faults). The soak's Redis is
a Sentinel group (soak/sentinel.py): every Redis fault acts on its current master."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from soak.cluster import Cluster
from soak.gate import DbGate
from soak.postgres import SoakPostgres
from soak.sentinel import SentinelGroup
from soak.timeline import Timeline
from soak.workload import TaskPlan

KINDS = (
    "kill",
    "term",
    "stop",
    "poolkill",
    "pgkill",
    "redis",
    "flush",
    "squeeze",
    "failover",
    "skew",
    "txfreeze",
    "longterm",
    "pgrestart",
    "pgsqueeze",
    "purge",
    "revoke",
)
FREE_WORKER_WAIT_S = 45.0  # a deferred worker fault waits this long for a free worker
SKEW_S = 150  # faketime's offset, either way
# A database fault waits at most this long for a long export's drain to go on unhurt
# (Chaos.shield): long enough to show the drain keeps its lease, short enough that the
# database faults still land through the whole window.
SHIELD_MAX_WAIT_S = 30.0


@dataclass(frozen=True)
class Planned:
    at_s: float  # seconds after the chaos started
    kind: str
    target: str = ""  # skew: "worker" or "beat"
    sign: int = 1  # skew: ahead (+1) or behind (-1)


@dataclass
class Record:
    at_s: float
    kind: str
    target: str = ""
    detail: str = ""
    sign: int = 1  # skew: ahead (+1) or behind (-1)
    # The fault's own random numbers, seeded by the schedule's: a fault that runs later in
    # a thread (waiting for a free worker) still draws the same details for a seed.
    rng: random.Random = field(default_factory=random.Random, repr=False)

    @property
    def injected(self) -> bool:
        return not self.detail.startswith("skipped")

    def line(self) -> str:
        return f"{self.at_s:7.1f}s {self.kind:9} {self.target:5} {self.detail}"


def plan(
    rng: random.Random, count: int, window_s: float, kinds_used: tuple[str, ...] = KINDS
) -> list[Planned]:
    """``count`` faults over ``window_s``: kinds in equal shares, shuffled; random times.
    Skews alternate between a worker and the dispatcher."""
    kinds = [kinds_used[i % len(kinds_used)] for i in range(count)]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.03, 0.97) * window_s for _ in range(count))
    planned, skews = [], 0
    for at, kind in zip(times, kinds, strict=True):
        target, sign = "", 1
        if kind == "skew":
            target, skews = ("worker", "beat")[skews % 2], skews + 1
            sign = rng.choice((1, -1))
        planned.append(Planned(at, kind, target, sign))
    return planned


@dataclass
class Revoke:
    """A ``revoke`` fault's command (soak/tools.py): the run it named, as the ledger showed
    it just before, and when the command was started (the database's clock). Recorded
    before the command runs: a command that failed may still have reached a worker."""

    task_id: uuid.UUID
    run: int
    status: str  # WAITING (published) or RUNNING when it was picked
    terminate: bool  # ``control terminate SIGTERM`` (revoke with terminate) or ``revoke``
    issued_at: float
    command: str = ""  # what the command line answered (replies, or its failure)


@dataclass
class Purge:
    """A ``purge`` fault (soak/tools.py): the runs whose message was waiting in the queues
    just before ``celery purge``, with the publish's stamp, and how soon each was going
    again after it (re-published with a new stamp, claimed, or ended: seconds after the
    purge, or after the first claim that followed it when no worker consumed until then;
    the database's clock; None when it was not within the watch)."""

    at: float  # the command's start, database clock
    purged: int | None = None  # as the command line said ("Purged N messages")
    runs: dict[tuple[uuid.UUID, int], datetime] = field(default_factory=dict)
    resumed_s: dict[tuple[uuid.UUID, int], float | None] = field(default_factory=dict)
    resumed_at: dict[tuple[uuid.UUID, int], float] = field(default_factory=dict)  # db clock


@dataclass
class PoolKill:
    """A ``poolkill`` fault (soak/poolkill.py): the pool process it SIGKILLed, the execution
    that process ran (the ledger showed it holding the run, the process stopped, just
    before the kill) and what the soak saw after it. The checks judge it from the workers'
    logs and the audit trail (soak/checks.py)."""

    task_id: uuid.UUID
    run: int
    case: str
    execution: str  # the killed execution's id (the row's execution_id at the kill)
    attempt: int  # the row's attempts at the kill: the attempt that was lost
    process: str  # the worker's incarnation ("w2.3")
    pid: int  # the pool process killed
    main_pid: int  # its worker's main process, which must report the loss
    at: float  # the SIGKILL, database clock
    seen: str = ""  # what the fault saw of the report (for faults.txt)
    # The row right after the report, when it had not moved on yet: what differed from
    # the lost-process rule (last_error, backoff), or None.
    row_problem: str | None = None


@dataclass
class Timings:
    heartbeat_ttl_s: float
    stale_after_s: float
    task_wait_s: float = 120.0  # a fault's own task, to reach its hook point (options.py)
    max_attempts: int = 3  # MAX_TASK_ATTEMPTS
    retry_base_delay_s: float = 1.0  # RETRY_BASE_DELAY_S


@dataclass
class Chaos:
    """Everything a fault acts on, and the threads that bring things back."""

    cluster: Cluster
    redis_server: SentinelGroup
    postgres: SoakPostgres
    engine: sa.Engine
    gate: DbGate
    timeline: Timeline
    rng: random.Random
    timings: Timings
    beacon_dir: Path
    plans: list[TaskPlan] = field(default_factory=list)  # every task's plan
    supply: dict[str, list[TaskPlan]] = field(default_factory=dict)
    term_exit_codes: list[int | None] = field(default_factory=list)
    revokes: list[Revoke] = field(default_factory=list)
    # Runs a revoke fault picked (before its command is recorded in ``revokes``): two
    # revoke faults that pick at once never pick the same run, and ``poolkill`` leaves
    # them alone.
    revoke_picked: set[uuid.UUID] = field(default_factory=set)
    revoke_lock: threading.Lock = field(default_factory=threading.Lock)
    purges: list[Purge] = field(default_factory=list)
    pool_kills: list[PoolKill] = field(default_factory=list)
    # A service the soak could not bring back whole (a Redis group that did not re-form):
    # the run fails as an unfinished recovery.
    unrecovered: list[str] = field(default_factory=list)
    redis_lock: threading.Lock = field(default_factory=threading.Lock)
    pg_lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _shields: int = 0
    _shield_change: threading.Condition = field(default_factory=threading.Condition)

    @contextmanager
    def shield(self) -> Iterator[None]:
        """A long export runs and drains: database faults hold back (up to a bound).
        Without it nearly every >= 50 s export would be cut by a pgkill or a pgrestart
        (one every 20 s or so), and the drain would end early without having been
        tested."""
        with self._shield_change:
            self._shields += 1
        try:
            yield
        finally:
            with self._shield_change:
                self._shields -= 1
                self._shield_change.notify_all()

    def unshielded(self) -> float:
        """Wait (at most SHIELD_MAX_WAIT_S) until no long export is shielded; seconds waited."""
        started = time.monotonic()
        with self._shield_change:
            self._shield_change.wait_for(lambda: self._shields == 0, timeout=SHIELD_MAX_WAIT_S)
        return time.monotonic() - started

    def later(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def free_worker(self, rng: random.Random, wait_s: float) -> str | None:
        """A running worker no other fault holds, taken for a fault (waits up to
        ``wait_s`` for one to come back)."""
        deadline = time.monotonic() + wait_s
        order = rng.sample(self.cluster.worker_names, len(self.cluster.worker_names))
        while True:
            for name in order:
                if self.cluster.hold(name) is not None:
                    return name
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def settle(self, timeout_s: float) -> bool:
        """Wait for every recovery (restart, SIGCONT, Redis, PostgreSQL) to finish."""
        deadline = time.monotonic() + timeout_s
        while True:  # a recovery may start another (a deferred fault, then its restart)
            alive = [t for t in list(self._threads) if t.is_alive()]
            remaining = deadline - time.monotonic()
            if not alive or remaining <= 0:
                return not alive
            alive[0].join(timeout=min(1.0, remaining))


Fault = Callable[[Chaos, Record], None]
