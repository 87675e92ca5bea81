"""Real ``celery beat`` subprocesses whose log lines the test reads over their stderr pipe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINE_TIMEOUT_S = 20.0


class BeatProcess:
    """``celery -A <app> beat`` with a thread collecting its stderr (JSON log lines)."""

    def __init__(self, env: dict[str, str], app: str = "tasks") -> None:
        command = [sys.executable, "-m", "celery", "-A", app, "--quiet", "beat"]
        self.process = subprocess.Popen(
            command,
            env={**env, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def origin(self) -> str:
        """The ``origin`` header prefix of the messages this process publishes."""
        return f"gen{self.pid}@"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def logged(self, text: str) -> bool:
        with self._changed:
            return any(text in line for line in self.lines)

    def wait_logged(self, text: str, timeout: float = LINE_TIMEOUT_S) -> None:
        """Block until a log line containing ``text`` arrives (a gate, not a sleep)."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(text in line for line in self.lines) or self.process.poll() is not None,
                timeout,
            )
            if not found or not any(text in line for line in self.lines):
                tail = "".join(self.lines[-20:])
                raise AssertionError(f"beat {self.pid} never logged {text!r}:\n{tail}")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self) -> int:
        os.kill(self.pid, signal.SIGTERM)
        return self.process.wait(timeout=20)

    def stop(self) -> None:
        """Cleanup: end this process if it is still running (only this one, by its pid)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self._reader.join(timeout=5)
