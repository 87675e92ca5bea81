"""API tokens in the ledger (ledger/tokens.py, docs/design.md "Ledger"), against real
PostgreSQL: every token expires (90 days by default, chosen per token, by the database's
clock), can be revoked at once, and records its last use at most once a minute without
ever waiting for another request holding the row."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from harness import databases
from harness.factories import World
from ledger.errors import InvalidInput, NotFound
from ledger.migrate import upgrade
from ledger.tokens import (
    DEFAULT_TTL_DAYS,
    MAX_TTL_DAYS,
    TOUCH_EVERY_S,
    create_token,
    list_tokens,
    resolve_token,
    revoke_token,
)
from teamdesk.db import make_engine
from tests.support.api_helpers import bearer
from tests.support.tokens import expire, new_token, token_row

# Detects a wait for a row lock: resolving a token must never wait at all.
NO_WAIT_LOCK_TIMEOUT = "5s"


def _days_left(engine: sa.Engine, raw: str) -> float:
    with engine.connect() as conn:
        return float(
            conn.execute(
                sa.text(
                    "SELECT extract(epoch FROM expires_at - created_at) / 86400"
                    " FROM api_tokens WHERE id = :id"
                ),
                {"id": token_row(engine, raw)["id"]},
            ).scalar_one()
        )


def test_tokens_expire_after_90_days_unless_told_otherwise(engine: sa.Engine, world: World) -> None:
    default = new_token(engine, world.staff_id)
    with engine.begin() as conn:
        week = create_token(conn, world.staff_id, "ci", ttl_days=7)
        for bad in (0, -1, MAX_TTL_DAYS + 1):
            with pytest.raises(InvalidInput):
                create_token(conn, world.staff_id, "bad", ttl_days=bad)
    assert DEFAULT_TTL_DAYS == 90
    assert _days_left(engine, default) == pytest.approx(90)
    assert _days_left(engine, week) == pytest.approx(7)


def test_an_expired_token_resolves_to_nobody(engine: sa.Engine, world: World) -> None:
    raw = new_token(engine, world.staff_id)
    with engine.connect() as conn:
        assert resolve_token(conn, raw) is not None
    expire(engine, raw, seconds_ago=1)  # one second past its end, by the database's clock
    with engine.connect() as conn:
        assert resolve_token(conn, raw) is None


def test_revoking_is_immediate_idempotent_and_needs_a_real_token(
    engine: sa.Engine, world: World
) -> None:
    raw = new_token(engine, world.staff_id)
    token_id = token_row(engine, raw)["id"]
    with engine.begin() as conn:
        assert revoke_token(conn, token_id) is True
        assert resolve_token(conn, raw) is None  # in the same transaction already
    first = token_row(engine, raw)["revoked_at"]
    with engine.begin() as conn:
        assert revoke_token(conn, token_id) is False
        with pytest.raises(NotFound):
            revoke_token(conn, uuid.uuid4())
    assert token_row(engine, raw)["revoked_at"] == first  # revoking twice keeps the first time


def test_listing_shows_state_and_times_never_the_hash(engine: sa.Engine, world: World) -> None:
    states = ("active", "revoked", "expired")
    raws = [new_token(engine, world.staff_id, state) for state in states]
    new_token(engine, world.customer_id)  # another user's: not listed
    with engine.connect() as conn:
        listed = list_tokens(conn, world.staff_id)
    assert [t["state"] for t in listed] == list(states)
    assert [t["name"] for t in listed] == [f"{state} token" for state in states]
    assert set(listed[0]) == {
        "id",
        "name",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
        "state",
    }
    shown = repr(listed)
    for raw in raws:
        assert raw not in shown and token_row(engine, raw)["token_hash"] not in shown


def test_last_use_is_written_at_most_once_a_minute(engine: sa.Engine, world: World) -> None:
    raw = new_token(engine, world.staff_id)
    assert token_row(engine, raw)["last_used_at"] is None
    with engine.begin() as conn:
        resolve_token(conn, raw)
    used = token_row(engine, raw)
    assert used["last_used_at"] is not None
    with engine.begin() as conn:
        for _ in range(5):
            assert resolve_token(conn, raw) is not None
    assert token_row(engine, raw)["xmin"] == used["xmin"]  # the row was not written again
    with engine.begin() as conn:  # a minute later, by the database's clock
        conn.execute(
            sa.text(
                "UPDATE api_tokens SET last_used_at = now() - make_interval(secs => :s)"
                " WHERE id = :id"
            ),
            {"s": TOUCH_EVERY_S + 1, "id": used["id"]},
        )
    with engine.begin() as conn:
        resolve_token(conn, raw)
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
    assert token_row(engine, raw)["last_used_at"] == now


def test_resolving_never_waits_for_a_request_touching_the_same_token(
    engine: sa.Engine, world: World
) -> None:
    raw = new_token(engine, world.staff_id)
    token_id = token_row(engine, raw)["id"]
    with engine.connect() as holder, engine.connect() as other:
        holder.execute(  # another request is recording this token's use, not yet committed
            sa.text("SELECT 1 FROM api_tokens WHERE id = :id FOR UPDATE"), {"id": token_id}
        )
        other.execute(sa.text(f"SET LOCAL lock_timeout = '{NO_WAIT_LOCK_TIMEOUT}'"))
        owner = resolve_token(other, raw)  # would raise LockNotAvailable after a wait
        assert owner is not None and owner.user_id == world.staff_id
        holder.rollback()
        other.rollback()


def test_the_api_records_the_last_use(client: TestClient, engine: sa.Engine, world: World) -> None:
    raw = new_token(engine, world.staff_id)
    url = f"/api/teams/{world.team_id}/tasks"
    assert client.get(url, headers=bearer(raw)).status_code == 200
    first = token_row(engine, raw)
    assert first["last_used_at"] is not None
    assert client.get(url, headers=bearer(raw)).status_code == 200
    assert token_row(engine, raw)["xmin"] == first["xmin"]  # reads did not become writes


@pytest.fixture
def empty_db(services: None) -> Iterator[str]:
    name, url = databases.empty_database(f"tdt{os.getpid()}_tokens")
    yield url
    databases.drop_database(name)


def test_tokens_older_than_the_migration_get_90_days_from_the_upgrade(empty_db: str) -> None:
    upgrade(empty_db, "0004")
    engine = make_engine(empty_db)
    try:
        with engine.begin() as conn:
            user = conn.execute(
                sa.text("INSERT INTO users (email, name) VALUES ('a@b', 'A') RETURNING id")
            ).scalar_one()
            conn.execute(
                sa.text("INSERT INTO api_tokens (token_hash, user_id) VALUES ('h', :u)"),
                {"u": user},
            )
        upgrade(empty_db)
        with engine.connect() as conn:
            days = conn.execute(
                sa.text("SELECT extract(epoch FROM expires_at - now()) / 86400 FROM api_tokens")
            ).scalar_one()
        assert float(days) == pytest.approx(90, abs=0.01)
    finally:
        engine.dispose()
