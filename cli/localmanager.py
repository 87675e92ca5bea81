"""honcho's process manager with a deploy-safe stop (used by :mod:`cli.localrun`).

Stock honcho 2.0 signals each child's whole group (prefork children too) and SIGKILLs all
5 s after the first exit, cutting a worker's drain short. Here the first stop signal sends
one SIGTERM to each child's pid; what is left is killed after ``stop_grace_s`` or at a
second signal. A lost stdout (``make run | less``, quit) does not kill the runner.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import sys
import time
from types import FrameType
from typing import Any, TextIO

from honcho.manager import Manager
from honcho.printer import Printer
from honcho.process import Process

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOST = -1  # the return code shown for a child whose helper vanished without reporting
HELPER_GRACE_S = 1.0  # how long a dead helper's stop message may still be on its way
WAITING_NOTE_S = 5.0  # while stopping: how often to say what is still running


def _signal_pid(pid: int, sig: signal.Signals, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except OSError as exc:
        if exc.errno not in (errno.ESRCH, errno.EPERM):
            raise


class SafeOutput:
    """A stream whose write errors (a closed pipe) silence it instead of raising."""

    def __init__(self, stream: TextIO) -> None:
        self.stream: TextIO | None = stream

    def write(self, text: str) -> int:
        if self.stream is not None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):
                self.stream = None
        return len(text)

    def flush(self) -> None:
        if self.stream is not None:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.stream = None

    def isatty(self) -> bool:
        return self.stream is not None and self.stream.isatty()


class _ChildProcess(Process):
    """honcho's per-child helper, which also ignores SIGHUP (as it does SIGINT/SIGTERM):
    it lives until its child exits, so it can always report the child's exit code."""

    def run(self, events: Any = None, ignore_signals: bool = False) -> None:
        self._events = events
        self._child = self._child_ctor(self.cmd, env=self.env, cwd=self.cwd)
        self._send_message({"pid": self._child.pid}, type="start")
        if ignore_signals:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        for line in iter(self._child.stdout.readline, b""):
            if not self.quiet:
                self._send_message(line)
        self._child.stdout.close()
        self._child.wait()
        self._send_message({"returncode": self._child.returncode}, type="stop")


class ClusterManager(Manager):
    def __init__(
        self, stop_grace_s: float, drain_s: float | None = None, output: TextIO | None = None
    ) -> None:
        """``drain_s``: the workers' own drain budget (SHUTDOWN_TIMEOUT_S), as the stop
        message says it; ``stop_grace_s``: when whatever is left is killed."""
        super().__init__(Printer(SafeOutput(output or sys.stdout)))
        self._process_ctor = _ChildProcess
        self.stop_grace_s = stop_grace_s
        self.drain_s = stop_grace_s if drain_s is None else drain_s
        self.signals_received = 0
        self.stop_requested = False
        self.unexpected: list[str] = []
        self._kill_at: float | None = None
        self._killed = False
        self._next_note: float | None = None

    # -- signals -------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals_received += 1
        name = signal.Signals(signum).name
        if self.signals_received == 1:
            self.stop_requested = True
            self._system_print(
                f"{name} received: stopping (one SIGTERM each; workers finish running tasks, "
                f"up to {self.drain_s:g} s). Send it again to kill them now.\n"
            )
            self.terminate()
        else:
            self._system_print(f"{name} received again: killing what is left\n")
            self.kill()

    # -- stopping ------------------------------------------------------------------
    def terminate(self) -> None:
        if not self._terminating:
            self._kill_at = time.monotonic() + self.stop_grace_s
            self._next_note = time.monotonic() + WAITING_NOTE_S
        super().terminate()

    def _note_waiting(self) -> None:
        """While stopping, every WAITING_NOTE_S: which processes are still running (the
        workers finishing their tasks) and when what is left will be killed."""
        now = time.monotonic()
        if self._next_note is None or self._killed or now < self._next_note:
            return
        self._next_note = now + WAITING_NOTE_S
        running = [name for name, proc in self._processes.items() if "returncode" not in proc]
        if running and self._kill_at is not None:
            self._system_print(
                f"waiting for {', '.join(running)} to stop (workers finish their running "
                f"tasks; killed in {max(0.0, self._kill_at - now):.0f} s)\n"
            )

    def kill(self) -> None:
        self._killed = True
        super().kill()

    def _killall(self, force: bool = False) -> None:
        for name, proc in self._processes.items():
            pid = proc.get("pid")
            if pid is None or "returncode" in proc:
                continue  # not started yet (signalled on start) or already gone
            if force:
                _signal_pid(pid, signal.SIGKILL, group=True)
                self._system_print(f"sent SIGKILL to {name} (pid {pid}) and its group\n")
            elif not proc.get("sigterm_sent"):
                proc["sigterm_sent"] = True
                _signal_pid(pid, signal.SIGTERM)
                self._system_print(f"sent SIGTERM to {name} (pid {pid})\n")

    # -- the loop ------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        if msg.type == "line":
            self._printer.write(msg)
        elif msg.type == "start":
            self._processes[msg.name]["pid"] = msg.data["pid"]
            self._system_print(f"{msg.name} started (pid={msg.data['pid']})\n")
            if self._terminating:
                self._killall(force=self._killed)
        elif msg.type == "stop":
            if self._processes[msg.name].get("returncode") == LOST:
                self._processes[msg.name]["returncode"] = msg.data["returncode"]  # late news
            else:
                self._stopped(msg.name, msg.data["returncode"])

    def _stopped(self, name: str, code: int) -> None:
        self._processes[name]["returncode"] = code
        self._system_print(f"{name} stopped (rc={code})\n")
        if not self._terminating:
            self.unexpected.append(name)
            self._system_print(f"{name} exited on its own: stopping the others\n")
            self.terminate()

    def _reap_lost_helpers(self) -> None:
        """A helper dead for a second without its stop message was killed from outside."""
        now = time.monotonic()
        for name, proc in self._processes.items():
            helper = proc.get("process")
            if "returncode" in proc or helper is None or helper.exitcode is None:
                continue
            if now - proc.setdefault("helper_gone_at", now) > HELPER_GRACE_S:
                self._stopped(name, LOST)

    def _run_until_stopped(self) -> None:
        self._start()
        while True:
            try:
                self._handle(self.events.get(timeout=0.1))
            except queue.Empty:
                if self._all_started() and self._all_stopped():
                    return
                self._reap_lost_helpers()
            self._note_waiting()
            at = self._kill_at
            if at is not None and not self._killed and time.monotonic() > at:
                self._system_print(f"still running after {self.stop_grace_s:g} s\n")
                self.kill()

    def loop(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        try:
            self._run_until_stopped()
        except BaseException:
            self.kill()  # never leave the children running without us
            raise
        self.returncode = self._final_code()

    def _final_code(self) -> int:
        codes = {name: proc.get("returncode") for name, proc in self._processes.items()}
        failed = {name: code for name, code in codes.items() if code != 0}
        if self.stop_requested and not failed and not self.unexpected:
            self._system_print("all processes stopped cleanly\n")
            return 0
        detail = ", ".join(f"{name} rc={code}" for name, code in failed.items()) or "none"
        self._system_print(f"stopped with failures (non-zero: {detail})\n")
        return 1
