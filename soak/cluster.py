"""The soak's processes: three workers and one beat (its Redis: soak/sentinel.py).

The soak plays the orchestrator: it starts every process, restarts the ones a fault
stopped, and (like Compose's ``restart: unless-stopped``) restarts any process that
exits on its own. Every exit is counted: the ones the soak caused (a kill, a SIGTERM)
and the others, which are violations (a worker or beat must ride out Redis and
PostgreSQL outages). Every process writes its output to its own file per incarnation
(``w2.3.log`` = the third start of worker w2). A member may run with libfaketime
preloaded (the ``skew`` fault, harness/clock_skew.py): its incarnations remember the
offset, so their log times can be read on the real clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from harness.clock_skew import skewed_env
from harness.processes import Proc, celery_argv, worker_argv
from soak.timeline import DRAINING, Timeline

SHUTDOWN_TIMEOUT_S = 75.0  # the workers' drain budget: a long export finishes inside it
HARD_EXIT_AFTER_S = 10.0  # worker/lifecycle.py: the last guard after the budget
STOP_TIMEOUT_S = SHUTDOWN_TIMEOUT_S + HARD_EXIT_AFTER_S + 15.0  # a SIGTERM'd worker's exit
RESTART_BACKOFF_S = 1.0  # before restarting a process that exited on its own
SUPERVISE_EVERY_S = 0.5
KILL_WAIT_S = 10.0
WORKER_QUEUES = "exports,reminders"


@dataclass
class Incarnation:
    """One start of a member: ``w2.3`` is the third start of worker w2."""

    name: str
    member: str
    proc: Proc
    skew_s: int = 0  # the faketime offset it ran under (0: the real clock)
    cause: str | None = None  # set before the soak signals it: kill, term, longterm, skew, final
    exit_code: int | None = None
    exited: bool = False
    unexpected: bool = False

    @property
    def log(self) -> Path:
        return self.proc.log_path

    @property
    def main_pid(self) -> int:
        """The Celery main process, for signals meant for it alone (a skewed one too:
        harness/clock_skew.py preloads libfaketime, no wrapper process stands between)."""
        return self.proc.pid


@dataclass
class Member:
    """One logical process of the cluster (``w1``..``w3``, ``beat``) and its incarnations."""

    name: str
    argv: Callable[[int], list[str]]
    incarnations: list[Incarnation] = field(default_factory=list)
    held: bool = False  # a fault owns it now: the supervisor leaves it alone
    skew_s: int = 0  # the next start runs under faketime with this offset

    @property
    def current(self) -> Incarnation | None:
        return self.incarnations[-1] if self.incarnations else None

    @property
    def proc(self) -> Proc | None:
        current = self.current
        return current.proc if current is not None else None

    @property
    def running(self) -> bool:
        proc = self.proc
        return proc is not None and proc.popen is not None and proc.popen.poll() is None

    @property
    def logs(self) -> list[Path]:
        return [inc.log for inc in self.incarnations]


class Cluster:
    """Starts, signals, restarts and supervises the workers and beat."""

    def __init__(
        self,
        env: dict[str, str],
        logdir: Path,
        workers: int,
        concurrency: int,
        timeline: Timeline,
    ) -> None:
        self.env, self.logdir, self.timeline = env, logdir, timeline
        self.lock = threading.RLock()
        self.members: dict[str, Member] = {}
        for i in range(1, workers + 1):
            name = f"w{i}"
            self.members[name] = Member(name, self._worker_argv(name, concurrency))
        self.members["beat"] = Member("beat", lambda _inc: celery_argv("beat"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="soak-supervisor", daemon=True)

    @staticmethod
    def _worker_argv(name: str, concurrency: int) -> Callable[[int], list[str]]:
        def argv(incarnation: int) -> list[str]:
            node = f"{name}-{incarnation}"
            return worker_argv(node, queues=WORKER_QUEUES, concurrency=concurrency)

        return argv

    @property
    def worker_names(self) -> list[str]:
        return [name for name in self.members if name != "beat"]

    def incarnations(self) -> list[Incarnation]:
        with self.lock:
            return [inc for m in self.members.values() for inc in m.incarnations]

    def start(self, name: str) -> Proc:
        with self.lock:
            member = self.members[name]
            number = len(member.incarnations) + 1
            env = skewed_env(self.env, member.skew_s) if member.skew_s else self.env
            proc = Proc(f"{name}.{number}", member.argv(number), env, self.logdir)
            member.incarnations.append(Incarnation(proc.name, name, proc, member.skew_s))
            return proc.start()

    def start_all(self) -> None:
        for name in self.members:
            self.start(name)
        self._thread.start()

    def hold(self, name: str) -> Member | None:
        """Take a running member for a fault; None when it is already held or down."""
        with self.lock:
            member = self.members[name]
            if member.held or not member.running:
                return None
            member.held = True
            return member

    def release(self, name: str, restart: bool) -> None:
        with self.lock:
            member = self.members[name]
            if restart and not member.running:
                self.start(name)
            member.held = False

    def owner_of(self, pid: int) -> str | None:
        """The member whose process group holds ``pid`` (a pool child or the main process)."""
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            return None
        with self.lock:
            for name, member in self.members.items():
                if member.running and member.proc is not None and member.proc.pid == group:
                    return name
        return None

    # ---- signals sent by faults (the member is held) ---------------------------------------
    def kill(self, name: str, cause: str) -> Incarnation:
        """SIGKILL the member's whole process group and wait for the exit."""
        inc = self._expect(name, cause)
        self.timeline.dead(inc.name, cause)
        with suppress(ProcessLookupError):
            os.killpg(inc.proc.pid, signal.SIGKILL)
        self._wait_exit(inc, KILL_WAIT_S)
        return inc

    def terminate(self, name: str, cause: str) -> Incarnation:
        """SIGTERM the member's main process (a warm shutdown: its leases must stay alive
        while it drains) and wait for the exit."""
        inc = self._expect(name, cause)
        draining = self.timeline.open(inc.name, DRAINING, cause)
        with suppress(ProcessLookupError):
            os.kill(inc.main_pid, signal.SIGTERM)
        self._wait_exit(inc, STOP_TIMEOUT_S)
        self.timeline.close(draining)
        return inc

    def _expect(self, name: str, cause: str) -> Incarnation:
        with self.lock:
            inc = self.members[name].current
            assert inc is not None
            inc.cause = inc.cause or cause
            return inc

    def _wait_exit(self, inc: Incarnation, timeout_s: float) -> None:
        popen = inc.proc.popen
        assert popen is not None
        try:
            popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            inc.proc.kill()
        self._exited(inc, inc.cause or "exit")

    def _exited(self, inc: Incarnation, cause: str) -> None:
        popen = inc.proc.popen
        inc.exit_code = popen.returncode if popen is not None else None
        inc.exited = True
        self.timeline.dead(inc.name, cause)

    # ---- the process manager ----------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.wait(SUPERVISE_EVERY_S):
            with self.lock:
                exited = [m for m in self.members.values() if not m.held and not m.running]
                for member in exited:
                    inc = member.current
                    assert inc is not None
                    inc.unexpected = inc.cause is None
                    self._exited(inc, inc.cause or "exit")
                    member.held = True
            for member in exited:
                threading.Thread(
                    target=self._restart_later, args=(member.name,), daemon=True
                ).start()

    def _restart_later(self, name: str) -> None:
        if self._stop.wait(RESTART_BACKOFF_S):
            return
        self.release(name, restart=True)

    def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every process (continuing any stopped one), wait, kill what is left."""
        self._stop.set()
        self._thread.join(timeout=5)
        codes: dict[str, int | None] = {}
        with self.lock:
            current = [(n, m.current) for n, m in self.members.items() if m.running]
        for _name, inc in current:
            assert inc is not None
            inc.cause = inc.cause or "final"
            with suppress(ProcessLookupError):
                os.killpg(inc.proc.pid, signal.SIGCONT)
                os.kill(inc.main_pid, signal.SIGTERM)
        for name, inc in current:
            assert inc is not None
            try:
                codes[name] = inc.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                codes[name] = None
            inc.proc.kill()
            self._exited(inc, "final")
        return codes

    def kill_all(self) -> None:
        """Last-resort cleanup: SIGKILL every process group this cluster started."""
        self._stop.set()
        with self.lock:
            procs = [inc.proc for inc in self.incarnations()]
        for proc in procs:
            if proc.popen is not None and proc.popen.poll() is None:
                with suppress(Exception):
                    os.killpg(proc.pid, signal.SIGCONT)
                with suppress(Exception):
                    proc.kill()
