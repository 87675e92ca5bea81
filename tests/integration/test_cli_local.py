"""``teamdesk-tasks`` for a local cluster: demo-seed (the team once, fresh tokens on every
run), migrate --create-database, and run-local's pieces (the Procfile, the children's
environment, a missing service or a port in use said in one line). The run itself:
tests/process/test_make_run.py.

demo-seed runs ``cli.main.main`` in-process; the other commands run the real console
script against the test's database."""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from cli import demo, localrun
from harness import databases
from harness.processes import free_port
from ledger.tokens import user_for_token
from teamdesk.config import Settings
from tests.support.cli_runner import run_script, scalar

pytestmark = pytest.mark.usefixtures("drop_cli_log_handler")


# -- demo-seed -----------------------------------------------------------------------


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
    # Seconds, not a benchmark: about 1 s alone; the margin holds on a busy 2-core
    # machine running the suite in parallel (docs/decisions.md, "A test suite a person
    # can wait for").
    assert took < 6.0

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
    # The ticket a demo reminder is sent for: open, assigned to the staff user.
    reminder_ticket = seeded["reminder_ticket"]
    assert (
        scalar(
            engine,
            "SELECT t.status || ' ' || u.email FROM tickets t JOIN users u ON u.id = t.assignee_id "
            "WHERE t.id = :id AND t.team_id = :team",
            id=reminder_ticket,
            team=team_id,
        )
        == f"OPEN {demo.STAFF_EMAIL}"
    )

    second = cli("demo-seed")
    assert second.code == 0, second.err
    assert "already seeded" in second.out and str(team_id) in second.out
    assert f"reminder  ticket {reminder_ticket} (open, assigned to staff)" in second.out
    assert scalar(engine, "SELECT count(*) FROM teams WHERE name = :n", n=demo.TEAM_NAME) == 1
    assert scalar(engine, "SELECT count(*) FROM tickets") == demo.DEFAULT_TICKETS
    tokens = [line.split("token ")[1] for line in second.out.splitlines() if "token tdk_" in line]
    assert len(tokens) == 2
    first_tokens = {u["token"] for u in seeded["users"]}
    assert not first_tokens & set(tokens)
    with engine.connect() as conn:
        owners = {user_for_token(conn, t) for t in tokens}
        earlier = {user_for_token(conn, t) for t in first_tokens}
    assert owners == {uuid.UUID(u["user_id"]) for u in seeded["users"]}
    assert earlier == {None}  # revoked by the second run (tests/integration/test_cli_tokens.py)


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


def free_ports_args() -> list[str]:
    """run-local's two ports, free ones: the defaults may be taken by a running make run."""
    return ["--api-port", str(free_port()), "--flower-port", str(free_port())]


def test_run_local_says_which_service_is_missing(settings: Settings) -> None:
    closed = free_port()
    ports = free_ports_args()  # never 8000 / 5555: a developer's make run may hold them
    no_db = run_script(
        settings, "run-local", *ports, DATABASE_URL=f"postgresql://postgres@127.0.0.1:{closed}/x"
    )
    assert no_db.code == 1 and "Traceback" not in no_db.err
    assert no_db.err.startswith(
        "teamdesk-tasks run-local: cannot create or open database 'x': connection refused "
        f"at 127.0.0.1:{closed}; check DATABASE_URL"
    )
    no_redis = run_script(settings, "run-local", *ports, REDIS_URL=f"redis://127.0.0.1:{closed}/0")
    assert no_redis.code == 1 and "Traceback" not in no_redis.err
    assert no_redis.err == (
        f"teamdesk-tasks run-local: cannot reach Redis (connection refused at 127.0.0.1:{closed}) "
        f"on port {closed} "
        "(from REDIS_URL); check REDIS_URL and start it, e.g.: redis-server --daemonize yes "
        f"--bind 127.0.0.1 -::1 --port {closed} --save '' --appendonly no\n"
    )


def test_run_local_refuses_a_port_in_use(settings: Settings) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run_script(
            settings, "run-local", "--api-port", str(free_port()), "--flower-port", str(port)
        )
    assert result.code == 1
    assert result.err == (
        f"teamdesk-tasks run-local: port {port} on 127.0.0.1 is in use; choose another with "
        "--flower-port or TEAMDESK_FLOWER_PORT\n"
    )
