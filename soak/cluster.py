"""The soak's processes: a dedicated ``redis-server``, three workers and one beat.

The soak plays the orchestrator: it starts every process, restarts the ones a fault
stopped, and (like Compose's ``restart: unless-stopped``) restarts any process that
exits on its own, recording that exit for the report. Every process writes its output
to its own file per incarnation (``w2.3.log`` = the third start of worker w2).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.processes import Proc, celery_argv, free_port, worker_argv

REDIS_START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 30.0  # a SIGTERM'd worker: drain budget + hard-exit guard + margin
RESTART_BACKOFF_S = 1.0  # before restarting a process that exited on its own
WORKER_QUEUES = "exports,reminders"


class SoakRedis:
    """A ``redis-server`` on a free 127.0.0.1 port, without persistence: a restart loses
    every key (queued and unacknowledged messages, markers, heartbeats, beat's lock)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir / "redis"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("soak: redis-server is not installed")
        self.binary = binary

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.starts += 1
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        log = (self.workdir / f"redis.{self.starts}.log").open("wb")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_answering()

    def _wait_answering(self) -> None:
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    assert self.process is not None
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("soak: redis-server did not start") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Send ``sig`` (SIGTERM or SIGKILL) and wait for the exit."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
            os.kill(process.pid, sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@dataclass
class Member:
    """One logical process of the cluster (``w1``..``w3``, ``beat``) and its incarnations."""

    name: str
    argv: Callable[[int], list[str]]
    incarnation: int = 0
    proc: Proc | None = None
    held: bool = False  # a fault owns it now: the supervisor leaves it alone
    unexpected_exits: list[tuple[int, int]] = field(default_factory=list)  # (incarnation, rc)
    logs: list[Path] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return (
            self.proc is not None
            and self.proc.popen is not None
            and (self.proc.popen.poll() is None)
        )


class Cluster:
    """Starts, restarts and supervises the workers and beat."""

    def __init__(self, env: dict[str, str], logdir: Path, workers: int, concurrency: int) -> None:
        self.env, self.logdir = env, logdir
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

    def start(self, name: str) -> Proc:
        with self.lock:
            member = self.members[name]
            member.incarnation += 1
            proc = Proc(
                f"{name}.{member.incarnation}",
                member.argv(member.incarnation),
                self.env,
                self.logdir,
            )
            member.proc = proc.start()
            member.logs.append(proc.log_path)
            return proc

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

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            with self.lock:
                exited = [m for m in self.members.values() if not m.held and not m.running]
                for member in exited:
                    rc = member.proc.popen.returncode if member.proc and member.proc.popen else -1
                    member.unexpected_exits.append((member.incarnation, rc))
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
            procs = [(n, m.proc) for n, m in self.members.items() if m.proc is not None]
        for _name, proc in procs:
            if proc.popen is not None and proc.popen.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGTERM)
        for name, proc in procs:
            try:
                codes[name] = proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                codes[name] = None
            proc.kill()
        return codes

    def kill_all(self) -> None:
        """Last-resort cleanup: SIGKILL every process group this cluster started."""
        self._stop.set()
        with self.lock:
            for member in self.members.values():
                if member.proc is not None:
                    with suppress(Exception):
                        os.killpg(member.proc.pid, signal.SIGCONT)
                    with suppress(Exception):
                        member.proc.kill()
