"""The API's own database role (ledger/api_database_role.py; docs/design.md, "Processes").

``teamdesk-tasks migrate --app-role A --api-role B`` on a fresh database creates both
roles in one transaction; the API role holds exactly what the API runs (table and column
grants, no sequence, no function); migrate puts drifted grants back and refuses an API
role that could do more through another role (a member of the app role). Every route of the
API works connected as it (create an export and a reminder, list, read, download,
cancel, retry, both health routes, a refused token), and as it the statements a
compromised API would want are refused: rewriting memberships, adding users, deleting or
reviving tokens, reading tickets' content, deleting tasks or audit rows, the dispatcher's
functions, DDL.

Every test_api_*.py runs its in-process API as this role too (harness/databases.py
grants it in the template database). Database roles are cluster-wide: this module's are
its own and dropped at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_api
from harness import databases
from harness.factories import add_member, add_ticket, add_tickets, insert_task, make_world, set_role
from ledger import api_database_role, artifacts, lease
from ledger.permissions import may_see
from ledger.tokens import create_token, hash_token, revoke_token
from teamdesk import db
from teamdesk.config import load_settings
from teamdesk.export_store import ObjectLocation
from tests.conftest import REDIS_URL
from tests.support.api_helpers import bearer, exports_url, reminders_url
from tests.support.db_roles import (
    INSUFFICIENT_PRIVILEGE,
    column_privileges,
    drop_role,
    executable_functions,
    finished,
    migrate,
    owner_engine,
    privileges,
    role_url,
    verifier,
)

PREFIX = f"tdt{os.getpid()}_{uuid.uuid4().hex[:6]}"

# What the API runs, and nothing else (ledger/api_database_role.py).
API_TABLE_GRANTS = {
    "idempotency_keys": "DELETE,INSERT,SELECT",
    "memberships": "SELECT",
    "task_audit": "INSERT",
}
API_COLUMN_GRANTS = {
    "tickets.id": "SELECT",
    "tickets.team_id": "SELECT",
    **{
        f"background_tasks.{c}": ",".join(
            p
            for p, columns in (
                ("INSERT", api_database_role.CREATED_COLUMNS),
                ("SELECT", api_database_role.READ_COLUMNS),
                ("UPDATE", api_database_role.REOPENED_COLUMNS),
            )
            if c in columns
        )
        for c in {
            *api_database_role.CREATED_COLUMNS,
            *api_database_role.READ_COLUMNS,
            *api_database_role.REOPENED_COLUMNS,
        }
    },
}
API_FUNCTIONS = [
    "teamdesk_export_chunk_v1",
    "teamdesk_export_object_v1",
    "teamdesk_resolve_token_v1",
]


@dataclass(frozen=True)
class RolesDatabase:
    name: str
    owner_url: str
    app: str
    api: str
    passwords: dict[str, str]
    migrated: str  # what `migrate --app-role --api-role` printed

    def url(self, role: str) -> str:
        return role_url(self.owner_url, role, self.passwords[role])


@pytest.fixture(scope="module")
def roles_db(services: None) -> Iterator[RolesDatabase]:
    """A fresh database migrated by the product command, both roles created."""
    name, owner_url = databases.empty_database(PREFIX)
    app, api = f"{PREFIX}_app", f"{PREFIX}_api"
    passwords = {app: uuid.uuid4().hex, api: uuid.uuid4().hex}
    try:
        process = migrate(
            owner_url,
            "--app-role",
            app,
            "--api-role",
            api,
            passwords={"APP_DB_PASSWORD": passwords[app], "API_DB_PASSWORD": passwords[api]},
        )
        yield RolesDatabase(name, owner_url, app, api, passwords, finished(process))
    finally:
        for role in (api, app):
            drop_role(role, owner_url)
        databases.drop_database(name)
        for role in (api, app):
            drop_role(role)


@pytest.fixture
def api_engine(roles_db: RolesDatabase) -> Iterator[sa.Engine]:
    engine = db.make_engine(roles_db.url(roles_db.api))
    yield engine
    engine.dispose()


# --- setting the role up --------------------------------------------------------------------


def test_migrate_creates_the_api_role_with_only_what_the_api_runs(
    roles_db: RolesDatabase,
) -> None:
    lines = roles_db.migrated.splitlines()
    assert lines[1:] == [
        f"app role {roles_db.app}: created; grants on 11 tables, 1 sequences and 5 functions",
        f"api role {roles_db.api}: created; grants on 5 tables, 0 sequences and 3 functions",
    ]
    assert privileges(roles_db.owner_url, roles_db.api) == API_TABLE_GRANTS
    assert column_privileges(roles_db.owner_url, roles_db.api) == API_COLUMN_GRANTS
    assert "background_tasks.result_csv" not in API_COLUMN_GRANTS
    assert "background_tasks.result_object" not in API_COLUMN_GRANTS
    assert executable_functions(roles_db.owner_url, roles_db.api) == API_FUNCTIONS
    assert executable_functions(roles_db.owner_url, roles_db.app) == [
        "teamdesk_analyze_ledger",
        "teamdesk_export_chunk_v1",
        "teamdesk_export_object_v1",
        "teamdesk_purge_ledger",
        "teamdesk_resolve_token_v1",
    ]
    stored = verifier(roles_db.owner_url, roles_db.api)
    assert stored.startswith("SCRAM-SHA-256$") and roles_db.passwords[roles_db.api] not in stored


DRIFT = [
    "GRANT INSERT, UPDATE, DELETE ON memberships TO {role}",
    "GRANT SELECT ON users TO {role}",
    "GRANT UPDATE (revoked_at, expires_at) ON api_tokens TO {role}",
    "GRANT SELECT (title) ON tickets TO {role}",
    "GRANT SELECT ON api_tokens, export_chunks TO {role}",
    "GRANT SELECT (result_csv) ON background_tasks TO {role}",
    "GRANT USAGE ON SEQUENCE task_audit_id_seq TO {role}",
    "GRANT EXECUTE ON FUNCTION teamdesk_purge_ledger(double precision, double precision,"
    " integer) TO {role}",
]


def test_migrate_again_puts_drifted_api_grants_back_and_keeps_the_password(
    roles_db: RolesDatabase,
) -> None:
    stored = verifier(roles_db.owner_url, roles_db.api)
    with owner_engine(roles_db.owner_url).connect() as conn:
        for grant in DRIFT:
            conn.execute(sa.text(grant.format(role=f'"{roles_db.api}"')))
    out = finished(migrate(roles_db.owner_url, "--api-role", roles_db.api))
    assert f"api role {roles_db.api}: kept" in out
    assert (
        privileges(roles_db.owner_url, roles_db.api),
        column_privileges(roles_db.owner_url, roles_db.api),
        executable_functions(roles_db.owner_url, roles_db.api),
        verifier(roles_db.owner_url, roles_db.api),
    ) == (API_TABLE_GRANTS, API_COLUMN_GRANTS, API_FUNCTIONS, stored)


def test_an_api_role_that_inherits_more_is_refused(roles_db: RolesDatabase) -> None:
    """A DBA's ``GRANT teamdesk_app TO teamdesk_api`` would give the API every row: migrate
    refuses it, and its transaction leaves every grant as it was."""
    before = privileges(roles_db.owner_url, roles_db.api)
    admin = owner_engine(roles_db.owner_url)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'GRANT "{roles_db.app}" TO "{roles_db.api}"'))
        code, err = _migrate_refused(roles_db, "--api-role", roles_db.api)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'REVOKE "{roles_db.app}" FROM "{roles_db.api}"'))
        admin.dispose()
    assert (code, err) == (
        1,
        f"teamdesk-tasks migrate: role {roles_db.api} may UPDATE table idempotency_keys through "
        "another role or PUBLIC: revoke that membership or grant\n",
    )
    assert privileges(roles_db.owner_url, roles_db.api) == before


def _migrate_refused(roles_db: RolesDatabase, *args: str, **passwords: str) -> tuple[int, str]:
    process = migrate(roles_db.owner_url, *args, passwords=passwords)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def test_migrate_refuses_one_role_for_both_and_a_password_for_no_role(
    roles_db: RolesDatabase,
) -> None:
    same = _migrate_refused(roles_db, "--app-role", roles_db.app, "--api-role", roles_db.app)
    stray = _migrate_refused(roles_db, "--app-role", roles_db.app, API_DB_PASSWORD="pw")
    missing = _migrate_refused(roles_db, "--api-role", f"{PREFIX}_nobody")
    assert same == (
        2,
        "teamdesk-tasks migrate: --api-role must name another role than --app-role\n",
    )
    assert stray == (2, "teamdesk-tasks migrate: API_DB_PASSWORD is set but --api-role is not\n")
    assert missing == (
        1,
        f"teamdesk-tasks migrate: role {PREFIX}_nobody does not exist; "
        "set API_DB_PASSWORD to create it\n",
    )


# --- what the API role may not do -----------------------------------------------------------

FORBIDDEN = [
    "UPDATE memberships SET role = 'STAFF'",
    "INSERT INTO memberships (team_id, user_id, role) VALUES (gen_random_uuid(), "
    "gen_random_uuid(), 'STAFF')",
    "DELETE FROM memberships",
    "INSERT INTO users (email, name) VALUES ('intruder@example.test', 'Intruder')",
    "SELECT email FROM users",
    "INSERT INTO teams (name) VALUES ('Intruders')",
    "DELETE FROM api_tokens",
    "INSERT INTO api_tokens (token_hash, user_id, expires_at) VALUES ('h', gen_random_uuid(),"
    " now())",
    "UPDATE api_tokens SET revoked_at = NULL",
    "UPDATE api_tokens SET expires_at = now() + interval '1 year'",
    "SELECT title FROM tickets",
    "UPDATE tickets SET status = 'CLOSED'",
    "DELETE FROM background_tasks",
    "SELECT * FROM task_audit",
    "UPDATE task_audit SET event = 'CLAIM'",
    "DELETE FROM task_audit",
    "INSERT INTO notifications (user_id, ticket_id) VALUES (gen_random_uuid(), gen_random_uuid())",
    "SELECT * FROM system_events",
    "SELECT teamdesk_analyze_ledger()",
    "SELECT teamdesk_purge_ledger(1, 1, 1)",
    "TRUNCATE background_tasks",
    "CREATE TABLE intruder (id int)",
    "SELECT * FROM alembic_version",
    # A CSV, its key, checksum or size: never the API's to write (issue "Security, round
    # four", finding 4), nor a row that starts finished, nor a chunk.
    "UPDATE background_tasks SET result_csv = '=HYPERLINK(\"http://x\")'",
    "UPDATE background_tasks SET result_key = gen_random_uuid()",
    "UPDATE background_tasks SET result_sha256 = 'x', result_bytes = 1",
    "UPDATE background_tasks SET team_id = gen_random_uuid()",
    "UPDATE background_tasks SET owner_id = gen_random_uuid()",
    "UPDATE background_tasks SET filters = '{}'",
    "INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, status)"
    " VALUES ('EXPORT', gen_random_uuid(), gen_random_uuid(), 'TEAM', '{}', 'COMPLETED')",
    "INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters, result_csv)"
    " VALUES ('EXPORT', gen_random_uuid(), gen_random_uuid(), 'TEAM', '{}', 'x')",
    "INSERT INTO export_chunks (task_id, execution_id, seq, data)"
    " VALUES (gen_random_uuid(), gen_random_uuid(), 0, 'x')",
    "UPDATE export_chunks SET data = 'x'",
    "DELETE FROM export_chunks",
    # Nor a CSV to read, nor the hashes of tokens it was not shown (the same finding): the
    # downloads and the token lookup go through the owner's functions.
    "SELECT data FROM export_chunks",
    "SELECT result_csv FROM background_tasks",
    "SELECT result_object FROM background_tasks",
    "UPDATE background_tasks SET result_object = 's3://elsewhere/x.csv'",
    "SELECT * FROM background_tasks",
    "SELECT token_hash FROM api_tokens",
    "SELECT user_id FROM api_tokens",
    "UPDATE api_tokens SET last_used_at = now()",
]


@pytest.mark.parametrize("statement", FORBIDDEN)
def test_the_api_role_may_not_do_what_the_api_does_not(
    api_engine: sa.Engine, statement: str
) -> None:
    with pytest.raises(sa.exc.ProgrammingError) as denied, api_engine.begin() as conn:
        conn.execute(sa.text(statement))
    assert getattr(denied.value.orig, "pgcode", None) == INSUFFICIENT_PRIVILEGE, statement


# --- every route, as the role ---------------------------------------------------------------


def test_every_api_route_works_as_the_api_role(roles_db: RolesDatabase) -> None:
    owner = db.make_engine(roles_db.owner_url)  # TeamDesk's own tables: its application's
    app_engine = db.make_engine(roles_db.url(roles_db.app))  # workers and operators
    try:
        world = make_world(owner)
        with owner.begin() as conn:
            add_tickets(conn, world.team_id, world.customer_id, 3)
            ticket = add_ticket(
                conn, world.team_id, world.customer_id, "Call", assignee_id=world.staff2_id
            )
        with app_engine.begin() as conn:  # `teamdesk-tasks token create`: the app role
            token = create_token(conn, world.staff_id, "api role test")
        staff = bearer(token)
        settings = load_settings(
            {
                "DATABASE_URL": roles_db.url(roles_db.api),
                "REDIS_URL": REDIS_URL,
                "QUEUE_PREFIX": f"{PREFIX}-{uuid.uuid4().hex[:6]}",
            }
        )
        answers: dict[str, int] = {}
        with TestClient(create_api(settings, configure_logging=False)) as client:
            answers["health"] = client.get("/api/health").status_code
            workers = client.get("/api/workers/health")
            answers["workers/health"] = workers.status_code
            export = client.post(
                exports_url(world.team_id), json={"scope": "TEAM", "filters": {}}, headers=staff
            )
            reminder = client.post(
                reminders_url(world.team_id), json={"ticket_id": str(ticket)}, headers=staff
            )
            answers |= {"export": export.status_code, "reminder": reminder.status_code}
            export_id, reminder_id = export.json()["id"], reminder.json()["id"]
            with app_engine.begin() as conn:  # a worker completes the export
                held = lease.claim(conn, uuid.UUID(export_id), 0, "test-host/api-role")
                assert held is not None
                lease.complete_export(conn, held.lease, "id,title\r\n1,Call\r\n", "1 row")
            listed = client.get(f"/api/teams/{world.team_id}/tasks", headers=staff)
            answers["list"] = listed.status_code
            answers["get"] = client.get(f"/api/tasks/{export_id}", headers=staff).status_code
            csv = client.get(f"/api/tasks/{export_id}/csv", headers=staff)
            answers["csv"] = csv.status_code
            cancel = client.post(f"/api/tasks/{reminder_id}/cancel", headers=staff)
            retry = client.post(f"/api/tasks/{reminder_id}/retry", headers=staff)
            answers |= {"cancel": cancel.status_code, "retry": retry.status_code}
            answers["bad token"] = client.get(
                f"/api/tasks/{export_id}", headers=bearer("tdk_" + "z" * 43)
            ).status_code
        with owner.connect() as conn:
            used = conn.execute(sa.text("SELECT last_used_at FROM api_tokens")).scalar_one()
            trail = conn.execute(
                sa.text("SELECT event FROM task_audit WHERE task_id = :t ORDER BY id"),
                {"t": reminder_id},
            ).scalars()
            events = list(trail)
    finally:
        owner.dispose()
        app_engine.dispose()
    assert answers == {
        "health": 200,
        "workers/health": 200,
        "export": 201,
        "reminder": 201,
        "list": 200,
        "get": 200,
        "csv": 200,
        "cancel": 202,
        "retry": 202,
        "bad token": 401,
    }
    assert workers.json()["workers"] is False
    assert [t["id"] for t in listed.json()["tasks"]] == [reminder_id, export_id]
    assert csv.text == "id,title\r\n1,Call\r\n"
    assert retry.json()["run"] == 1 and cancel.json()["status"] == "CANCELLED"
    assert events == ["CANCEL", "RETRY"]
    assert used is not None  # the lookup's touch of last_used_at


def test_health_cluster_reads_the_ledger_as_the_api_role(roles_db: RolesDatabase) -> None:
    """``teamdesk-tasks health --cluster`` in the API's container (docs/operations.md): its
    counts of waiting tasks are reads the API role may make."""
    env = {
        **os.environ,
        "DATABASE_URL": roles_db.url(roles_db.api),
        "REDIS_URL": REDIS_URL,
        "QUEUE_PREFIX": f"{PREFIX}-{uuid.uuid4().hex[:6]}",
    }
    argv = [sys.executable, "-m", "cli.main", "health", "--cluster"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    report = json.loads(done.stdout)
    assert (done.returncode, report["database"], report["redis"]) == (1, True, True)
    assert report["missing"] == ["dispatcher", "exports worker", "reminders worker"]


# --- what a compromised API can read --------------------------------------------------------


@dataclass(frozen=True)
class Completed:
    """An export of ``world``'s team completed by a worker (the application role)."""

    task_id: uuid.UUID
    key: uuid.UUID
    csv: bytes


