"""Loaded (through PYTHONPATH) only by processes harness/clock_skew.py starts skewed.

Debian 12's libfaketime 0.9.10 with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` breaks Python
3.11's ``time.sleep``: Python sleeps with ``clock_nanosleep(CLOCK_MONOTONIC,
TIMER_ABSTIME)``, libfaketime shifts that absolute monotonic deadline as if it were a
faked wall-clock time and the kernel answers EINVAL, so every ``time.sleep`` raises
``OSError: [Errno 22] Invalid argument`` (wolfcw/libfaketime issue 426). Faking the
monotonic clock too is worse: lock and event timeouts (``sem_clockwait``) then wait 150 s
longer, or not at all. A host whose clock is set wrong has neither problem, so the skewed
process gets a ``time.sleep`` that waits with a relative ``select`` timeout, which
libfaketime leaves alone: the only clock that differs is the wall clock, as intended.
"""

from __future__ import annotations

import select
import time
from typing import SupportsIndex


def _sleep(seconds: float | SupportsIndex) -> None:
    wait = float(seconds)
    if wait < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], wait)


time.sleep = _sleep
