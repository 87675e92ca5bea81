"""``make bench`` stays runnable: its modules import, and every figure the issue asks for is
in its key list, produced by one of its parts and checked against its goal."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# Issue 7: the keys latest.json must hold.
ISSUE_KEYS = {
    "p1_export_ratio",
    "p1_reminder_ratio",
    "p2_export_ratio_to_copy",
    "p2_peak_rss_mib",
    "p3_scan_ms_10k",
    "p3_scan_ms_1m",
    "p3_scan_ratio_1m_10k",
    "p4_recovery_s",
    "p5_heartbeat_gone_s",
    "p5_idle_exit_s",
    "scaling",
    "machine",
    "goals",
}
GOAL_KEYS = {
    "p1_export_ratio",
    "p1_reminder_ratio",
    "p2_export_ratio_to_copy",
    "p3_scan_ratio_1m_10k",
    "p3_scan_ms_1m",
    "p4_recovery_s",
    "p5_heartbeat_gone_s",
    "p5_idle_exit_s",
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


def test_every_goal_is_checked() -> None:
    from bench.report import GOALS

    assert {key for key, _, _ in GOALS} == GOAL_KEYS


def test_table_and_goals_from_sample_results() -> None:
    from bench import report

    sample: dict[str, Any] = {
        "p1_export_ratio": 0.71,
        "p1_reminder_ratio": 0.4,
        "p2_export_ratio_to_copy": 0.5,
        "p3_scan_ratio_1m_10k": 1.1,
        "p3_scan_ms_1m": 12.0,
        "p4_recovery_s": 20.0,
        "p5_heartbeat_gone_s": 0.01,
        "p5_idle_exit_s": 2.0,
        "scaling": [{"processes": 1, "tasks_per_s": 10.0}],
    }
    goals = report.goals(sample)
    sample["goals"] = goals
    assert {k for k, g in goals.items() if not g["met"]} == {
        "p1_reminder_ratio",
        "p3_scan_ms_1m",
    }
    text = report.table(sample)
    assert "`p1_export_ratio` | 0.71" in text.replace(")", "")
    assert "`-c 1`" in text