def _complete(app_engine: sa.Engine, task_id: uuid.UUID, csv: str) -> Completed:
    with app_engine.begin() as conn:
        held = lease.claim(conn, task_id, 0, "test-host/api-role")
        assert held is not None
        lease.complete_export(conn, held.lease, csv, "rows")
    return Completed(task_id, held.lease.execution_id, csv.encode())


def test_a_compromised_api_reads_no_csv_but_what_its_callers_may_download(
    roles_db: RolesDatabase, api_engine: sa.Engine
) -> None:
    """Finding 4 of the security review: as the API's role, queue an export in another
    team's staff member's name; a worker completes it. The role cannot read it (the table
    reads are refused: FORBIDDEN), and the owner's function gives it to no token but one
    whose user may see it: not the attacker's own (staff of another team), not an unknown
    or revoked hash, not under another key. Nor does the token lookup answer a guess."""
    owner = db.make_engine(roles_db.owner_url)
    app_engine = db.make_engine(roles_db.url(roles_db.app))
    try:
        world = make_world(owner)
        with app_engine.begin() as conn:
            attacker = hash_token(create_token(conn, world.outsider_id, "attacker"))
            staff_raw = create_token(conn, world.staff2_id, "victim")
        staff = hash_token(staff_raw)
        with api_engine.begin() as conn:  # the row a compromised API may write
            task_id = conn.execute(
                sa.text(
                    "INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)"
                    " VALUES ('EXPORT', :t, :o, 'TEAM', '{}') RETURNING id"
                ),
                {"t": world.team_id, "o": world.staff_id},
            ).scalar_one()
        done = _complete(app_engine, task_id, "id,title\r\n1,Secret\r\n")
        with api_engine.connect() as conn:
            reads = {
                "attacker": artifacts.read_chunk(conn, attacker, task_id, done.key, 0),
                "unknown hash": artifacts.read_chunk(conn, "0" * 64, task_id, done.key, 0),
                "another key": artifacts.read_chunk(conn, staff, task_id, uuid.uuid4(), 0),
                "as if in the row": artifacts.read_chunk(conn, staff, task_id, None, 0),
                "past the end": artifacts.read_chunk(conn, staff, task_id, done.key, 1),
                "staff": artifacts.read_chunk(conn, staff, task_id, done.key, 0),
            }
            guessed = conn.execute(
                sa.text("SELECT * FROM teamdesk_resolve_token_v1(:h, 60)"), {"h": "0" * 64}
            ).all()
        with owner.begin() as conn:  # as if an object store kept it (its key is a secret)
            conn.execute(
                sa.text("UPDATE background_tasks SET result_object = :o WHERE id = :id"),
                {"o": "s3://exports/exports/x.csv", "id": task_id},
            )
        with api_engine.connect() as conn:
            objects = {
                "attacker": artifacts.object_of(conn, attacker, task_id),
                "unknown hash": artifacts.object_of(conn, "0" * 64, task_id),
                "staff": artifacts.object_of(conn, staff, task_id),
            }
        with app_engine.begin() as conn:  # `teamdesk-tasks token revoke`
            revoke_token(conn, _token_id(owner, staff))
        with api_engine.connect() as conn:
            revoked = artifacts.read_chunk(conn, staff, task_id, done.key, 0)
    finally:
        owner.dispose()
        app_engine.dispose()
    assert reads == {
        "attacker": None,
        "unknown hash": None,
        "another key": None,
        "as if in the row": None,
        "past the end": None,
        "staff": done.csv,
    }
    assert (guessed, revoked) == ([], None)
    assert objects == {
        "attacker": None,
        "unknown hash": None,
        "staff": ObjectLocation("exports", "exports/x.csv"),
    }


