"""The API app as a whole, in-process: a task route with the database unreachable answers
503 without details, OpenAPI and /docs are served, the module-level app imports without
a database, the logs carry no token, body or CSV, and an unexpected error answers 500
without its text.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_api
from harness.factories import World
from harness.waiting import wait_for
from teamdesk.config import Settings
from tests.support.api_helpers import (
    BAD_TOKEN,
    api_client,
    bearer,
    closed_port,
    exports_url,
    task_in_state,
)

JOIN_TIMEOUT_S = 30

# --- the database going away under a task route ---------------------------------------------


def test_task_routes_answer_503_without_details_when_the_database_is_unreachable(
    settings: Settings,
) -> None:
    port = closed_port()
    broken = settings.with_overrides(database_url=f"postgresql://postgres@127.0.0.1:{port}/x")
    with api_client(broken) as client:
        response = client.get(f"/api/tasks/{uuid.uuid4()}", headers=bearer(BAD_TOKEN))
    assert response.status_code == 503
    assert set(response.json()) == {"detail"}
    assert str(port) not in response.text and "127.0.0.1" not in response.text


WAITING_ON_A_LOCK = sa.text(
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def test_a_creation_whose_session_dies_mid_statement_answers_503_and_writes_nothing(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """The creation's statements go straight to the driver (ledger/prepared.py): a lost
    session raises psycopg2's own error, which must answer 503 like SQLAlchemy's (it was
    a 500). Gate: the creation waits for its team's lock, held here; its backend is
    terminated while it waits."""
    answer: dict[str, object] = {}

    def create() -> None:
        answer["response"] = client.post(
            exports_url(world.team_id),
            json={"scope": "TEAM", "filters": {}},
            headers=bearer(tokens["staff"]),
        )

    creator = threading.Thread(target=create)
    with engine.begin() as holder:
        holder.execute(
            sa.text("SELECT pg_advisory_xact_lock(hashtextextended('teamdesk.quota:' || :t, 0))"),
            {"t": str(world.team_id)},
        )
        creator.start()
        try:
            pid = wait_for(
                lambda: holder.execute(WAITING_ON_A_LOCK).scalar(),
                what="the creation to wait for its team's lock",
            )
            holder.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        finally:
            creator.join(JOIN_TIMEOUT_S)
    assert not creator.is_alive()
    response: Any = answer["response"]
    assert response.status_code == 503
    assert set(response.json()) == {"detail"}
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM background_tasks")).scalar_one() == 0


# --- OpenAPI ---------------------------------------------------------------------------------


def test_openapi_and_docs_are_served(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert set(schema["paths"]) == {
        "/api/health",
        "/api/workers/health",
        "/api/teams/{team_id}/exports",
        "/api/teams/{team_id}/reminders",
        "/api/teams/{team_id}/tasks",
        "/api/tasks/{task_id}",
        "/api/tasks/{task_id}/retry",
        "/api/tasks/{task_id}/cancel",
        "/api/tasks/{task_id}/csv",
    }
    assert "bearer" in schema["components"]["securitySchemes"]
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    # Every script and style sheet of the docs comes from the API itself, never a CDN.
    assets = re.findall(r'(?:src|href)="([^"]+)"', docs.text) + re.findall(
        r"url: '([^']+)'", docs.text
    )
    assert assets and not [a for a in assets if "://" in a]
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
    assert client.get("/redoc").status_code == 200


def test_importing_the_module_level_app_needs_no_database() -> None:
    env = {
        **os.environ,
        "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{closed_port()}/x",
        "REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0",
    }
    code = "import api.app; print(sorted(api.app.app.openapi()['paths'])[0])"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "/api/health"


def test_logs_carry_no_token_body_or_csv(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    task_id = task_in_state(engine, world, "COMPLETED", csv="id\r\nsecret-csv-row\r\n")
    client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
    body = {"scope": "TEAM", "filters": {"q": "secret-body-text"}}
    client.post(exports_url(world.team_id), json=body, headers=bearer(tokens["staff"]))
    broken = settings.with_overrides(
        database_url=f"postgresql://postgres@127.0.0.1:{closed_port()}/x"
    )
    with api_client(broken) as down:
        down.post(exports_url(world.team_id), json=body, headers=bearer(tokens["staff"]))
        down.get("/api/health")
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "database unavailable" in logged and "health check failed" in logged
    for secret in (tokens["staff"], "secret-body-text", "secret-csv-row"):
        assert secret not in logged


# --- the last-resort answer -------------------------------------------------------------------


def test_an_unexpected_error_answers_500_without_its_text(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_api(settings, configure_logging=False)

    @app.get("/api/boom")
    def boom() -> None:
        raise ValueError("secret-detail")

    with TestClient(app) as client:
        response = client.get("/api/boom")
    assert (response.status_code, response.json()) == (500, {"detail": "internal error"})
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "ValueError" in logged and "secret-detail" not in logged


# --- security headers on every kind of answer ------------------------------------------------


def test_every_answer_says_nosniff_and_api_answers_are_never_stored(
    client: TestClient, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    done = task_in_state(engine, world, "COMPLETED")
    answers = {
        "health": client.get("/api/health"),
        "create": client.post(exports_url(world.team_id), json={"scope": "TEAM"}, headers=staff),
        "read": client.get(f"/api/tasks/{done}", headers=staff),
        "list": client.get(f"/api/teams/{world.team_id}/tasks", headers=staff),
        "csv": client.get(f"/api/tasks/{done}/csv", headers=staff),
        "401": client.get(f"/api/tasks/{done}"),
        "404": client.get(f"/api/tasks/{uuid.uuid4()}", headers=staff),
        "413": client.post(exports_url(world.team_id), content=b"x" * 70_000, headers=staff),
        "422": client.post(exports_url(world.team_id), json={"scope": "ALL"}, headers=staff),
    }
    statuses = {name: answer.status_code for name, answer in answers.items()}
    assert statuses == {
        "health": 200,
        "create": 201,
        "read": 200,
        "list": 200,
        "csv": 200,
        "401": 401,
        "404": 404,
        "413": 413,
        "422": 422,
    }
    for name, answer in answers.items():
        assert answer.headers["x-content-type-options"] == "nosniff", name
        assert answer.headers["cache-control"] == "no-store", name
    docs = client.get("/openapi.json")
    assert docs.headers["x-content-type-options"] == "nosniff"
    assert "cache-control" not in docs.headers  # public and the same for everyone
