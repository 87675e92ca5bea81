"""What a worker's Prometheus metrics cost per task where they are written: the pool
child running the task (teamdesk/metrics.py).

The side-by-side throughput ratio (``p1_metrics_cost``, bench/throughput.py) moves by
several per cent from batch to batch on a 2-core machine, more than the metrics can
cost; this is the direct figure under it. A fresh interpreter switches to multiprocess
mode (memory-mapped files in a temporary directory, as a worker with ``METRICS_PORT``
does) and runs, ``CALLS`` times, what one small export's execution records: the
``task_prerun`` clock, ``task.started`` (a claim), one ``task.progress`` (looked up,
not counted) and ``task.completed`` (the duration histogram). The figure is the
process CPU time per task in microseconds; ``p1_metrics_share`` relates it to the time a
pool child spends per small export in P1 (concurrency / throughput).

Usage: ``python -m bench.metrics_cost [CALLS]`` prints the microseconds.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from teamdesk import metrics

CALLS = 20_000
WARMUP = 1_000


def measure(calls: int = CALLS) -> float:
    """CPU microseconds per task in this process (which it leaves in multiprocess mode)."""
    metrics.use_multiprocess(tempfile.mkdtemp(prefix="td-bench-prom-"))
    fields = {"kind": "EXPORT"}

    def one_task() -> None:
        metrics.task_began("EXPORT")
        metrics.on_event("task.started", fields)
        metrics.on_event("task.progress", fields)
        metrics.on_event("task.completed", fields)

    for _ in range(WARMUP):
        one_task()
    started = time.process_time()
    for _ in range(calls):
        one_task()
    return (time.process_time() - started) / calls * 1e6


def per_task_us(calls: int = CALLS) -> float:
    """:func:`measure` in a fresh interpreter (multiprocess mode is for the whole process)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.metrics_cost", str(calls)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return float(out.stdout.strip())


if __name__ == "__main__":
    print(round(measure(int(sys.argv[1]) if len(sys.argv) > 1 else CALLS), 2))
