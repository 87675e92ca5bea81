"""A process whose wall clock is set wrong, as on a host whose clock is off.

libfaketime is preloaded directly (``LD_PRELOAD`` and ``FAKETIME``), not through Debian's
``faketime`` wrapper. The wrapper names a POSIX semaphore after its own pid and removes it
only when it exits cleanly: a wrapper killed by SIGKILL (how tests end a process group)
leaves ``/dev/shm/sem.faketime_sem_<pid>`` behind, and a later wrapper that is given the same
pid exits at once with "faketime: sem_open: File exists" (a CI run failed so). Preloading
also leaves no wrapper between a signal and the process it is meant for.

Only the wall clock is faked (``FAKETIME_DONT_FAKE_MONOTONIC``): sleeps, timeouts and
Celery's timers keep real time, as on a badly set host; ``faketime_fix`` (put first on
``PYTHONPATH``) works around libfaketime's broken ``time.sleep`` in that mode.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

FAKETIME_FIX = Path(__file__).resolve().parent / "faketime_fix"
LIBRARY_GLOB = "/usr/lib/*/faketime/libfaketime.so.1"  # Debian's libfaketime package


class ClockSkewUnavailable(RuntimeError):
    pass


def libfaketime() -> str:
    found = sorted(glob.glob(LIBRARY_GLOB))
    if not found:
        raise ClockSkewUnavailable(
            "libfaketime is not installed: make test installs it "
            "(bash scripts/ensure_debian.sh faketime faketime)"
        )
    return found[0]


def skewed_env(env: dict[str, str], offset_s: int) -> dict[str, str]:
    """``env`` for a process whose wall clock reads ``offset_s`` seconds off (either sign)."""
    path = os.pathsep.join(p for p in (str(FAKETIME_FIX), env.get("PYTHONPATH", "")) if p)
    preload = " ".join(p for p in (libfaketime(), env.get("LD_PRELOAD", "")) if p)
    return {
        **env,
        "LD_PRELOAD": preload,
        "FAKETIME": f"{offset_s:+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": path,
    }
