"""The unit tests stand on their own: `pytest tests/unit` passes with PostgreSQL and Redis
unreachable (only the integration and process tests ask for the services)."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.processes import ROOT
from tests.support.queues import closed_port


def test_unit_tests_pass_with_no_service_reachable() -> None:
    db_port, redis_port = closed_port(), closed_port()
    env = {
        **os.environ,
        "TEST_ADMIN_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{db_port}/postgres",
        "TEST_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{db_port}/teamdesk",
        "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "error" not in done.stdout.splitlines()[-1]
