"""``teamdesk-tasks token create|list|revoke`` and demo-seed's tokens, against real
PostgreSQL: an expiry per token, a listing that never shows a secret, revocation that
takes effect at once, and demo-seed leaving one live token per demo user and name.

The commands run ``cli.main.main`` in-process; the ``settings`` fixture points it at the
test's database."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from cli import demo
from cli.commands import task_commands
from harness.factories import World
from ledger import tokens
from ledger.tokens import user_for_token
from tests.support.cli_runner import email_of, scalar
from tests.support.tokens import expire, token_row

pytestmark = pytest.mark.usefixtures("drop_cli_log_handler")


def _days(engine: sa.Engine, raw: str) -> float:
    return float(
        scalar(
            engine,
            "SELECT extract(epoch FROM expires_at - created_at) / 86400 FROM api_tokens"
            " WHERE id = :id",
            id=token_row(engine, raw)["id"],
        )
    )


def usage_error(cli: Any, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run a command whose arguments argparse refuses (exit 2); returns its stderr."""
    with pytest.raises(SystemExit) as stopped:
        cli(*args)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_token_create_sets_an_expiry(
    cli: Any, engine: sa.Engine, world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    staff = email_of(engine, world.staff_id)
    default = cli("token", "create", staff)
    week = cli("token", "create", staff, "--name", "ci", "--expires-in-days", "7")
    assert (default.code, week.code) == (0, 0), (default.err, week.err)
    assert _days(engine, default.out.strip()) == pytest.approx(90)
    assert _days(engine, week.out.strip()) == pytest.approx(7)
    for bad in ("0", "366", "seven"):
        assert "--expires-in-days" in usage_error(
            cli, capsys, "token", "create", staff, "--expires-in-days", bad
        )
    assert scalar(engine, "SELECT count(*) FROM api_tokens") == 2
    # the CLI's defaults are the ledger's (kept apart only so --help stays light)
    assert task_commands.TOKEN_TTL_DAYS == tokens.DEFAULT_TTL_DAYS
    assert task_commands.TOKEN_MAX_TTL_DAYS == tokens.MAX_TTL_DAYS


def test_token_list_shows_each_token_but_never_its_secret(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    staff = email_of(engine, world.staff_id)
    raws = [cli("token", "create", staff, "--name", name).out.strip() for name in "abc"]
    cli("token", "create", email_of(engine, world.customer_id), "--name", "theirs")
    cli("token", "revoke", str(token_row(engine, raws[1])["id"]))
    expire(engine, raws[2])
    with engine.begin() as conn:
        user_for_token(conn, raws[0])  # records its use

    listed = cli("token", "list", staff, "--json")
    assert listed.code == 0, listed.err
    rows = json.loads(listed.out)
    assert [(r["name"], r["state"]) for r in rows] == [
        ("a", "active"),
        ("b", "revoked"),
        ("c", "expired"),
    ]
    assert [r["id"] for r in rows] == [str(token_row(engine, raw)["id"]) for raw in raws]
    assert rows[0]["last_used_at"] is not None and rows[1]["last_used_at"] is None
    assert set(rows[0]) == set(task_commands.TOKEN_COLUMNS)

    table = cli("token", "list", staff)
    assert table.code == 0, table.err
    lines = table.out.splitlines()
    assert lines[0].split() == list(task_commands.TOKEN_COLUMNS) and len(lines) == 4
    for output in (listed.out, table.out):
        for raw in raws:
            assert raw not in output and token_row(engine, raw)["token_hash"] not in output
        assert "theirs" not in output

    missing = cli("token", "list", "nobody@example.test")
    assert (missing.code, missing.err) == (1, "teamdesk-tasks token list: User not found.\n")


def test_token_revoke_takes_effect_at_once(
    cli: Any, engine: sa.Engine, world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = cli("token", "create", email_of(engine, world.staff_id)).out.strip()
    token_id = str(token_row(engine, raw)["id"])
    revoked = cli("token", "revoke", token_id)
    assert (revoked.code, revoked.out) == (0, f"{token_id}: revoked\n"), revoked.err
    with engine.connect() as conn:
        assert user_for_token(conn, raw) is None
    again = cli("token", "revoke", token_id)
    assert (again.code, again.out) == (0, f"{token_id}: already revoked\n")

    unknown = cli("token", "revoke", str(uuid.uuid4()))
    assert (unknown.code, unknown.out) == (1, "")
    assert unknown.err == "teamdesk-tasks token revoke: Token not found.\n"
    assert "must be a UUID" in usage_error(cli, capsys, "token", "revoke", "not-a-uuid")


def test_demo_seed_revokes_its_earlier_tokens_of_the_same_name(cli: Any, engine: sa.Engine) -> None:
    first = json.loads(cli("demo-seed", "--json", "--tickets", "3").out)
    assert first["revoked_tokens"] == 0
    other = json.loads(cli("demo-seed", "--json", "--token-name", "laptop").out)
    second = cli("demo-seed")
    assert second.code == 0, second.err
    assert 'Revoked 2 earlier "demo-seed" token(s) of these users' in second.out

    new = [line.split("token ")[1] for line in second.out.splitlines() if "token tdk_" in line]
    with engine.connect() as conn:
        assert {user_for_token(conn, u["token"]) for u in first["users"]} == {None}
        assert None not in {user_for_token(conn, t) for t in new}
        # a token of another name is left alone
        assert None not in {user_for_token(conn, u["token"]) for u in other["users"]}
    live = scalar(
        engine,
        "SELECT count(*) FROM api_tokens WHERE name = 'demo-seed' AND revoked_at IS NULL",
    )
    assert live == 2  # one per demo user, whatever the number of runs
    assert {u["email"] for u in first["users"]} == {demo.STAFF_EMAIL, demo.CUSTOMER_EMAIL}
