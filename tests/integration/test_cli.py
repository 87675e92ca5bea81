"""``teamdesk-tasks`` task commands against real PostgreSQL: demo-seed, token, submit,
status, retry, cancel, watch, migrate --create-database, and --help everywhere.

Most calls run ``cli.main.main`` in-process (the ``settings`` fixture points it at the
test's database); the exit-code and no-traceback checks run the real console script."""

from __future__ import annotations

import io
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from cli import demo, localrun
from cli.commands import local as local_commands
from cli.commands.watch import follow, progress_line
from cli.main import build_parser, main
from ledger import lease, service
from ledger.tokens import user_for_token
from teamdesk import logs
from teamdesk.config import Settings
from tests.support import databases
from tests.support.factories import World, add_ticket, add_tickets, task_row
from tests.support.processes import free_port, settings_env

CLI = str(Path(sys.executable).parent / "teamdesk-tasks")


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture(autouse=True)
def _drop_cli_log_handler() -> Iterator[None]:
    """main() installs the JSON log handler on capsys's stream; remove it afterwards."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logs._JsonHandler):
            root.removeHandler(handler)


@pytest.fixture
def cli(settings: Settings, capsys: pytest.CaptureFixture[str]) -> Any:
    def run(*args: str) -> Result:
        capsys.readouterr()
        code = main(list(args))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


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


def count_tasks(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM background_tasks")).scalar_one())


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar_one()


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


# -- demo-seed and tokens ----------------------------------------------------------


def test_demo_seed_creates_the_team_once_and_issues_fresh_tokens(
    cli: Any, engine: sa.Engine
) -> None:
    started = time.monotonic()
    first = cli("demo-seed", "--json")
    took = time.monotonic() - started
    assert first.code == 0, first.err
    seeded = json.loads(first.out)
    team_id = uuid.UUID(seeded["team_id"])
    assert seeded["created"] is True and seeded["tickets"] == demo.DEFAULT_TICKETS
    assert took < 2.0

    roles = {u["email"]: u["role"] for u in seeded["users"]}
    assert roles == {demo.STAFF_EMAIL: "STAFF", demo.CUSTOMER_EMAIL: "CUSTOMER"}
    stats = dict(
        scalar(
            engine,
            """SELECT json_build_object(
                 'tickets', count(*), 'statuses', count(DISTINCT status),
                 'priorities', count(DISTINCT priority), 'assigned', count(assignee_id),
                 'with_comma', count(*) FILTER (WHERE title LIKE '%,%'),
                 'with_quote', count(*) FILTER (WHERE title LIKE '%"%'),
                 'formula_like', count(*) FILTER (WHERE left(title, 1) IN ('=', '+', '-', '@')),
                 'days', extract(day FROM max(created_at) - min(created_at)))
               FROM tickets WHERE team_id = :team""",
            team=team_id,
        )
    )
    assert stats["tickets"] == demo.DEFAULT_TICKETS
    assert stats["statuses"] == 4 and stats["priorities"] == 4
    assert 0 < stats["assigned"] < stats["tickets"]
    assert stats["with_comma"] > 0 and stats["with_quote"] > 0 and stats["formula_like"] > 0
    assert stats["days"] >= 28

    second = cli("demo-seed")
    assert second.code == 0, second.err
    assert "already seeded" in second.out and str(team_id) in second.out
    assert scalar(engine, "SELECT count(*) FROM teams WHERE name = :n", n=demo.TEAM_NAME) == 1
    assert scalar(engine, "SELECT count(*) FROM tickets") == demo.DEFAULT_TICKETS
    tokens = [line.split("token ")[1] for line in second.out.splitlines() if "token tdk_" in line]
    assert len(tokens) == 2
    first_tokens = {u["token"] for u in seeded["users"]}
    assert not first_tokens & set(tokens)
    with engine.connect() as conn:
        owners = {user_for_token(conn, t) for t in [*tokens, *first_tokens]}
    assert owners == {uuid.UUID(u["user_id"]) for u in seeded["users"]}


def test_token_create_prints_a_working_token_once(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    result = cli("token", "create", email_of(engine, world.staff_id), "--name", "laptop")
    assert result.code == 0, result.err
    raw = result.out.strip()
    assert raw.startswith("tdk_") and "\n" not in raw
    with engine.connect() as conn:
        assert user_for_token(conn, raw) == world.staff_id
    assert scalar(engine, "SELECT name FROM api_tokens") == "laptop"

    missing = cli("token", "create", "nobody@example.test")
    assert (missing.code, missing.out) == (1, "")
    assert missing.err == "teamdesk-tasks token create: User not found.\n"
    assert scalar(engine, "SELECT count(*) FROM api_tokens") == 1


# -- submit --------------------------------------------------------------------------


def test_submit_export_writes_a_waiting_row_and_prints_its_id(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    staff = email_of(engine, world.staff_id)
    filters = '{"status": ["OPEN", "PENDING"], "q": "printer, \\"jam\\""}'
    result = cli(
        "submit", "export", "--user", staff, "--team", str(world.team_id), "--filters", filters
    )
    assert result.code == 0, result.err
    row = task_row(engine, uuid.UUID(result.out.strip()))
    assert (row["kind"], row["status"], row["scope"], row["owner_id"]) == (
        "EXPORT",
        "WAITING",
        "TEAM",
        world.staff_id,
    )
    assert row["filters"] == {"status": ["OPEN", "PENDING"], "q": 'printer, "jam"'}
    assert row["dispatched_at"] is None  # the CLI never publishes

    customer = email_of(engine, world.customer_id)
    mine = cli(
        "submit",
        "export",
        "--user",
        customer,
        "--team",
        str(world.team_id),
        "--scope",
        "MINE",
        "--json",
    )
    assert mine.code == 0, mine.err
    view = json.loads(mine.out)
    assert (view["scope"], view["status"], view["owner_id"]) == (
        "MINE",
        "WAITING",
        str(world.customer_id),
    )
    assert count_tasks(engine) == 2


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ('{"status": ["NOPE"]}', "filters.status must be a non-empty list of OPEN, PENDING"),
        ('{"colour": "red"}', "filters may only contain status, priority"),
        ("[1, 2]", "filters must be a JSON object"),
        ('{"created_from": "2026-02-01", "created_to": "2026-01-01"}', "must not be after"),
    ],
)
def test_submit_export_with_bad_filters_exits_2_and_writes_nothing(
    cli: Any, engine: sa.Engine, world: World, filters: str, message: str
) -> None:
    staff = email_of(engine, world.staff_id)
    result = cli(
        "submit", "export", "--user", staff, "--team", str(world.team_id), "--filters", filters
    )
    assert (result.code, result.out) == (2, "")
    assert result.err.startswith("teamdesk-tasks submit export: ") and message in result.err
    assert count_tasks(engine) == 0


def test_submit_refusals_say_why_and_write_nothing(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    team = str(world.team_id)
    outsider = cli(
        "submit", "export", "--user", email_of(engine, world.outsider_id), "--team", team
    )
    assert (outsider.code, outsider.err) == (1, "teamdesk-tasks submit export: Team not found.\n")
    customer = email_of(engine, world.customer_id)
    team_scope = cli("submit", "export", "--user", customer, "--team", team)
    assert team_scope.code == 1
    assert team_scope.err == (
        "teamdesk-tasks submit export: only staff may export the whole team's tickets\n"
    )
    unknown = cli("submit", "export", "--user", "ghost@example.test", "--team", team)
    assert (unknown.code, unknown.err) == (1, "teamdesk-tasks submit export: User not found.\n")
    assert count_tasks(engine) == 0


def test_submit_reminder_writes_a_scheduled_row(cli: Any, engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
    staff = email_of(engine, world.staff_id)
    base = ["submit", "reminder", "--user", staff, "--team", str(world.team_id)]
    result = cli(*base, "--ticket", str(ticket), "--run-at", "2030-01-02T03:04:05Z", "--json")
    assert result.code == 0, result.err
    view = json.loads(result.out)
    assert (view["kind"], view["status"], view["run_at"]) == (
        "REMINDER",
        "WAITING",
        "2030-01-02T03:04:05Z",
    )
    assert view["filters"] == {"ticket_id": str(ticket)}

    elsewhere = cli(*base, "--ticket", str(uuid.uuid4()))
    assert elsewhere.code == 2
    assert "ticket_id must name a ticket of this team" in elsewhere.err
    customer = email_of(engine, world.customer_id)
    refused = cli(
        "submit",
        "reminder",
        "--user",
        customer,
        "--team",
        str(world.team_id),
        "--ticket",
        str(ticket),
    )
    assert refused.code == 1 and "only staff may schedule reminders" in refused.err
    assert count_tasks(engine) == 1


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


def test_an_unreachable_database_is_one_clear_line(settings: Settings) -> None:
    closed = free_port()
    url = f"postgresql://postgres@127.0.0.1:{closed}/nowhere"
    for args in (
        ["status", str(uuid.uuid4())],
        ["watch", str(uuid.uuid4())],
        ["submit", "export", "--user", "a@b.test", "--team", str(uuid.uuid4())],
        ["demo-seed"],
        ["token", "create", "a@b.test"],
    ):
        result = run_script(settings, *args, DATABASE_URL=url)
        assert result.code == 1, (args, result.err)
        assert "cannot use PostgreSQL (OperationalError); check DATABASE_URL" in result.err
        assert "Traceback" not in result.err and str(closed) not in result.err


# -- status, retry, cancel -----------------------------------------------------------


def test_status_prints_the_task_as_json_for_the_owner_and_the_operator(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    with engine.begin() as conn:
        task_id = service.create_export(conn, world.team_id, world.customer_id, "MINE", {})
    operator = cli("status", str(task_id))
    assert operator.code == 0, operator.err
    view = json.loads(operator.out)
    assert (view["id"], view["status"], view["run"], view["progress"]) == (
        str(task_id),
        "WAITING",
        0,
        0,
    )
    assert "result_csv" not in view and view["has_csv"] is False

    owner = cli("status", str(task_id), "--user", email_of(engine, world.customer_id))
    assert owner.code == 0 and json.loads(owner.out) == view
    # A MINE export is not visible to other staff, nor to outsiders.
    for other in (world.staff_id, world.outsider_id):
        hidden = cli("status", str(task_id), "--user", email_of(engine, other))
        assert (hidden.code, hidden.err) == (1, "teamdesk-tasks status: Task not found.\n")
    missing = cli("status", str(uuid.uuid4()))
    assert (missing.code, missing.err) == (1, "teamdesk-tasks status: Task not found.\n")


def test_cancel_then_retry(cli: Any, engine: sa.Engine, world: World) -> None:
    staff = email_of(engine, world.staff_id)
    with engine.begin() as conn:
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    early = cli("retry", str(task_id), "--user", staff)
    assert (early.code, early.err) == (
        1,
        "teamdesk-tasks retry: only FAILED or CANCELLED tasks can be retried\n",
    )
    outsider = cli("cancel", str(task_id), "--user", email_of(engine, world.outsider_id))
    assert (outsider.code, outsider.err) == (1, "teamdesk-tasks cancel: Task not found.\n")

    cancelled = cli("cancel", str(task_id), "--user", staff)
    assert (cancelled.code, cancelled.out) == (0, f"{task_id}: CANCELLED\n")
    assert task_row(engine, task_id)["status"] == "CANCELLED"
    again = cli("cancel", str(task_id), "--user", staff)
    assert (again.code, again.err) == (
        1,
        "teamdesk-tasks cancel: only WAITING or RUNNING tasks can be cancelled\n",
    )

    retried = cli("retry", str(task_id), "--user", staff)
    assert retried.code == 0, retried.err
    assert retried.out == f"{task_id}: run 2 is WAITING; the dispatcher will publish it\n"
    row = task_row(engine, task_id)
    assert (row["status"], row["run"], row["attempts"], row["dispatched_at"]) == (
        "WAITING",
        1,
        0,
        None,
    )


# -- watch ---------------------------------------------------------------------------


def _claimed_export(engine: sa.Engine, world: World, rows: int = 3) -> lease.Lease:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, rows)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        claim = lease.claim(conn, task_id, 0)
    assert claim is not None
    return claim.lease


def test_watch_a_completed_task_exits_0_at_100_percent(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    held = _claimed_export(engine, world)
    with engine.begin() as conn:
        lease.report_progress(conn, held, 40)
        lease.complete_export(conn, held, "id,title\n", "3 rows")
    result = cli("watch", str(held.task_id), "--interval", "0.05", "--timeout", "10")
    assert result.code == 0, result.err
    assert result.out == "[##########] 100% COMPLETED run 1 attempt 1\nresult: 3 rows\n"


def test_watch_a_failed_task_exits_1_with_its_last_error(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    held = _claimed_export(engine, world)
    with engine.begin() as conn:
        lease.report_progress(conn, held, 60)
        assert lease.report_failure(conn, held, final=True, message="the export failed; try again")
    staff = email_of(engine, world.staff_id)
    result = cli("watch", str(held.task_id), "--user", staff, "--interval", "0.05")
    assert result.code == 1
    assert result.out == "[######....] 60% FAILED run 1 attempt 1\n"
    assert result.err == "task FAILED: the export failed; try again\n"


def test_watch_gives_up_at_its_timeout(cli: Any, engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    result = cli("watch", str(task_id), "--interval", "0.05", "--timeout", "0.2")
    assert result.code == 3
    assert result.out == "[..........] 0% WAITING run 1\n"
    assert result.err == "timed out after 0.2 s; the task is still WAITING\n"


def _views(*states: tuple[str, int, int, int]) -> list[dict[str, Any]]:
    return [
        {
            "status": s,
            "progress": p,
            "run": r,
            "attempts": a,
            "last_error": None,
            "result_summary": "9 rows",
        }
        for s, p, r, a in states
    ]


def _replay(views: list[dict[str, Any] | None], tty: bool) -> tuple[int, str, str]:
    pending = list(views)
    out, err = io.StringIO(), io.StringIO()
    code = follow(
        lambda: pending.pop(0),
        interval=0,
        timeout=None,
        out=out,
        err=err,
        tty=tty,
        sleep=lambda _s: None,
    )
    return code, out.getvalue(), err.getvalue()


def test_watch_prints_one_line_per_change_and_redraws_on_a_terminal() -> None:
    views: list[dict[str, Any] | None] = [
        *_views(("WAITING", 0, 1, 0), ("WAITING", 0, 1, 0), ("RUNNING", 0, 1, 1)),
        None,  # the database did not answer this time
        *_views(("RUNNING", 50, 1, 1), ("RUNNING", 50, 1, 1), ("COMPLETED", 100, 1, 1)),
    ]
    code, out, err = _replay(list(views), tty=False)
    assert code == 0 and err == ""
    assert out.splitlines() == [
        "[..........] 0% WAITING run 2",
        "[..........] 0% RUNNING run 2 attempt 1",
        "[#####.....] 50% RUNNING run 2 attempt 1",
        "[##########] 100% COMPLETED run 2 attempt 1",
        "result: 9 rows",
    ]
    code, out, _ = _replay(list(views), tty=True)
    assert code == 0
    assert out.count("\r") == 4 and "\n" not in out.split("result:")[0][:-1]
    assert out.endswith("\r[##########] 100% COMPLETED run 2 attempt 1\x1b[K\nresult: 9 rows\n")


def test_progress_line_bounds() -> None:
    line = progress_line({"status": "RUNNING", "progress": 99, "run": 0, "attempts": 3})
    assert line == "[#########.] 99% RUNNING run 1 attempt 3"


# -- migrate --create-database --------------------------------------------------------


def test_migrate_can_create_the_database_first(settings: Settings) -> None:
    name = f"tdcli_{uuid.uuid4().hex[:10]}"
    url = databases._with_db(databases.ADMIN_URL, name)
    try:
        first = run_script(settings, "migrate", "--create-database", DATABASE_URL=url)
        assert first.code == 0, first.err
        assert first.out.startswith("database created\nschema at revision ")
        again = run_script(settings, "migrate", "--create-database", DATABASE_URL=url)
        assert again.code == 0 and again.out.startswith("schema at revision ")
        seeded = run_script(settings, "demo-seed", "--tickets", "10", DATABASE_URL=url)
        assert seeded.code == 0 and "created with 10 tickets" in seeded.out
    finally:
        databases.drop_database(name)


# -- the local cluster's pieces (the run itself: tests/process/test_make_run.py) ------


def test_the_procfile_runs_the_documented_cluster() -> None:
    processes = localrun.read_procfile(localrun.PROCFILE)
    assert list(processes) == ["exports", "mixed", "beat", "flower", "api"]
    words = {name: shlex.split(command) for name, command in processes.items()}
    for name, queues in (
        ("exports", "exports"),
        ("mixed", "reminders,exports"),
    ):
        assert words[name][:2] == ["env", f"WORKER_INSTANCE_ID=local-{name}"]
        assert words[name][2:] == [
            "celery",
            "-A",
            "tasks",
            "worker",
            "-n",
            f"{name}@%h",
            "-Q",
            queues,
        ]
    assert words["beat"] == ["celery", "-A", "tasks", "--quiet", "beat"]
    assert words["flower"][:4] == ["celery", "-A", "tasks", "flower"]
    assert "--address=127.0.0.1" in words["flower"]
    assert words["api"][:2] == ["teamdesk-tasks", "api"]
    assert all(localrun.exec_command(c).startswith("exec ") for c in processes.values())


def test_child_env_keeps_flower_password_off_command_lines(tmp_path: Path) -> None:
    options = localrun.LocalOptions(
        api_port=1234,
        flower_port=2345,
        flower_password="s3cret",
        password_from_env=True,
        procfile=tmp_path / "Procfile",
        tickets=0,
    )
    env = localrun.child_env(options, {"FLOWER_PASSWORD": "s3cret", "PATH": "/usr/bin"})
    assert "FLOWER_PASSWORD" not in env  # Flower refuses FLOWER_* names it does not know
    assert env["FLOWER_BASIC_AUTH"] == "admin:s3cret"
    assert (env["TEAMDESK_API_PORT"], env["TEAMDESK_FLOWER_PORT"]) == ("1234", "2345")
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert "s3cret" not in " ".join(localrun.read_procfile(localrun.PROCFILE).values())


def test_run_local_says_which_service_is_missing(settings: Settings) -> None:
    closed = free_port()
    no_db = run_script(
        settings, "run-local", DATABASE_URL=f"postgresql://postgres@127.0.0.1:{closed}/x"
    )
    assert no_db.code == 1 and "Traceback" not in no_db.err
    assert no_db.err.startswith(
        "teamdesk-tasks run-local: cannot create or open database 'x' (OperationalError); "
        "check DATABASE_URL"
    )
    assert str(closed) not in no_db.err
    no_redis = run_script(settings, "run-local", REDIS_URL=f"redis://127.0.0.1:{closed}/0")
    assert no_redis.code == 1 and "Traceback" not in no_redis.err
    assert "cannot reach Redis (ConnectionError); check REDIS_URL and start it" in no_redis.err


def test_run_local_refuses_a_port_in_use(settings: Settings) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run_script(settings, "run-local", "--flower-port", str(port))
    assert result.code == 1
    assert result.err == (
        f"teamdesk-tasks run-local: port {port} on 127.0.0.1 is in use; choose another with "
        "--flower-port or TEAMDESK_FLOWER_PORT\n"
    )