def _token_id(owner: sa.Engine, token_hash: str) -> uuid.UUID:
    with owner.connect() as conn:
        query = sa.text("SELECT id FROM api_tokens WHERE token_hash = :h")
        return uuid.UUID(str(conn.execute(query, {"h": token_hash}).scalar_one()))


def test_the_download_function_says_what_may_see_says(roles_db: RolesDatabase) -> None:
    """The function's rule in SQL (migration 0014) and ledger.permissions.may_see agree for
    each scope, caller (the creator, another member) and the caller's role now (staff, a
    customer, not a member)."""
    owner = db.make_engine(roles_db.owner_url)
    app_engine = db.make_engine(roles_db.url(roles_db.app))
    api = db.make_engine(roles_db.url(roles_db.api))
    answers: dict[tuple[str, str, str | None], tuple[bool, bool]] = {}
    try:
        world = make_world(owner)
        with app_engine.begin() as conn:
            hashes = {
                "creator": hash_token(create_token(conn, world.staff_id)),
                "other": hash_token(create_token(conn, world.staff2_id)),
            }
        users = {"creator": world.staff_id, "other": world.staff2_id}
        exports = {}
        with owner.begin() as conn:
            for scope in ("TEAM", "MINE"):
                exports[scope] = insert_task(conn, world, scope=scope, owner_id=world.staff_id)
        done = {s: _complete(app_engine, t, f"id,{s}\r\n") for s, t in exports.items()}
        for caller, user_id in users.items():
            for role in ("STAFF", "CUSTOMER", None):
                with owner.begin() as conn:
                    set_role(conn, world.team_id, user_id, None)
                    if role is not None:
                        add_member(conn, world.team_id, user_id, role)
                for scope, completed in done.items():
                    with api.connect() as conn:
                        piece = artifacts.read_chunk(
                            conn, hashes[caller], completed.task_id, completed.key, 0
                        )
                    rule = may_see(scope, world.staff_id, user_id, role)
                    answers[(scope, caller, role)] = (piece == completed.csv, rule)
    finally:
        owner.dispose()
        app_engine.dispose()
        api.dispose()
    assert len(answers) == 12
    assert all(given == rule for given, rule in answers.values()), answers
    # TEAM: the creator and the other member while staff; MINE: its creator while a member.
    assert sum(rule for _, rule in answers.values()) == 4


