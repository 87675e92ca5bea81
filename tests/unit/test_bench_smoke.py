"""``make bench`` stays runnable: its modules import, and every figure the issue asks for is
in its key list, produced by one of its parts and checked against its goal."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# Issue 7 (and the dispatch redesign's P6): the keys latest.json must hold.
ISSUE_KEYS = {
    "p1_export_ratio",
    "p1_reminder_ratio",
    "p2_export_ratio_to_copy",
    "p2_peak_rss_mib",
    # Issue 38: the same export with the object store.
    "p2_export_ratio_to_copy_s3",
    "p3_scan_ms_10k",
    "p3_scan_ms_1m",
    "p3_scan_ratio_1m_10k",
    "p4_recovery_s",
    "p5_heartbeat_gone_s",
    "p5_idle_exit_s",
    "p6_start_ms_p50",
    "p6_start_ms_p95",
    "p6_dispatch_ratio_1w",
    "p6_dispatch_ratio_3w",
    "p6_fair_start_s",
    "p6_broker_depth_max",
    "scaling",
    "machine",
    "goals",
    # Issue 13: the hot path and the ledger's growth.
    "p1_overhead_cpu_us",
    "p7_api_creates_per_s",
    "p8_claim_ratio_10m_audit",
    "p8_scan_ratio_10m_audit",
    # Issue 15: what the worker's Prometheus metrics cost.
    "p1_metrics_cost",
    "p1_metrics_us_per_task",
    # Issue 26: the task bodies alone, beside the end-to-end ratios.
    "p1_body_us_export",
    "p1_body_cpu_us_export",
    "p1_body_us_reminder",
    "p1_body_cpu_us_reminder",
    # Issue 24: a fill's cost at tenant scale.
    "p9_fill_ms_empty",
    "p9_fill_ms_100k_future",
    "p9_fill_ratio_100k_future",
    "p9_fill_ms_10k_ready",
    "p9_capped_fills",
    "p9_reminder_start_p50_ms_100k_future",
    "p9_capped_start_s",
}
GOAL_KEYS = {
    "p1_export_ratio",
    "p1_reminder_ratio",
    "p2_export_ratio_to_copy",
    "p2_export_ratio_to_copy_s3",
    "p3_scan_ratio_1m_10k",
    "p3_scan_ms_1m",
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
    "p1_overhead_cpu_us",
    "p1_export_vs_procrastinate",
    "p1_tracing_cost",
    "p7_api_creates_per_s",
    "p8_claim_ratio_10m_audit",
    "p8_scan_ratio_10m_audit",
    "p1_metrics_cost",
    "p9_fill_ms_empty",
    "p9_fill_ms_100k_future",
    "p9_fill_ratio_100k_future",
    "p9_fill_ms_10k_ready",
    "p9_capped_fills",
    "p9_reminder_start_p50_ms_100k_future",
    "p9_capped_start_s",
}


@pytest.mark.parametrize(
    "module",
    [
        "bench.run",
        "bench.env",
        "bench.throughput",
        "bench.export_speed",
        "bench.scan_cost",
        "bench.resilience",
        "bench.report",
        "bench.profile",
        "bench.tracer",
        "bench.cpu_profile",
        "bench.dispatch_path",
        "bench.api_rate",
        "bench.audit_growth",
        "bench.metrics_cost",
        "bench.body_cost",
        "bench.tenant_scale",
    ],
)
def test_bench_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_required_keys_cover_the_issue() -> None:
    from bench.run import REQUIRED_KEYS

    assert set(REQUIRED_KEYS) >= ISSUE_KEYS


def test_every_required_key_is_written_by_a_part() -> None:
    from bench.run import REQUIRED_KEYS

    source = "\n".join(p.read_text() for p in BENCH.glob("*.py") if p.name != "run.py")
    run = (BENCH / "run.py").read_text()
    for key in REQUIRED_KEYS:
        assert f'"{key}"' in source or f'results["{key}"]' in run, key


def test_every_part_has_a_runner() -> None:
    from bench.run import PARTS, parse, part_runners

    for argv in ([], ["--quick"]):
        assert set(part_runners(parse(argv))) == set(PARTS)
    assert "p6" in PARTS
    assert parse(["--only", "p6"]).only == "p6"


def test_quick_sizes_are_smaller() -> None:
    from bench.dispatch_path import Sizes

    full, quick = Sizes(), Sizes.quick()
    assert (full.latency, full.ratio, full.backlog) == (100, 2000, 10_000)
    assert all(q < f for q, f in zip(vars(quick).values(), vars(full).values(), strict=True))


def test_percentile_is_nearest_rank() -> None:
    from bench.dispatch_path import percentile

    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile([3.0], 95) == 3.0
    assert percentile([5.0, 1.0, 9.0], 50) == 5.0


def test_every_goal_is_checked() -> None:
    from bench.report import GOALS

    assert {key for key, _, _ in GOALS} == GOAL_KEYS


def test_table_and_goals_from_sample_results() -> None:
    from bench import report

    sample: dict[str, Any] = {
        "p1_export_ratio": 0.71,
        "p1_reminder_ratio": 0.4,
        "p2_export_ratio_to_copy": 0.5,
        "p2_export_ratio_to_copy_s3": 0.7,
        "p3_scan_ratio_1m_10k": 1.1,
        "p3_scan_ms_1m": 12.0,
        "p4_recovery_s": 20.0,
        "p5_heartbeat_gone_s": 0.01,
        "p5_idle_exit_s": 2.0,
        "p6_start_ms_p50": 12.0,
        "p6_start_ms_p95": 140.0,
        "p6_scheduled_late_ms_p95": 30.0,
        "p6_dispatch_ratio_1w": 0.95,
        "p6_dispatch_ratio_3w": 0.8,
        "p6_fair_start_s": 0.1,
        "p6_broker_depth_max": 13,
        "p6_broker_depth_bound": 12,
        "p1_overhead_cpu_us": 2500,
        "p1_export_vs_procrastinate": 0.9,
        "p7_api_creates_per_s": 450.0,
        "p8_claim_ratio_10m_audit": 1.1,
        "p8_scan_ratio_10m_audit": 1.05,
        "p1_tracing_cost": 0.98,
        "p1_metrics_cost": 0.96,
        "p9_fill_ms_empty": 1.9,
        "p9_fill_ms_100k_future": 230.0,
        "p9_fill_ratio_100k_future": 121.0,
        "p9_fill_ms_10k_ready": 8.0,
        "p9_capped_fills": 1,
        "p9_reminder_start_p50_ms_100k_future": 374.0,
        "p9_capped_start_s": 0.04,
        "scaling": [{"processes": 1, "tasks_per_s": 10.0}],
    }
    goals = report.goals(sample)
    sample["goals"] = goals
    assert set(goals) == GOAL_KEYS
    assert {k for k, g in goals.items() if not g["met"]} == {
        "p1_export_ratio",  # issue 13: >= 0.75
        "p1_overhead_cpu_us",
        "p1_export_vs_procrastinate",  # issue 26: >= 1.0
        "p2_export_ratio_to_copy",  # issue 13: >= 0.6
        "p1_reminder_ratio",
        "p3_scan_ms_1m",
        "p6_start_ms_p95",
        "p6_dispatch_ratio_3w",
        "p6_broker_depth_max",
        "p1_metrics_cost",  # issue 15: >= 0.97
        "p9_fill_ms_100k_future",  # issue 24: <= 5 ms
        "p9_fill_ratio_100k_future",
        "p9_reminder_start_p50_ms_100k_future",  # issue 24: <= 20 ms
    }
    text = report.table(sample)
    assert "`p1_export_ratio` | 0.71" in text.replace(")", "")
    assert "`p6_broker_depth_bound` | 12" in text.replace(")", "")
    assert "`-c 1`" in text
    assert "`p1_metrics_cost` | 0.96 | ratio | >= 0.97 | **no**" in text.replace(")", "")


def test_p1_runs_metrics_and_traces_off_and_on_in_both_orders() -> None:
    from bench.throughput import p1_order

    assert p1_order(2) == [
        "noop",
        "export",
        "export_metrics",
        "export_tracing",
        "reminder",
        "noop",
        "export_tracing",
        "export_metrics",
        "export",
        "reminder",
        "noop",
    ]


def test_p6_detail_renders() -> None:
    from bench import report

    spread = {"p50": 1.0, "p95": 2.0, "max": 3.0, "min": 0.5}
    side = {
        "tasks_per_s": 100.0,
        "creation_share_of_drain": 0.3,
        "beat_cpu_cores": 0.1,
        "dispatcher_pg_cpu_cores": 0.05,
    }
    pair = {
        "workers": 1,
        "ratio": 0.97,
        "foreign_cpu_cores": 0.0,
        "prefilled": side,
        "dispatched": side,
    }
    detail = {
        "start": {
            k: spread for k in ("start_ms", "created_to_stamped_ms", "stamped_to_claimed_ms")
        },
        "scheduled": {"late_ms": spread},
        "ratio_1w": pair,
        "ratio_3w": {**pair, "workers": 3},
        "fair": {"b_start_s_all": [0.05], "team_a_when_b_created": [{"waiting": 9000}]},
        "depth": {
            "samples": 10,
            "lists_max": 9,
            "lists_mean": 5.0,
            "bound": 12,
            "processes": 6,
            "unacked_max": 6,
        },
        "backlog": {"tasks": 10_000, "tasks_per_s": 150.0},
    }
    text = "\n".join(report.p6_md(detail))
    assert "| 3 x `-c 2` | 100.0 | 100.0 | 0.97 | 0.3 | 0.1 + 0.05 | 0.0 |" in text
    assert "bound 12" in text
    assert report.p6_md({}) == []


def test_the_metrics_cost_is_measured_in_a_fresh_process() -> None:
    from bench import metrics_cost
    from teamdesk import metrics

    before = metrics._multiprocess_dir
    us = metrics_cost.per_task_us(2000)
    assert 0 < us < 1000  # microseconds per task: a few dozen at most on any machine
    assert metrics._multiprocess_dir == before  # this process was not switched


def test_p7_detail_renders() -> None:
    from bench import report

    detail = {
        "runs": [
            {
                "processes": 2,
                "creates_per_s": 250.0,
                "cpu_us_per_create": {"api": 3000, "postgres": 2500, "clients": 900},
            }
        ]
    }
    assert report.p7_md(detail)[2:4] == [
        "| API processes | creations/s | api | postgres | clients |",
        "|---:|---:|---:|---:|---:|",
    ]
    assert report.p7_md(detail)[4] == "| 2 | 250.0 | 3000 | 2500 | 900 |"
    assert report.p7_md({"runs": [{"processes": 1, "creates_per_s": 1.0}]}) == []
