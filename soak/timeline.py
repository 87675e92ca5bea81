"""What the soak did to each process and when, on the database's clock.

The lease invariant (soak/leases.py) asks, for every revocation in the audit trail, whether
the execution's holder was alive and running at that moment. The soak is the only one who
knows: it sends every SIGKILL, SIGSTOP and SIGTERM and watches every exit. Each of those
opens a *window* on the process it hit:

- ``dead``      from a SIGKILL (of a worker, or of one pool child: ``poolkill``), a cold
                shutdown or an exit on; never closes;
- ``frozen``    SIGSTOP .. SIGCONT (a whole worker, its main process only, or one pool child
                inside a reminder transaction, or the pool child ``poolkill`` checks);
- ``draining``  SIGTERM .. exit: the process is alive and its leases must stay alive.

Processes are named by incarnation (``w2.3``: the third start of worker w2); a window on
one pool child also names the child's pid (``w2.3/4711``). A ``stop`` window on a worker
notes whether the whole process group was stopped (``group``: its pool processes too) or
its main process only (``main``: its pool processes went on running their executions).

The ``poolkill`` fault SIGKILLs one pool child of a live worker: a ``dead`` window on
``w2.3/4711`` from the kill on (after a ``frozen`` moment of a few milliseconds: it stops
the child before it checks that the child still runs the execution it aims at).

One death the soak does not cause itself: ``celery control terminate`` (the ``revoke``
fault) makes the worker kill the pool process running the run it names. The worker logs
it (``Terminating <id>``), and soak/logscan.py ends that execution there.

Times are the database's clock (``task_audit.at`` is ``clock_timestamp()``): the soak's own
clock plus the offset measured at the start. Windows are kept in memory, not in the
database, because a ``pgrestart`` opens one while PostgreSQL is down.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import sqlalchemy as sa

DEAD, FROZEN, DRAINING = "dead", "frozen", "draining"
GROUP, MAIN_ONLY = "group", "main"  # a stop window's note: which processes were stopped
DATABASE_EPOCH = sa.text("SELECT extract(epoch FROM clock_timestamp()) AS at")


@dataclass
class Window:
    process: str  # "w2.3", or "w2.3/4711" for one pool child
    state: str  # DEAD, FROZEN or DRAINING
    cause: str  # the fault kind (or "exit", "cold shutdown")
    start: float  # database clock, epoch seconds
    end: float | None = None  # None while open (a dead window never closes)
    note: str = ""  # txfreeze: the frozen reminder's team; stop: GROUP or MAIN_ONLY

    def covers(self, at: float, grace_s: float) -> bool:
        return self.start <= at and (self.end is None or at <= self.end + grace_s)

    def line(self, origin: float) -> str:
        end = "open" if self.end is None else f"{self.end - origin:7.1f}s"
        return (
            f"{self.start - origin:7.1f}s .. {end:>8} {self.process:12} {self.state:8} {self.cause}"
        )


@dataclass
class Event:
    """A fault that hit no process in particular (Redis, PostgreSQL), with its span."""

    kind: str
    start: float
    end: float
    detail: str = ""


@dataclass
class Timeline:
    offset_s: float = 0.0  # database clock minus the soak's clock
    origin: float = 0.0  # the chaos window's start, database clock
    windows: list[Window] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def measure(self, engine: sa.Engine) -> None:
        """The database's clock against ours (the same host in the soak: about 0)."""
        before = time.time()
        with engine.connect() as conn:
            at = float(conn.execute(DATABASE_EPOCH).scalar_one())
        self.offset_s = at - (before + time.time()) / 2

    def now(self) -> float:
        return time.time() + self.offset_s

    def open(self, process: str, state: str, cause: str, note: str = "") -> Window:
        window = Window(process, state, cause, self.now(), note=note)
        with self._lock:
            self.windows.append(window)
        return window

    def close(self, window: Window) -> None:
        window.end = self.now()

    def dead(self, process: str, cause: str) -> None:
        """Record a death once (a kill, then the exit it caused, is one death)."""
        with self._lock:
            if any(w.process == process and w.state == DEAD for w in self.windows):
                return
            self.windows.append(Window(process, DEAD, cause, self.now()))

    def event(self, kind: str, start: float, detail: str = "") -> Event:
        event = Event(kind, start, self.now(), detail)
        with self._lock:
            self.events.append(event)
        return event

    def covered_s(self, kinds: dict[str, float], start: float, end: float) -> float:
        """Seconds of [start, end] that an event of ``kinds`` covered, each event followed by
        its kind's allowance (overlapping events counted once)."""
        with self._lock:
            spans = sorted(
                (max(e.start, start), min(e.end + kinds[e.kind], end))
                for e in self.events
                if e.kind in kinds
            )
        covered, reached = 0.0, start
        for lo, hi in spans:
            lo = max(lo, reached)
            if hi > lo:
                covered, reached = covered + hi - lo, hi
        return covered

    def of(self, process: str) -> list[Window]:
        with self._lock:
            return [w for w in self.windows if w.process == process]

    def lines(self) -> list[str]:
        with self._lock:
            rows = sorted(self.windows, key=lambda w: w.start)
            events = sorted(self.events, key=lambda e: e.start)
        out = [w.line(self.origin) for w in rows]
        out += [
            f"{e.start - self.origin:7.1f}s .. {e.end - self.origin:7.1f}s {e.kind:12} {e.detail}"
            for e in events
        ]
        return out
