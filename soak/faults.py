"""Faults at seeded random times: what each one does and how the cluster comes back.

Kinds (each appears equally often; the seed decides the order, the times, the target and
the details):

- ``kill``      SIGKILL a worker's whole process group (a lost host); restart it.
- ``term``      SIGTERM a worker's main process (a deploy); wait for its exit, restart it.
- ``stop``      SIGSTOP a worker (the whole group, or only its main process) for longer
                than ``HEARTBEAT_TTL_S``, sometimes longer than ``STALE_AFTER_S``; SIGCONT.
- ``poolkill``  SIGKILL of one pool process of a live worker while it runs a task (the OOM
                killer): its worker's main process must make that the run's failed
                attempt within about a second (soak/poolkill.py).
- ``pgkill``    ``pg_terminate_backend`` on the workers' PostgreSQL connections.
- ``redis``     SIGTERM or SIGKILL the soak's Redis master, then start it again (empty)
                on the same port, sooner than the sentinels would fail it over.
- ``flush``     FLUSHALL of the soak's Redis (an operator's mistake, a failover to an
                empty replica): messages, heartbeats and the leader lock go.
- ``squeeze``   Redis ``maxmemory`` a little above its use, ``volatile-lru``, for a few
                seconds: keys with a TTL are evicted, writes may be refused.
- ``failover``  SIGKILL of the Redis master under Sentinel: the replica is promoted; the old
                master's port comes back as its replica, in sync before the fault ends.
- ``skew``      a worker, or the dispatcher (beat), restarted under libfaketime 150 s ahead
                or behind; restarted on the real clock later.
- ``txfreeze``  SIGSTOP of the pool process inside a reminder's transaction (its team's
                advisory lock held) for longer than ``STALE_AFTER_S``; SIGCONT.
- ``longterm``  SIGTERM of the worker running a 52 s export (26 s short): the drain must finish it.
- ``pgrestart`` ``pg_ctl stop -m fast|immediate`` and start of the soak's own PostgreSQL.
- ``pgsqueeze`` every free connection of the soak's PostgreSQL held for longer than
                ``2 x HEARTBEAT_TTL_S``: open connections work on, new ones are refused.
- ``purge``     ``celery -A tasks purge -f -Q exports,reminders``: the waiting messages go,
                their runs must be published again within two scans.
- ``revoke``    ``celery -A tasks control revoke <id>-<run>`` (or ``control terminate
                SIGTERM``) of a run WAITING-published or RUNNING: it ends CANCELLED or
                COMPLETED, never stays WAITING or RUNNING.

soak/outages.py holds the Redis and PostgreSQL faults, soak/probes.py the three that work
with the hooks or faketime, soak/tools.py the two that use Celery's command line,
soak/poolkill.py the one that kills a pool process. A fault
that needs a worker takes one the cluster is not already faulting; its recovery runs in a
thread so the schedule keeps its times. Every signal and exit is also written to the
timeline (soak/timeline.py) that the lease invariants read.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field

from soak import outages, poolkill, probes, tools
from soak.chaos import FREE_WORKER_WAIT_S, KINDS, Chaos, Fault, Planned, Record
from soak.timeline import FROZEN, GROUP, MAIN_ONLY, Window


@dataclass
class Injector:
    chaos: Chaos
    records: list[Record] = field(default_factory=list)

    def run(self, schedule: list[Planned], stop: threading.Event) -> None:
        started = time.monotonic()
        for fault in schedule:
            delay = fault.at_s - (time.monotonic() - started)
            if delay > 0 and stop.wait(delay):
                return
            at_s = round(time.monotonic() - started, 1)
            rng = random.Random(self.chaos.rng.getrandbits(64))
            record = Record(at_s, fault.kind, fault.target, sign=fault.sign, rng=rng)
            self.records.append(record)
            self._inject(record)

    def _inject(self, record: Record) -> None:
        """Now; or, when the fault needs a worker and none is free (others are being
        faulted, drained or restarted), in a thread once one is: the schedule goes on."""
        if record.kind in WORKER_KINDS or record.target == "worker":
            name = self.chaos.free_worker(record.rng, 0.0)
            if name is None:
                self.chaos.later(self._inject_when_free, record)
                return
            record.target = name
        FAULTS[record.kind](self.chaos, record)

    def _inject_when_free(self, record: Record) -> None:
        started = time.monotonic()
        name = self.chaos.free_worker(record.rng, FREE_WORKER_WAIT_S)
        if name is None:
            record.detail = f"skipped: no worker free for {FREE_WORKER_WAIT_S:.0f}s"
            return
        record.target = name
        FAULTS[record.kind](self.chaos, record)
        record.detail += f" (waited {time.monotonic() - started:.1f}s for a free worker)"


# ---- worker faults ----------------------------------------------------------------------------
WORKER_KINDS = frozenset({"kill", "term", "stop"})


def _pid(chaos: Chaos, name: str) -> int:
    proc = chaos.cluster.members[name].proc
    assert proc is not None
    return proc.pid


def kill(chaos: Chaos, record: Record) -> None:
    name = record.target
    inc = chaos.cluster.kill(name, "kill")
    down_s = round(record.rng.uniform(0.2, 3.0), 1)
    record.detail = f"{inc.name} pid {inc.proc.pid}, group SIGKILL, restart after {down_s}s"
    chaos.later(_restart_after, chaos, name, down_s)


def _restart_after(chaos: Chaos, name: str, down_s: float) -> None:
    time.sleep(down_s)
    chaos.cluster.release(name, restart=True)


def term(chaos: Chaos, record: Record) -> None:
    name = record.target
    record.detail = f"pid {_pid(chaos, name)}, SIGTERM, restart after exit"
    chaos.later(_terminate_and_restart, chaos, name)


def _terminate_and_restart(chaos: Chaos, name: str) -> None:
    inc = chaos.cluster.terminate(name, "term")
    chaos.term_exit_codes.append(inc.exit_code)
    chaos.cluster.release(name, restart=True)


def stop(chaos: Chaos, record: Record) -> None:
    name = record.target
    pid = _pid(chaos, name)  # the process group's
    whole = record.rng.random() < 0.7
    ttl, stale = chaos.timings.heartbeat_ttl_s, chaos.timings.stale_after_s
    frozen_s = round(record.rng.uniform(ttl + 1.0, stale + 2.0), 1)
    inc = chaos.cluster.members[name].current
    assert inc is not None
    # Either way the member is frozen: its heartbeat is the main process's. The note says
    # whether its pool processes (which run the executions) were stopped too.
    window = chaos.timeline.open(inc.name, FROZEN, "stop", note=GROUP if whole else MAIN_ONLY)
    with suppress(ProcessLookupError):
        if whole:
            os.killpg(pid, signal.SIGSTOP)
        else:
            os.kill(inc.main_pid, signal.SIGSTOP)
    record.detail = f"pid {pid}, SIGSTOP {'group' if whole else 'main'} for {frozen_s}s"
    chaos.later(_continue_after, chaos, name, pid, frozen_s, window)


def _continue_after(chaos: Chaos, name: str, pid: int, frozen_s: float, window: Window) -> None:
    time.sleep(frozen_s)
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGCONT)
    chaos.timeline.close(window)
    chaos.cluster.release(name, restart=False)


FAULTS: dict[str, Fault] = {
    "kill": kill,
    "term": term,
    "stop": stop,
    "poolkill": poolkill.poolkill,
    "pgkill": outages.pgkill,
    "redis": outages.redis_restart,
    "flush": outages.flush,
    "squeeze": outages.squeeze,
    "failover": outages.failover,
    "skew": probes.skew,
    "txfreeze": probes.txfreeze,
    "longterm": probes.longterm,
    "pgrestart": outages.pgrestart,
    "pgsqueeze": outages.pgsqueeze,
    "purge": tools.purge,
    "revoke": tools.revoke,
}
assert set(FAULTS) == set(KINDS)
