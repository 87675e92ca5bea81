"""Where the worker's CPU goes: ``python -m bench.cpu_profile [N]`` (needs ``py-spy``).

Drains N bare no-ops, N small exports and N reminders through one ``-c 2`` worker (as in
P1) while ``py-spy record --subprocesses`` samples the worker's main process and pool
children. Each sample py-spy counts as active is charged to the innermost library on its
stack (SQLAlchemy, psycopg2, redis-py, kombu, billiard, logging, our code, ...), per
process role, and printed as microseconds per task. "Active" includes waiting for a CPU
and some socket waits, so read the figures as shares, not CPU seconds (P1's /proc figures
are the CPU seconds). Writes
``results/cpu_profile.json`` and ``results/cpu_profile.txt``, and a flame graph of one pool
child draining small exports, ``results/flame_export_child[_TAG].svg`` (``TAG`` from the
environment's ``BENCH_FLAME_TAG``, e.g. ``before`` / ``after``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import throughput
from bench.env import BenchEnv, Part, stop, wait_until

RATE_HZ = 250
# (substring of a frame's file, label); the innermost frame that matches wins.
LIBRARIES = (  # py-spy names a frame ``func (path/inside/site-packages.py:line)``
    ("(psycopg2/", "psycopg2 (driver)"),
    ("(sqlalchemy/", "SQLAlchemy"),
    ("(redis/", "redis-py"),
    ("(kombu/", "kombu (messaging)"),
    ("(billiard/", "billiard (pool IPC)"),
    ("(celery/", "Celery"),
    ("(pythonjsonlogger/", "logging (JSON)"),
    ("(logging/", "logging (JSON)"),
    ("(json/", "json"),
    ("(uuid.py", "uuid"),
    ("(bench/", "bench hooks"),
    ("(tasks/", "teamdesk tasks/"),
    ("(ledger/", "teamdesk ledger/"),
    ("(teamdesk/", "teamdesk teamdesk/"),
    ("(worker/", "teamdesk worker/"),
    ("(dispatcher/", "teamdesk dispatcher/"),
)
# Pool children run billiard's workloop (or the bench's stats thread); main runs asynloop.
CHILD_MARKS = ("(billiard/pool.py", "_flush_forever (bench/")


def classify(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):  # innermost first
        for needle, label in LIBRARIES:
            if needle in frame:
                return label
    return "other (interpreter, stdlib)"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("bench.cpu_profile needs py-spy (pip install py-spy)")
    return found


def profile_drain(env: BenchEnv, part: Part, label: str, n: int) -> dict[str, Any]:
    """Like throughput.drain, with py-spy attached while the backlog drains."""
    stats_dir = env.stats_dir(label)
    worker = env.worker(part, f"w-{label}", concurrency=2, stats=stats_dir)
    worker.wait_event("worker.started", timeout=120)
    out = env.workdir / f"{label}.pyspy"
    spy = subprocess.Popen(
        [
            py_spy(),
            "record",
            "--pid",
            str(worker.pid),
            "--subprocesses",
            "--rate",
            str(RATE_HZ),
            "--format",
            "raw",
            "--output",
            str(out),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    flame = flame_graph(worker.pid) if label == "cpu-export" else None
    wait_until(lambda: env.backlog(part) == 0, 600, 0.1, f"{label} to drain")
    for sampler in (spy, flame):
        if sampler is not None:
            sampler.send_signal(2)  # SIGINT: py-spy writes its output and exits
            sampler.wait(timeout=60)
    stop(worker)
    return aggregate(out.read_text() if out.exists() else "", n)


def flame_graph(worker_pid: int) -> subprocess.Popen[bytes] | None:
    """A second py-spy on the worker's first pool child, writing an SVG flame graph."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children")
    pids = children.read_text().split() if children.exists() else []
    if not pids:
        return None
    tag = os.environ.get("BENCH_FLAME_TAG", "")
    name = f"flame_export_child{'_' + tag if tag else ''}.svg"
    target = Path(__file__).with_name("results") / name
    return subprocess.Popen(
        [
            py_spy(),
            "record",
            "--pid",
            pids[0],
            "--rate",
            str(RATE_HZ),
            "--format",
            "flamegraph",
            "--output",
            str(target),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def aggregate(raw: str, n: int) -> dict[str, Any]:
    """py-spy raw lines: ``process <pid>:"<cmd>";frame;frame... <count>`` (it names the
    root pid for every process, so the role is told apart by the stack)."""
    per_role: dict[str, Counter[str]] = {"main": Counter(), "child": Counter()}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        role = "child" if any(mark in stack for mark in CHILD_MARKS) else "main"
        per_role[role][classify(stack)] += int(count)
    us_per_sample = 1e6 / RATE_HZ
    return {
        role: {lib: round(c * us_per_sample / n) for lib, c in counts.most_common()}
        for role, counts in per_role.items()
    }


def run_cpu_profile(env: BenchEnv, n: int = 3000) -> dict[str, Any]:
    part = env.part("cpu")
    app = env.activate(part)
    refs = throughput.seed_world(part.engine)
    result: dict[str, Any] = {}
    for kind in ("noop", "export", "reminder"):
        if kind == "noop":
            throughput.publish_noops(app, n)
        else:
            create = throughput.create_exports if kind == "export" else throughput.create_reminders
            create(part.engine, refs, n)
            throughput.publish_ready(part, app)
        result[kind] = profile_drain(env, part, f"cpu-{kind}", n)
        time.sleep(0.5)
    return result


def format_result(result: dict[str, Any]) -> str:
    lines = [
        "Active-sample microseconds per task (py-spy; includes run-queue and some socket",
        "waits: read as shares, not CPU seconds), by innermost library",
    ]
    for kind, roles in result.items():
        for role, libs in roles.items():
            total = sum(libs.values())
            lines.append(f"== {kind} / worker {role}: {total} us per task")
            lines += [f"   {lib:<32} {us:>6}" for lib, us in libs.items() if us]
    return "\n".join(lines)


def main() -> None:
    logging.getLogger("teamdesk").setLevel(logging.ERROR)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    env = BenchEnv()
    try:
        result = run_cpu_profile(env, n)
    finally:
        env.close()
    text = format_result(result)
    print(text)
    target = Path(__file__).with_name("results") / "cpu_profile.json"
    target.parent.mkdir(exist_ok=True)
    target.write_text(json.dumps(result, indent=2) + "\n")
    target.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
