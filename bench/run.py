"""``make bench``: every part in one run, then the table, ``results/latest.json``,
``results/chart.png`` and ``RESULTS.md``.

Usage: ``python -m bench.run [--quick] [--only p1,p3,...] [--rounds N] [--profile]``.
``--quick`` shrinks every part (a smoke run; its figures are not comparable). ``--profile``
also runs the traced breakdown of :mod:`bench.profile` (``results/profile.json``).
Exit code 1 when a part failed (its keys are then missing and the error is in
``errors``); goals that are not met do not change the exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from bench import (
    api_rate,
    audit_growth,
    dispatch_path,
    export_speed,
    report,
    resilience,
    scan_cost,
    tenant_scale,
    throughput,
)
from bench.env import BenchEnv
from harness import databases

PARTS = ("p1", "scaling", "p2", "p3", "p4", "p5", "p6", "p7", "p8", "p9")

# Every key latest.json must hold after a full, successful run.
REQUIRED_KEYS = (
    "p1_export_ratio",
    "p1_reminder_ratio",
    "p1_bare_tasks_per_s",
    "p1_export_tasks_per_s",
    "p1_reminder_tasks_per_s",
    "p1_overhead_cpu_us",
    "p1_export_vs_procrastinate",
    "p1_metrics_cost",
    "p1_metrics_us_per_task",
    "p1_tracing_cost",
    "p1_body_us_export",
    "p1_body_cpu_us_export",
    "p1_body_us_reminder",
    "p1_body_cpu_us_reminder",
    "p2_export_ratio_to_copy",
    "p2_export_ratio_to_copy_s3",
    "p2_peak_rss_mib",
    "p3_scan_ms_10k",
    "p3_scan_ms_1m",
    "p3_scan_ratio_1m_10k",
    "p4_recovery_s",
    "p5_heartbeat_gone_s",
    "p5_idle_exit_s",
    "p6_start_ms_p50",
    "p6_start_ms_p95",
    "p6_scheduled_late_ms_p95",
    "p6_dispatch_ratio_1w",
    "p6_dispatch_ratio_3w",
    "p6_fair_start_s",
    "p6_broker_depth_max",
    "p6_broker_depth_bound",
    "p7_api_creates_per_s",
    "p8_claim_ratio_10m_audit",
    "p8_scan_ratio_10m_audit",
    "p9_fill_ms_empty",
    "p9_fill_ms_100k_future",
    "p9_fill_ratio_100k_future",
    "p9_fill_ms_10k_ready",
    "p9_capped_fills",
    "p9_reminder_start_p50_ms_100k_future",
    "p9_capped_start_s",
    "scaling",
    "machine",
    "goals",
)


def part_runners(args: argparse.Namespace) -> dict[str, Callable[[BenchEnv], dict[str, Any]]]:
    n = 500 if args.quick else 5000
    return {
        "p1": lambda env: throughput.run_p1(env, n=n, rounds=args.rounds),
        "scaling": lambda env: throughput.run_scaling(env, n=300 if args.quick else 1500),
        "p2": export_speed.run_p2,
        "p3": lambda env: scan_cost.run_p3(env, large=100_000 if args.quick else 1_000_000),
        "p4": resilience.run_p4,
        "p5": resilience.run_p5,
        "p6": lambda env: dispatch_path.run_p6(
            env, dispatch_path.Sizes.quick() if args.quick else dispatch_path.Sizes()
        ),
        "p7": api_rate.run_p7,
        "p8": lambda env: audit_growth.run_p8(
            env, audit_rows=1_000_000 if args.quick else audit_growth.AUDIT_ROWS
        ),
        "p9": lambda env: tenant_scale.run_p9(
            env,
            future_teams=10_000 if args.quick else tenant_scale.FUTURE_TEAMS,
            ready_teams=1_000 if args.quick else tenant_scale.READY_TEAMS,
        ),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts")
    parser.add_argument("--rounds", type=int, default=2, help="P1 rounds (bare, export, reminder)")
    parser.add_argument("--profile", action="store_true", help="also run bench.profile")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra celery worker argument for every worker (an experiment: the run then "
        "writes partial.json), e.g. --worker-arg=--prefetch-multiplier=4",
    )
    return parser.parse_args(argv)


def notes_for(results: dict[str, Any]) -> list[str]:
    notes = []
    foreign = results.get("p1_foreign_cpu_cores")
    if isinstance(foreign, float) and foreign > 0.25:
        notes.append(
            f"Other processes kept {foreign} cores busy on average during P1: the absolute "
            "tasks/s are low and noisy; the ratios are measured side by side."
        )
    spread = results.get("p1_detail", {}).get("bare_spread")
    if isinstance(spread, float) and spread > 1.3:
        notes.append(
            f"P1: the bare runs differ by a factor {spread} (max/min): treat the ratios as "
            "+/- that much."
        )
    if results.get("p2_detail", {}).get("export_csv_equals_copy") is False:
        notes.append(
            "P2: the export's CSV body differs from COPY's; the ratio compares unlike work."
        )
    p6 = results.get("p6_detail", {})
    for key in ("ratio_1w", "ratio_3w"):
        pair = p6.get(key)
        if not pair:
            continue
        share = pair["dispatched"]["creation_share_of_drain"]
        if share > 0.8:
            notes.append(
                f"P6 {key}: creating the tasks took {share} of the dispatcher-fed drain: the "
                "rate is the creators', not the dispatcher's."
            )
        if pair["foreign_cpu_cores"] > 0.5:
            notes.append(
                f"P6 {key}: other processes kept {pair['foreign_cpu_cores']} cores busy "
                "during the quieter of two pairs: treat the ratio with care."
            )
    repaired = {k: v for k, v in p6.get("logs", {}).get("scans", {}).items() if v}
    if repaired:
        notes.append(f"P6: beat's scans had to repair runs: {repaired} (see p6_detail.logs).")
    early = p6.get("scheduled", {}).get("claimed_before_run_at")
    if early:
        notes.append(f"P6: {early} reminders were claimed before their run_at.")
    for name, error in results.get("errors", {}).items():
        notes.append(f"{name} failed: {error}")
    return notes


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    wanted = [p for p in args.only.split(",") if p]
    unknown = set(wanted) - set(PARTS)
    if unknown:
        raise SystemExit(f"bench: unknown part(s) {sorted(unknown)}; choose from {PARTS}")
    runners = part_runners(args)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    env = BenchEnv()
    env.extra_worker_args = list(args.worker_arg)
    results["worker_extra_args"] = env.extra_worker_args
    try:
        admin = databases.admin_engine()
        results["machine"] = report.machine(admin, env.redis)
        results["code"] = report.code_fingerprint()
        admin.dispose()
        for name in wanted:
            began = time.monotonic()
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            try:
                results.update(runners[name](env))
            except Exception as exc:  # keep going: the other parts still measure
                traceback.print_exc()
                errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"bench: {name} done in {time.monotonic() - began:.0f} s", file=sys.stderr)
        if args.profile:
            from bench import profile

            traced = profile.run_profile(env, 300 if args.quick else 1000)
            profile.save(traced)
            results["profile_split_us"] = {k: v["split"] for k, v in traced.items()}
    finally:
        env.close()
    runs = results.get("p1_detail", {}).get("runs", {})
    foreign = [r["foreign_cpu_cores"] for kind in runs.values() for r in kind]
    if foreign:
        results["p1_foreign_cpu_cores"] = round(sum(foreign) / len(foreign), 2)
    results["goals"] = report.goals(results)
    results["errors"] = errors
    results["notes"] = notes_for(results)
    results["duration_s"] = round(time.monotonic() - started)
    results["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    results["command"] = "python -m bench.run " + " ".join(sys.argv[1:])
    results["quick"] = args.quick
    return results


def save(results: dict[str, Any], full: bool) -> str:
    """A full run replaces latest.json, chart.png and RESULTS.md; a partial or quick run
    writes results/partial.json only, so a smoke run never replaces real figures."""
    report.RESULTS_DIR.mkdir(exist_ok=True)
    target = report.RESULTS_DIR / ("latest.json" if full else "partial.json")
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    tmp.replace(target)
    if not full:
        return f"bench/results/{target.name}"
    report.chart(results, report.RESULTS_DIR / "chart.png")
    report.write_results_md(results)
    return "bench/results/latest.json, bench/results/chart.png, bench/RESULTS.md"


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.getLogger("teamdesk").setLevel(logging.ERROR)  # the scan's own task.stalled lines
    results = run(args)
    full = (
        not args.quick
        and not args.worker_arg
        and set(args.only.split(",")) >= set(PARTS)
        and not results["errors"]
    )
    written = save(results, full)
    print(report.table(results))
    met = [k for k, g in results["goals"].items() if g["met"]]
    missed = [k for k, g in results["goals"].items() if not g["met"]]
    print(f"\ngoals met: {', '.join(met) or '-'}")
    print(f"goals not met: {', '.join(missed) or '-'}")
    for note in results["notes"]:
        print(f"note: {note}")
    print(f"bench: {results['duration_s']} s; wrote {written}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
