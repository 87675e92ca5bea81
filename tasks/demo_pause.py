"""Demo only: exports slow enough to watch (``run-local --slow-exports S``), a pause on the
``export.after_read`` hook after each batch, capped at :data:`TOTAL_BUDGET_S` per export so
it still completes within its read budget. Never in production: only ``run-local`` sets the
variable, and tests/unit/test_deploy_demo_knobs.py refuses it in deploy/.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from teamdesk import hooks
from teamdesk.config import get_settings

SLOW_EXPORT_ENV = "TEAMDESK_DEMO_SLOW_EXPORT_S"
MAX_DELAY_S = 5.0
TOTAL_BUDGET_S = 40.0  # all pauses of one export; its read transaction is bounded to 60 s


def parse_delay(text: str) -> float:
    """Seconds per batch, 0 (off) to :data:`MAX_DELAY_S`; ValueError with a fixed text."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{SLOW_EXPORT_ENV} must be a number of seconds") from None
    if not 0 <= value <= MAX_DELAY_S:
        raise ValueError(f"{SLOW_EXPORT_ENV} must be within 0..{MAX_DELAY_S:g} seconds")
    return value


def pause_per_batch(delay_s: float, total_rows: int, batch_size: int) -> float:
    """``delay_s``, shortened so an export's pauses add up to at most the budget."""
    batches = max(1, math.ceil(total_rows / batch_size))
    return min(delay_s, TOTAL_BUDGET_S / batches)


def pauser(
    delay_s: float, batch_size: int, sleep: Callable[[float], None] = time.sleep
) -> Callable[..., None]:
    """The ``export.after_read`` hook: pause after each batch read."""

    def pause(total: int, **_: Any) -> None:
        sleep(pause_per_batch(delay_s, total, batch_size))

    return pause


def delay_from_env(env: dict[str, str] | None = None) -> float:
    raw = (os.environ if env is None else env).get(SLOW_EXPORT_ENV, "").strip()
    return parse_delay(raw or "0")


def install_from_env() -> None:
    """Install the pause when the variable says so (a worker's start), with a warning; a
    bad value stops the process like any configuration error (one line, exit code 2)."""
    try:
        delay_s = delay_from_env()
    except ValueError as exc:
        print(f"teamdesk-tasks: configuration error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if delay_s <= 0:
        return
    hooks.install("export.after_read", pauser(delay_s, get_settings().export_batch_size))
    print(
        f"DEMO ONLY: {SLOW_EXPORT_ENV}={delay_s:g}: every export pauses {delay_s:g} s per "
        "batch (run-local --slow-exports); never set it in production",
        file=sys.stderr,
        flush=True,
    )
