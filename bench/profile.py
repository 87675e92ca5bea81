"""Where a task's time goes: ``python -m bench.profile [N]`` (also ``bench.run --profile``).

Runs N bare no-ops, N small exports and N reminders through one ``-c 2`` worker with the
round-trip tracer on (:mod:`bench.tracer`), and prints, per task, the wall time of each
step, each PostgreSQL transaction (pre-ping, BEGIN, statements, COMMIT) and each Redis
command, next to the CPU each process spent. The tracer adds a little time to every
call, so these runs are never used for the throughput figures.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from bench import export_speed, throughput
from bench.env import BenchEnv

TRACE_ENV: dict[str, Any] = {"BENCH_TRACE": "1"}


def read_traces(directory: Path) -> dict[str, Any]:
    tasks = 0
    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    where: dict[str, list[str]] = {}
    for path in directory.glob("trace-*.json"):
        data = json.loads(path.read_text())
        tasks += data["tasks"]
        for key, value in data["seconds"].items():
            seconds[key] = seconds.get(key, 0.0) + value
        for key, value in data["calls"].items():
            calls[key] = calls.get(key, 0) + value
        where.update(data.get("where", {}))
    per_task = (
        {
            key: {"us": round(seconds[key] * 1e6 / tasks), "calls": round(calls[key] / tasks, 2)}
            for key in sorted(seconds)
        }
        if tasks
        else {}
    )
    return {"tasks": tasks, "per_task": per_task, "redis_call_sites": where}


def run_profile(env: BenchEnv, n: int = 1000) -> dict[str, Any]:
    part = env.part("profile")
    app = env.activate(part)
    refs = throughput.seed_world(part.engine)
    out: dict[str, Any] = {}
    for kind in ("noop", "export", "reminder"):
        if kind == "noop":
            throughput.publish_noops(app, n)
        elif kind == "export":
            throughput.create_exports(part.engine, refs, n)
            throughput.publish_ready(part, app)
        else:
            throughput.create_reminders(part.engine, refs, n)
            throughput.publish_ready(part, app)
        result = throughput.drain(env, part, f"profile-{kind}", n, extra_env=TRACE_ENV)
        trace = read_traces(Path(result["stats_dir"]))
        out[kind] = {"run": result, "trace": trace, "split": split(trace["per_task"])}
    out["export_10k"] = profile_big_export(env)
    return out


def profile_big_export(env: BenchEnv, repeats: int = 3) -> dict[str, Any]:
    """The P2 export (10,000 rows, 20 batches) traced, ``repeats`` times in a row."""
    part = env.part("profile-p2")
    team, user = export_speed.seed_team(part.engine, export_speed.SMALL_ROWS, "Profile 10k")
    label = "profile-export-10k"
    durations, _, _ = export_speed.run_exports(env, part, label, team, user, repeats, **TRACE_ENV)
    run = {
        "tasks_per_s": round(len(durations) / sum(durations), 2),
        "cpu_us_per_task": "-",
        "execute_ms_all": [round(d * 1000, 1) for d in durations],
    }
    trace = read_traces(env.stats_dir(label))
    return {"run": run, "trace": trace, "split": split(trace["per_task"])}


PG_PARTS = (  # statement name prefix -> part of the task (first match wins)
    ("pg:completed_reread", "completed/skipped re-read (PostgreSQL)"),
    ("pg:claim", "claim (PostgreSQL)"),
    ("pg:progress", "progress: ledger write"),
    ("pg:complete", "completion (PostgreSQL)"),
    ("pg:COMMIT (after complete", "completion (PostgreSQL)"),
    ("pg:reminder.notification", "completion (PostgreSQL)"),
    ("pg:reminder.bump_version", "completion (PostgreSQL)"),
    ("pg:reminder.event", "completion (PostgreSQL)"),
)


def split(per_task: dict[str, dict[str, float]]) -> dict[str, int]:
    """The pool child's wall time per task, in disjoint parts (microseconds)."""

    def us(key: str) -> float:
        return per_task.get(key, {}).get("us", 0.0)

    parts: dict[str, float] = {}
    pg_total = 0.0
    for key, value in per_task.items():
        if not key.startswith("pg:"):
            continue
        pg_total += value["us"]
        part = next(
            (p for prefix, p in PG_PARTS if key.startswith(prefix)), "body reads (PostgreSQL)"
        )
        parts[part] = parts.get(part, 0.0) + value["us"]
    parts["progress: queue report (Redis update_state + event)"] = us(
        "step:queueing.report_progress"
    )
    parts["JSON log lines"] = us("step:log_event")
    accounted = pg_total + sum(
        us(k)
        for k in (
            "step:queueing.report_progress",
            "step:log_event",
        )
    )
    if "step:execute" in per_task:
        parts["python in execute() (rest)"] = us("step:execute") - accounted
        parts["Celery in the child (trace, result store: Redis GET + SETEX/PUBLISH)"] = us(
            "celery_child_task"
        ) - us("step:execute")
    else:
        parts["Celery in the child (trace, result store: Redis GET + SETEX/PUBLISH)"] = us(
            "celery_child_task"
        )
    return {k: round(v) for k, v in parts.items() if round(v)}


def format_profile(profile: dict[str, Any]) -> str:
    lines = []
    for kind, data in profile.items():
        run = data["run"]
        lines.append(
            f"== {kind}: {run['tasks_per_s']} tasks/s (traced), "
            f"CPU us/task {run['cpu_us_per_task']}"
        )
        lines.append("   -- pool child wall time per task, by part:")
        for part, value in data.get("split", {}).items():
            lines.append(f"   {part:<70} {value:>7} us")
        lines.append("   -- every traced call, per task:")
        for key, value in data["trace"]["per_task"].items():
            lines.append(f"   {key:<70} {value['us']:>7} us  x{value['calls']}")
    return "\n".join(lines)


def main() -> None:
    logging.getLogger("teamdesk").setLevel(logging.ERROR)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    env = BenchEnv()
    try:
        profile = run_profile(env, n)
    finally:
        env.close()
    print(format_profile(profile))
    save(profile)


def save(profile: dict[str, Any]) -> None:
    target = Path(__file__).with_name("results") / "profile.json"
    target.parent.mkdir(exist_ok=True)
    target.write_text(json.dumps(profile, indent=2) + "\n")
    target.with_suffix(".txt").write_text(format_profile(profile) + "\n")


if __name__ == "__main__":
    main()