def test_a_csv_an_earlier_release_stored_in_the_row_is_streamed_in_chunks(
    roles_db: RolesDatabase,
) -> None:
    """A CSV the previous release wrote into ``result_csv`` (kept 24 hours) is downloaded
    through the same function, cut into 1 MiB pieces by bytes (not characters), whole; the
    role never reads the column."""
    owner = db.make_engine(roles_db.owner_url)
    app_engine = db.make_engine(roles_db.url(roles_db.app))
    line = "7,Café Ünïcode ticket\r\n"
    legacy = "id,title\r\n" + line * (((3 << 20) // 2) // len(line.encode()))
    try:
        world = make_world(owner)
        with app_engine.begin() as conn:
            token = create_token(conn, world.staff_id)
        with owner.begin() as conn:
            task_id = insert_task(conn, world)
            conn.execute(
                sa.text(
                    "UPDATE background_tasks SET status = 'COMPLETED', result_csv = :csv,"
                    " expires_at = now() + interval '1 day' WHERE id = :id"
                ),
                {"csv": legacy, "id": task_id},
            )
        settings = load_settings(
            {
                "DATABASE_URL": roles_db.url(roles_db.api),
                "REDIS_URL": REDIS_URL,
                "QUEUE_PREFIX": f"{PREFIX}-{uuid.uuid4().hex[:6]}",
            }
        )
        with TestClient(create_api(settings, configure_logging=False)) as client:
            task = client.get(f"/api/tasks/{task_id}", headers=bearer(token))
            download = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(token))
        api = db.make_engine(roles_db.url(roles_db.api))
        try:
            with api.connect() as conn:
                sizes = [
                    len(artifacts.read_chunk(conn, hash_token(token), task_id, None, seq) or b"")
                    for seq in range(3)
                ]
        finally:
            api.dispose()
    finally:
        owner.dispose()
        app_engine.dispose()
    data = legacy.encode()
    assert (task.status_code, task.json()["has_csv"]) == (200, True)
    assert download.status_code == 200 and download.content == data
    assert sizes == [artifacts.CHUNK_BYTES, len(data) - artifacts.CHUNK_BYTES, 0]


# The previous release's (1.0.0's) token lookup and CSV read, as its API sends them.
PREVIOUS_API_READS = [
    "SELECT id, user_id FROM api_tokens WHERE token_hash = 'h' AND revoked_at IS NULL"
    " AND expires_at > now()",
    "UPDATE api_tokens SET last_used_at = now() WHERE id = gen_random_uuid()",
    "SELECT result_csv FROM background_tasks WHERE id = gen_random_uuid()",
]


def test_a_rolling_upgrade_keeps_the_previous_apis_reads_until_the_second_migrate(
    roles_db: RolesDatabase, api_engine: sa.Engine
) -> None:
    """Expand and contract (an operator's review found the 1.0 API answering 500 once
    this version's migrate ran): ``migrate --previous-api-grants`` keeps what the 1.0 API
    reads beside this version's grants; the plain ``migrate`` after the rollout takes it
    back. Nothing else changes either way."""

    def reads() -> list[bool]:
        allowed = []
        for statement in PREVIOUS_API_READS:
            try:
                with api_engine.begin() as conn:
                    conn.execute(sa.text(statement))
                allowed.append(True)
            except sa.exc.ProgrammingError as exc:
                assert getattr(exc.orig, "pgcode", None) == INSUFFICIENT_PRIVILEGE
                allowed.append(False)
        return allowed

    expanded = finished(
        migrate(roles_db.owner_url, "--api-role", roles_db.api, "--previous-api-grants")
    )
    during = (reads(), privileges(roles_db.owner_url, roles_db.api))
    contracted = finished(migrate(roles_db.owner_url, "--api-role", roles_db.api))
    after = (reads(), privileges(roles_db.owner_url, roles_db.api))
    refused = _migrate_refused(roles_db, "--previous-api-grants")
    assert f"api role {roles_db.api}: kept; grants on 6 tables" in expanded
    assert during == ([True, True, True], {**API_TABLE_GRANTS, "api_tokens": "SELECT"})
    assert f"api role {roles_db.api}: kept; grants on 5 tables" in contracted
    assert after == ([False, False, False], API_TABLE_GRANTS)
    assert column_privileges(roles_db.owner_url, roles_db.api) == API_COLUMN_GRANTS
    assert refused == (2, "teamdesk-tasks migrate: --previous-api-grants needs --api-role\n")
