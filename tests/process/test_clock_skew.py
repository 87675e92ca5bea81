"""harness/clock_skew.py: a skewed process starts even where a killed one left its
libfaketime semaphore behind (a CI run failed so under Debian's ``faketime`` wrapper)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from harness.clock_skew import skewed_env

SHM = Path("/dev/shm")
AHEAD = 3000  # pids after the last one handed out, each given a stale semaphore


def stale_semaphores(first: int, count: int) -> list[Path]:
    """What a SIGKILLed wrapper or process leaves: its pid-named semaphore and memory."""
    made = []
    for pid in range(first, first + count):
        for name in (f"sem.faketime_sem_{pid}", f"faketime_shm_{pid}"):
            path = SHM / name
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                continue
            os.close(fd)
            made.append(path)
    return made


def test_a_skewed_process_starts_over_a_killed_ones_semaphore() -> None:
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    made = stale_semaphores(last + 1, AHEAD)
    try:
        env = skewed_env({"PATH": os.environ["PATH"]}, 150)
        code = "import os, time; print(os.getpid(), time.time())"
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
        )
        now = time.time()
    finally:
        for path in made:
            path.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    pid, seen = done.stdout.split()
    assert last < int(pid) <= last + AHEAD  # it met a stale semaphore of its own pid
    assert abs(float(seen) - now - 150) < 10  # and its wall clock is 150 s ahead
