"""Helpers for the HTTP API tests: an in-process client, tokens for the world's users, the
create routes' URLs, and ledger rows in the states the routes care about (made through the
ledger itself)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_api
from harness.databases import as_api_role
from harness.factories import World, insert_task
from ledger import lease, service
from ledger.tokens import create_token
from teamdesk.config import Settings

USERS = ("staff", "staff2", "customer", "outsider")
BAD_TOKEN = "tdk_" + "x" * 43


def api_settings(settings: Settings) -> Settings:
    """``settings`` for the API: connected to a test clone as the API's own database role,
    as deployed (databases.as_api_role); the test's own engine stays the owner."""
    return settings.with_overrides(database_url=as_api_role(settings.database_url))


@contextmanager
def api_client(settings: Settings) -> Iterator[TestClient]:
    """The app built for ``settings``, served in-process (lifespan included), as the API's
    database role (:func:`api_settings`)."""
    app = create_api(api_settings(settings), configure_logging=False)
    with TestClient(app, raise_server_exceptions=True) as client:
        yield client


def make_tokens(engine: sa.Engine, world: World) -> dict[str, str]:
    """A fresh bearer token for each of the world's users, by name (see :data:`USERS`)."""
    ids = {
        "staff": world.staff_id,
        "staff2": world.staff2_id,
        "customer": world.customer_id,
        "outsider": world.outsider_id,
    }
    with engine.begin() as conn:
        return {name: create_token(conn, user_id, "api test") for name, user_id in ids.items()}


def exports_url(team_id: object) -> str:
    return f"/api/teams/{team_id}/exports"


def reminders_url(team_id: object) -> str:
    return f"/api/teams/{team_id}/reminders"


def bearer(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def count_tasks(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM background_tasks")).scalar_one())


def task_in_state(
    engine: sa.Engine,
    world: World,
    status: str,
    *,
    owner_id: uuid.UUID | None = None,
    scope: str = "TEAM",
    kind: str = "EXPORT",
    csv: str = "id\r\n",
) -> uuid.UUID:
    """A task in ``status``, reached through the ledger (claim, complete, fail, cancel)."""
    with engine.begin() as conn:
        task_id = insert_task(conn, world, kind=kind, scope=scope, owner_id=owner_id)
        if status == "WAITING":
            return task_id
        if status == "CANCELLED":
            service.cancel(conn, task_id, owner_id or world.staff_id)
            return task_id
        held = lease.claim(conn, task_id, 0, "test-host/api")
        assert held is not None
        if status == "COMPLETED":
            if kind == "EXPORT":
                lease.complete_export(conn, held.lease, csv, "1 row")
            else:
                lease.complete_in_transaction(conn, held.lease, "reminded")
        elif status == "FAILED":
            assert lease.report_failure(conn, held.lease, final=True, message="Export failed.")
        else:
            assert status == "RUNNING", status
    return task_id


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def silent_listener() -> Iterator[int]:
    """A 127.0.0.1 port that accepts connections (kernel backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


def waiting_on_a_team_lock(engine: sa.Engine) -> bool:
    """Whether a session waits for an advisory lock (a team's quota lock) in this database."""
    with engine.connect() as conn:
        waiting = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        )
        return bool(waiting.scalar_one())
