"""The short soak (``python -m soak.run --short``) as part of ``make test``: at least 200
tasks and 10 faults (worker SIGKILL / SIGTERM / SIGSTOP, pg_terminate_backend, Redis
restarts) against real worker and beat subprocesses, its own database and its own
redis-server; every ledger invariant is checked from PostgreSQL (see soak/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.slow

SUMMARY = re.compile(r"^soak: (\d+) tasks, (\d+) faults, (\d+) violations$", re.MULTILINE)
BUDGET_S = 180  # the short soak must finish in under 3 minutes


def run_short_soak() -> tuple[int, str, float]:
    started = time.monotonic()
    soak = subprocess.Popen(
        [sys.executable, "-m", "soak.run", "--short"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = soak.communicate(timeout=BUDGET_S + 60)
    except subprocess.TimeoutExpired:
        soak.terminate()  # the soak cleans up its processes, Redis and database on SIGTERM
        output, _ = soak.communicate(timeout=60)
    return soak.returncode, output, time.monotonic() - started


def test_short_soak_passes() -> None:
    code, output, took = run_short_soak()
    found = SUMMARY.findall(output)
    assert code == 0, output[-8000:]
    assert len(found) == 1, output[-8000:]
    tasks, faults, violations = (int(n) for n in found[0])
    assert tasks >= 200 and faults >= 10 and violations == 0, output[-8000:]
    assert took < BUDGET_S, f"the short soak took {took:.0f} s"
