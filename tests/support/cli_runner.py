"""Helpers for the ``teamdesk-tasks`` command-line tests (tests/integration/test_cli_*.py):
what a run printed and returned, the real console script run as a subprocess, and small
reads of the test's database. The in-process runner is the ``cli`` fixture
(tests/integration/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from harness.processes import settings_env
from teamdesk.config import Settings

CLI = str(Path(sys.executable).parent / "teamdesk-tasks")


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_script(settings: Settings, *args: str, **env: str) -> Result:
    proc = subprocess.run(
        [CLI, *args],
        env=settings_env(settings, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def email_of(engine: sa.Engine, user_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT email FROM users WHERE id = :id"), {"id": user_id}
            ).scalar_one()
        )


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar_one()
