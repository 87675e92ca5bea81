"""The abuse limits' configuration (docs/design.md, "HTTP API"): documented defaults, 0
turning a limit off, and bad values naming their variable; the bucket arithmetic."""

from __future__ import annotations

import pytest

from api.limits import Rule
from teamdesk.config import ConfigError, load_settings


def test_defaults_and_values() -> None:
    default = load_settings({})
    assert (
        default.team_max_unfinished,
        default.api_rate_per_min,
        default.api_rate_burst,
        default.auth_failures_per_min,
    ) == (1000, 120, 30, 30)
    assert (
        default.api_read_rate_per_min,
        default.api_read_burst,
        default.team_exports_per_day,
        default.team_export_bytes_per_day,
        default.export_max_bytes,
    ) == (600, 120, 1000, 2 << 30, 32 << 20)
    off = load_settings(
        {"TEAM_MAX_UNFINISHED": "0", "API_RATE_PER_MIN": "0", "AUTH_FAILURES_PER_MIN": "0"}
    )
    assert (off.team_max_unfinished, off.api_rate_per_min, off.auth_failures_per_min) == (0, 0, 0)
    assert not Rule("token", off.api_rate_per_min, off.api_rate_burst).enabled


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TEAM_MAX_UNFINISHED", "-1"),
        ("TEAM_MAX_UNFINISHED", "lots"),
        ("API_RATE_PER_MIN", "2.5"),
        ("API_RATE_BURST", "0"),
        ("AUTH_FAILURES_PER_MIN", "-3"),
        ("API_READ_RATE_PER_MIN", "many"),
        ("API_READ_BURST", "0"),
        ("TEAM_EXPORTS_PER_DAY", "-1"),
        ("TEAM_EXPORT_BYTES_PER_DAY", "2GB"),
        ("EXPORT_MAX_BYTES", "-5"),
    ],
)
def test_bad_values_name_their_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_settings({name: value})


def test_a_rule_refills_one_token_per_interval() -> None:
    assert Rule("token", 120, 30).interval_us == 500_000  # 120 a minute: one every 0.5 s
    assert Rule("auth", 30, 30).interval_us == 2_000_000
    assert Rule("fast", 120_000_000, 1).interval_us == 1  # never below a microsecond
