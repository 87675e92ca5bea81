"""Every duration setting has a sane range, both ends checked at start: a value outside it
is one line naming the variable and its range, exit code 2. Before, only a lower bound was
checked, so ``SHUTDOWN_TIMEOUT_S=1e9`` (a drain of 31 years) was accepted."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import Field, fields
from typing import Any

import pytest

from teamdesk.config import DURATIONS, ConfigError, Settings, Span, load_settings

DURATION_FIELDS = [f for f in fields(Settings) if f.name.endswith(("_s", "_days"))]


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as refused:
        load_settings(env)
    return str(refused.value)


@pytest.mark.parametrize("field", DURATION_FIELDS, ids=lambda f: f.name.upper())
def test_every_duration_setting_has_a_range_holding_its_default(field: Field[Any]) -> None:
    span = DURATIONS.get(field.name.upper())
    assert span is not None, f"{field.name.upper()} has no range in teamdesk.config.DURATIONS"
    unit = "days" if field.name.endswith("_days") else "seconds"
    assert span.low < span.high and span.unit == unit
    default = getattr(Settings(), field.name)
    assert span.low <= default <= span.high
    assert getattr(load_settings({}), field.name) == default


def test_the_ranges_name_only_settings_that_exist() -> None:
    assert set(DURATIONS) == {f.name.upper() for f in DURATION_FIELDS}


@pytest.mark.parametrize(("name", "span"), sorted(DURATIONS.items()), ids=sorted(DURATIONS))
def test_both_ends_of_every_range_are_accepted_and_past_them_refused(name: str, span: Span) -> None:
    attr = name.lower()
    assert getattr(load_settings({name: f"{span.low:g}"}), attr) == span.low
    assert getattr(load_settings({name: f"{span.high:g}"}), attr) == span.high
    for outside in (span.low - 0.001, span.high + 0.001):
        assert refusal({name: repr(outside)}) == f"{name} must be {span}, got {repr(outside)!r}"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SHUTDOWN_TIMEOUT_S": "1e9"},
            "SHUTDOWN_TIMEOUT_S must be from 0 to 3600 seconds, got '1e9'",
        ),
        (
            {"SHUTDOWN_TIMEOUT_S": "-1"},
            "SHUTDOWN_TIMEOUT_S must be from 0 to 3600 seconds, got '-1'",
        ),
        (
            {"STALE_AFTER_S": "0.5"},
            "STALE_AFTER_S must be from 1 to 86400 seconds, got '0.5'",
        ),
        (
            {"STALE_AFTER_S": "86401"},
            "STALE_AFTER_S must be from 1 to 86400 seconds, got '86401'",
        ),
        (
            {"SCAN_INTERVAL_S": "0.05"},
            "SCAN_INTERVAL_S must be from 0.1 to 300 seconds, got '0.05'",
        ),
        (
            {"HEARTBEAT_TTL_S": "3600"},
            "HEARTBEAT_TTL_S must be from 1 to 600 seconds, got '3600'",
        ),
        (
            {"RETRY_BASE_DELAY_S": "86400"},
            "RETRY_BASE_DELAY_S must be from 0 to 3600 seconds, got '86400'",
        ),
        (
            {"EXPORT_READ_BUDGET_S": "0"},
            "EXPORT_READ_BUDGET_S must be from 1 to 3600 seconds, got '0'",
        ),
        (
            {"TASK_RETENTION_DAYS": "1e9"},
            "TASK_RETENTION_DAYS must be from 1 to 3650 days, got '1e9'",
        ),
        (
            {"AUDIT_RETENTION_DAYS": "0.5"},
            "AUDIT_RETENTION_DAYS must be from 1 to 3650 days, got '0.5'",
        ),
    ],
)
def test_a_duration_out_of_range_names_the_variable_and_its_range(
    env: dict[str, str], message: str
) -> None:
    assert refusal(env) == message


def test_values_the_deployments_and_tests_use_are_accepted() -> None:
    """The deploy files' values, the soak's short timings and the shortest the process
    tests hand their subprocesses (harness/processes.py) stay valid."""
    for env in (
        {"STALE_AFTER_S": "120", "SCAN_INTERVAL_S": "3", "HEARTBEAT_TTL_S": "20"},
        {"STALE_AFTER_S": "6", "SCAN_INTERVAL_S": "1", "HEARTBEAT_TTL_S": "3"},
        {"STALE_AFTER_S": "1.0", "HEARTBEAT_TTL_S": "1.5", "SCAN_INTERVAL_S": "0.1"},
        {"RETRY_BASE_DELAY_S": "0.05", "SHUTDOWN_TIMEOUT_S": "2.0"},
        {"SHUTDOWN_TIMEOUT_S": "95", "EXPORT_READ_BUDGET_S": "1.0"},
    ):
        load_settings(env)


def test_the_process_stops_with_one_line_and_exit_code_2() -> None:
    env = {**os.environ, "SHUTDOWN_TIMEOUT_S": "1e9"}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "health"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "teamdesk-tasks: configuration error: "
        "SHUTDOWN_TIMEOUT_S must be from 0 to 3600 seconds, got '1e9'\n"
    )
