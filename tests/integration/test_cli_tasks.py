"""``teamdesk-tasks`` task commands against real PostgreSQL: token create, submit export
and reminder (what is written, and every refusal writing nothing, the team's cap on
unfinished tasks included), status, cancel and retry. Token list and revoke:
test_cli_tokens.py.

The commands run ``cli.main.main`` in-process; the ``settings`` fixture points it at the
test's database."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa

from cli.commands import task_commands
from harness.factories import World, add_ticket, task_row
from ledger import idempotency, service
from ledger.errors import MSG_TEAM_FULL
from ledger.tokens import user_for_token
from teamdesk import config, hooks
from teamdesk.config import Settings
from tests.support.api_helpers import count_tasks, task_in_state
from tests.support.cli_runner import email_of, scalar

pytestmark = pytest.mark.usefixtures("drop_cli_log_handler")


# -- tokens --------------------------------------------------------------------------


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


def test_submit_and_retry_refuse_past_the_team_cap_like_the_api(
    cli: Any, engine: sa.Engine, world: World, settings: Settings
) -> None:
    config.set_settings(settings.with_overrides(team_max_unfinished=2))
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
    failed = task_in_state(engine, world, "FAILED")  # finished: not counted
    staff = email_of(engine, world.staff_id)
    export = ["submit", "export", "--user", staff, "--team", str(world.team_id)]
    reminder = ["submit", "reminder", "--user", staff, "--team", str(world.team_id)]
    assert cli(*export).code == 0
    assert cli(*reminder, "--ticket", str(ticket)).code == 0
    before = task_row(engine, failed)
    for args, command in (
        (export, "submit export"),
        ([*reminder, "--ticket", str(ticket)], "submit reminder"),
        (["retry", str(failed), "--user", staff], "retry"),
    ):
        refused = cli(*args)
        assert (refused.code, refused.out) == (1, "")
        assert refused.err == f"teamdesk-tasks {command}: {MSG_TEAM_FULL}\n"
    assert count_tasks(engine) == 3
    assert task_row(engine, failed) == before


def test_submit_reminder_writes_a_scheduled_row(cli: Any, engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
    staff = email_of(engine, world.staff_id)
    base = ["submit", "reminder", "--user", staff, "--team", str(world.team_id)]
    when = (datetime.now(UTC) + timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    result = cli(*base, "--ticket", str(ticket), "--run-at", when, "--json")
    assert result.code == 0, result.err
    view = json.loads(result.out)
    assert (view["kind"], view["status"], view["run_at"]) == ("REMINDER", "WAITING", when)
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
    assert retried.out == (
        f"{task_id}: run 1 is WAITING, ready now (a retry does not keep a reminder's "
        "scheduled time); the dispatcher will publish it\n"
    )
    row = task_row(engine, task_id)
    assert (row["status"], row["run"], row["attempts"], row["dispatched_at"]) == (
        "WAITING",
        1,
        0,
        None,
    )


# -- idempotency keys ------------------------------------------------------------------


def _key_rows(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM idempotency_keys"))


def test_submit_with_the_same_key_prints_the_first_task_and_another_body_exits_2(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    staff, team = email_of(engine, world.staff_id), str(world.team_id)
    submit = ("submit", "export", "--user", staff, "--team", team, "--idempotency-key", "k-1")
    first, again = cli(*submit), cli(*submit)
    other = cli(*submit, "--scope", "MINE")
    assert (first.code, again.code) == (0, 0), again.err
    assert again.out == first.out and uuid.UUID(first.out.strip())
    assert (other.code, other.err) == (
        2,
        f"teamdesk-tasks submit export: {idempotency.MSG_KEY_REUSED}\n",
    )
    for key in ("a b", ""):  # an empty key is refused as the API refuses it
        bad = cli("submit", "export", "--user", staff, "--team", team, "--idempotency-key", key)
        assert (bad.code, bad.err) == (2, f"teamdesk-tasks submit export: {idempotency.MSG_KEY}\n")
    assert count_tasks(engine) == 1 and _key_rows(engine) == 1


@pytest.mark.parametrize("command", ["export", "reminder", "retry"])
def test_a_lost_answer_is_tried_again_with_the_same_key_and_done_once(
    cli: Any,
    engine: sa.Engine,
    world: World,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    """The commit happened but its answer was lost (a connection dropped after it, forced
    at the ``cli.after_commit`` point): the command tries again with its key and prints
    what the first attempt did; nothing is done twice."""
    monkeypatch.setattr(task_commands, "RETRY_PAUSE_S", 0.0)
    staff, team = email_of(engine, world.staff_id), f"{world.team_id}"
    failed = task_in_state(engine, world, "FAILED")
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
    args = {
        "export": ("submit", "export", "--user", staff, "--team", team),
        "reminder": (
            "submit",
            "reminder",
            "--user",
            staff,
            "--team",
            team,
            "--ticket",
            str(ticket),
        ),
        "retry": ("retry", str(failed), "--user", staff),
    }[command]
    keys: list[str] = []

    def lose_the_first_answer(key: str) -> None:
        keys.append(key)
        if len(keys) == 1:
            raise psycopg2.OperationalError("server closed the connection unexpectedly")

    with hooks.installed("cli.after_commit", lose_the_first_answer):
        result = cli(*args)
    assert result.code == 0, result.err
    assert len(keys) == 2 and keys[0] == keys[1]  # one key for the invocation
    assert "trying again (2 of 3) with the same idempotency key" in result.err
    assert count_tasks(engine) == (1 if command == "retry" else 2)  # the failed one, + 1
    if command == "retry":
        assert task_row(engine, failed)["run"] == 1 and "run 1 is WAITING" in result.out
    else:
        assert uuid.UUID(result.out.strip())
    assert _key_rows(engine) == 1
