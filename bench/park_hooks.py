"""Loaded inside bench workers by the test-hook seam ``TEAMDESK_TEST_HOOKS=bench.park_hooks``.

Holds every execution right after its claim committed (the ``task.claimed`` hook point)
while the file named by ``BENCH_PARK_FILE`` exists, so a bench can keep runs RUNNING - a
team at its ``TEAM_MAX_RUNNING`` cap - for as long as it needs, then let them all finish
by removing the file. A run is held at most ``MAX_PARK_S``. Nothing else changes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from teamdesk import hooks

PARK_FILE_ENV = "BENCH_PARK_FILE"
MAX_PARK_S = 120.0
POLL_S = 0.02


def _park(**_: Any) -> None:
    path = os.environ.get(PARK_FILE_ENV)
    if not path:
        return
    deadline = time.monotonic() + MAX_PARK_S
    while Path(path).exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)


hooks.install("task.claimed", _park)
