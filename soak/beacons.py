"""Beacons: small files a soak hook writes inside a worker to tell the soak where it is.

``txfreeze`` must SIGSTOP the very process that is inside a reminder's transaction, and
``longterm`` must SIGTERM the worker whose pool child runs a long export: only the hook
(soak/hooks.py) knows that process, at that moment. It writes
``<SOAK_BEACON_DIR>/<name>.json`` (pid, task, execution); the soak polls for it. Files, not
the database: a beacon must get through while ``pgkill`` and ``pgrestart`` are at work.

A beacon is written once per name (``O_EXCL``): a task's later executions (after its
frozen one was recovered) pass the hook point without stopping there again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

BEACON_DIR_ENV = "SOAK_BEACON_DIR"
POLL_S = 0.05


def _path(directory: Path, name: str) -> Path:
    return directory / f"{name}.json"


def light(directory: str, name: str, **fields: Any) -> bool:
    """Write the beacon unless it exists; True when this call wrote it."""
    final = _path(Path(directory), name)
    try:
        fd = os.open(final.with_suffix(".lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    temporary = final.with_suffix(".tmp")
    temporary.write_text(json.dumps({"pid": os.getpid(), **fields}))
    temporary.rename(final)  # the soak never reads a half-written beacon
    return True


def read(directory: Path, name: str) -> dict[str, Any] | None:
    path = _path(directory, name)
    if not path.exists():
        return None
    found: dict[str, Any] = json.loads(path.read_text())
    return found


def wait(directory: Path, name: str, timeout_s: float) -> dict[str, Any] | None:
    """The beacon's fields once it is lit, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = read(directory, name)
        if found is not None:
            return found
        time.sleep(POLL_S)
    return None
