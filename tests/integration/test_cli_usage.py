"""``teamdesk-tasks`` as a command line: --help on every command and subcommand (with
the defaults the code uses), bad arguments exit 2 without a traceback and write nothing,
and an unreachable database is one clear line.

The help runs ``cli.main.main`` in-process; the exit-code and no-traceback checks run
the real console script against the test's database."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from cli import demo
from cli.commands import local as local_commands
from cli.main import build_parser, main
from harness.processes import free_port
from teamdesk.config import Settings
from tests.support.api_helpers import count_tasks
from tests.support.cli_runner import run_script

pytestmark = pytest.mark.usefixtures("drop_cli_log_handler")


# -- help ----------------------------------------------------------------------------


def _command_paths() -> list[list[str]]:
    paths: list[list[str]] = []

    def walk(parser: Any, prefix: list[str]) -> None:
        for action in parser._actions:
            if getattr(action, "choices", None) and hasattr(action, "_name_parser_map"):
                for name, child in action.choices.items():
                    paths.append([*prefix, name])
                    walk(child, [*prefix, name])

    walk(build_parser(), [])
    return paths


def test_every_command_and_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    paths = _command_paths()
    names = {" ".join(p) for p in paths}
    expected = {
        "api",
        "migrate",
        "health",
        "scan",
        "demo-seed",
        "run-local",
        "submit",
        "submit export",
        "submit reminder",
        "status",
        "watch",
        "retry",
        "cancel",
        "token",
        "token create",
    }
    assert expected <= names
    for path in paths:
        with pytest.raises(SystemExit) as stopped:
            main([*path, "--help"])
        out = capsys.readouterr().out
        assert stopped.value.code == 0, path
        assert out.startswith(f"usage: teamdesk-tasks {' '.join(path)}"), path


def test_the_help_defaults_match_the_code() -> None:
    assert local_commands.DEFAULT_TICKETS == demo.DEFAULT_TICKETS


# -- bad arguments and an unreachable database ---------------------------------------


def test_bad_arguments_exit_2_without_a_traceback(settings: Settings, engine: sa.Engine) -> None:
    cases = [
        (["status", "not-a-uuid"], "argument ID: must be a UUID"),
        (
            ["submit", "export", "--user", "a@b.test", "--team", "42"],
            "argument --team: must be a UUID",
        ),
        (
            [
                "submit",
                "export",
                "--user",
                "a@b.test",
                "--team",
                str(uuid.uuid4()),
                "--filters",
                "{x",
            ],
            "argument --filters: must be JSON",
        ),
        (
            [
                "submit",
                "reminder",
                "--user",
                "a",
                "--team",
                str(uuid.uuid4()),
                "--ticket",
                str(uuid.uuid4()),
                "--run-at",
                "2030-01-01T00:00:00",
            ],
            "argument --run-at: must include a time zone",
        ),
        (
            ["watch", str(uuid.uuid4()), "--interval", "0"],
            "argument --interval: must be more than 0",
        ),
    ]
    for args, message in cases:
        result = run_script(settings, *args)
        assert result.code == 2, (args, result.err)
        assert message in result.err and "Traceback" not in result.err, args
    assert count_tasks(engine) == 0


def test_an_unreachable_database_is_one_clear_line_naming_the_cause(settings: Settings) -> None:
    """One line that says which: the port refused, the database or the role missing -
    never the password. Before, all of them printed "cannot use PostgreSQL
    (OperationalError)"."""
    closed = free_port()
    refused = f"postgresql://postgres:hunter2@127.0.0.1:{closed}/nowhere"
    for args in (
        ["status", str(uuid.uuid4())],
        ["watch", str(uuid.uuid4())],
        ["submit", "export", "--user", "a@b.test", "--team", str(uuid.uuid4())],
        ["demo-seed"],
        ["token", "create", "a@b.test"],
    ):
        result = run_script(settings, *args, DATABASE_URL=refused)
        assert result.code == 1, (args, result.err)
        assert (
            f"cannot use PostgreSQL: connection refused at 127.0.0.1:{closed}; check DATABASE_URL"
            in result.err
        ), args
        assert "Traceback" not in result.err and "hunter2" not in result.err
    base = settings.database_url.rsplit("/", 1)[0]
    for url, cause in (
        (f"{base}/teamdsk_{uuid.uuid4().hex[:6]}", 'database "teamdsk_'),
        (
            base.replace("postgres@", "nobody:hunter2@", 1) + "/postgres",
            'role "nobody" does not exist',
        ),
    ):
        result = run_script(settings, "status", str(uuid.uuid4()), DATABASE_URL=url)
        assert result.code == 1, result.err
        assert f"cannot use PostgreSQL: {cause}" in result.err, result.err
        assert "Traceback" not in result.err and "hunter2" not in result.err
