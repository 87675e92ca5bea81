"""The short soak (``python -m soak.run --short``) as part of ``make test``: 200 tasks and
two faults of each of the 16 kinds (soak/chaos.py ``KINDS``: worker SIGKILL / SIGTERM /
SIGSTOP, SIGKILL of a pool process running a task, pg_terminate_backend, a Redis restart,
FLUSHALL and a memory squeeze, a Sentinel failover, clock skew under faketime, a reminder
frozen inside its transaction, SIGTERM during a long export, restarts of the soak's own
PostgreSQL, every free PostgreSQL connection held, ``celery purge``, ``celery control
revoke`` / ``terminate``) against real worker and beat subprocesses, the soak's own
PostgreSQL server and its own Redis under Sentinel; every invariant is checked (see
soak/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from harness.processes import ROOT
from soak.chaos import KINDS

pytestmark = pytest.mark.slow

SUMMARY = re.compile(r"^soak: (\d+) tasks, (\d+) faults, (\d+) violations$", re.MULTILINE)
PER_KIND = re.compile(r"^soak: faults (?!skipped )(.+)$", re.MULTILINE)  # not the skipped line
BUDGET_S = 240  # the short soak takes about 1.5 minutes alone, under 4 on a busy machine


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
        soak.terminate()  # the soak cleans up its processes, Redis and PostgreSQL on SIGTERM
        output, _ = soak.communicate(timeout=60)
    return soak.returncode, output, time.monotonic() - started


def faults_per_kind(output: str) -> dict[str, int]:
    """``soak: faults kill 2, term 2, ...`` as a dict."""
    found = PER_KIND.findall(output)
    assert found, output[-8000:]
    pairs = (item.rsplit(" ", 1) for item in found[-1].split(", "))
    return {kind: int(n) for kind, n in pairs}


def test_short_soak_passes() -> None:
    code, output, took = run_short_soak()
    found = SUMMARY.findall(output)
    assert len(found) == 1, output[-8000:]
    tasks, faults, violations = (int(n) for n in found[0])
    assert code == 0, output[-8000:]
    # A few faults may find no target in time (a long export still queued behind the
    # workload, nothing revocable): every kind must still have been injected (below).
    assert tasks >= 200 and faults >= 2 * len(KINDS) - 4 and violations == 0, output[-8000:]
    per_kind = faults_per_kind(output)
    assert set(per_kind) == set(KINDS), per_kind
    assert all(n >= 1 for n in per_kind.values()), per_kind  # every kind was injected
    assert took < BUDGET_S, f"the short soak took {took:.0f} s"
