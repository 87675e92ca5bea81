"""TEAMDESK_SKIP_BROWSER=1 skips the browser test with a reason, and makes
scripts/ensure_chromium.sh install nothing; without it (CI's default) the test runs."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.browser import ENSURE_SCRIPT, SKIP_ENV, skip_reason


@pytest.mark.parametrize("value", [None, "", "0", "true", "yes"])
def test_the_browser_test_runs_unless_skip_is_exactly_1(value: str | None) -> None:
    env = {"CI": "true"} if value is None else {"CI": "true", SKIP_ENV: value}
    assert skip_reason(env) is None


def test_skip_1_gives_a_reason_naming_the_variable_and_what_still_checks_progress() -> None:
    assert skip_reason({SKIP_ENV: "1"}) == (
        "TEAMDESK_SKIP_BROWSER=1: Chromium not used, Flower's task page not rendered "
        "(tests/process/test_flower_cancelled.py still checks what Flower's API shows)"
    )


def test_ensure_chromium_installs_nothing_when_skipped() -> None:
    # An empty PATH: were the script to look for chromium or apt-get, it would fail.
    env = {SKIP_ENV: "1", "PATH": "/nonexistent"}
    result = subprocess.run(
        ["/bin/bash", str(ENSURE_SCRIPT)], env=env, capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr == (
        "ensure_chromium: TEAMDESK_SKIP_BROWSER=1: not installing Chromium; "
        "tests/process/test_flower_browser.py will be skipped\n"
    )
