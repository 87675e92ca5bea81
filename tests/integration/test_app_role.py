"""The least-privilege application role (ledger/database_roles.py; docs/design.md, "Processes").

``teamdesk-tasks migrate --app-role`` on a fresh database creates the role; then an export
and a reminder run end to end (in-process worker and dispatcher), the API creates, reads
and serves the CSV, and ``teamdesk-tasks health`` passes, every one of them connected as
that role and to a Redis that requires a password. The role can do no DDL and reads nothing
beyond its grants; migrate runs again (twice at once) without harm and puts drifted grants
back; it refuses a role that would be more than a table user. Flower starts with no
database URL at all.

The local server trusts every connection, so the role's password is not checked here
(its SCRAM verifier is); its privileges are. Database roles are cluster-wide: each run uses a role
name of its own and drops it at the end.
"""

from __future__ import annotations

import csv
import io
import os
import select
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import psycopg2
import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient

from harness import databases
from harness.factories import add_ticket, add_tickets, make_world
from harness.processes import Proc, celery_argv, cluster, free_port
from harness.waiting import wait_for
from ledger import dispatch, retention, service
from ledger.database_roles import AppRoleRefused, table_privileges
from ledger.migrate import set_up_app_role
from ledger.wake import WAKE_CHANNEL
from tasks.celery_app import create_app
from teamdesk import config, db
from teamdesk.config import Settings
from tests.support import db_roles
from tests.support.api_helpers import api_client, bearer, exports_url, make_tokens, reminders_url
from tests.support.db_roles import (
    INSUFFICIENT_PRIVILEGE,
    drop_role,
    finished,
    migrate,
    owner_engine,
)
from tests.support.dispatching import running_cluster
from tests.support.redis_server import dedicated_redis

PREFIX = f"tdt{os.getpid()}_{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class AppDatabase:
    name: str
    owner_url: str
    role: str
    password: str
    migrated: str  # what `migrate --app-role` printed

    @property
    def app_url(self) -> str:
        server = urlsplit(databases.ADMIN_URL)
        where = f"{server.hostname}:{server.port or 5432}"
        return f"postgresql://{self.role}:{self.password}@{where}/{self.name}"


def app_password(password: str) -> dict[str, str]:
    return {"APP_DB_PASSWORD": password}


@pytest.fixture(scope="module")
def app_db(services: None) -> Iterator[AppDatabase]:
    """A fresh database migrated by the product command, with the app role created."""
    name, owner_url = databases.empty_database(PREFIX)
    role, password = f"{PREFIX}_app", uuid.uuid4().hex
    try:
        out = finished(migrate(owner_url, "--app-role", role, passwords=app_password(password)))
        owner = owner_engine(owner_url)
        with owner.connect() as conn:  # a table of the owner's, outside the grants
            conn.execute(sa.text("CREATE TABLE owner_notes (note text)"))
        owner.dispose()
        yield AppDatabase(name, owner_url, role, password, out)
    finally:
        drop_role(role, owner_url)
        databases.drop_database(name)
        drop_role(role)


@pytest.fixture
def app_engine(app_db: AppDatabase) -> Iterator[sa.Engine]:
    engine = db.make_engine(app_db.app_url)
    yield engine
    engine.dispose()


@contextmanager
def password_redis() -> Iterator[str]:
    """A dedicated Redis that refuses clients without the password; yields its URL."""
    password = uuid.uuid4().hex
    with dedicated_redis() as server:
        server.client().config_set("requirepass", password)
        with pytest.raises(redis.AuthenticationError):
            server.client().ping()
        yield f"redis://:{password}@127.0.0.1:{server.port}/0"


@contextmanager
def app_settings(app_db: AppDatabase, redis_url: str) -> Iterator[Settings]:
    values = config.load_settings(
        {
            "DATABASE_URL": app_db.app_url,
            "REDIS_URL": redis_url,
            "QUEUE_PREFIX": f"{PREFIX}-{uuid.uuid4().hex[:6]}",
            "WORKER_INSTANCE_ID": "test-host",
        }
    )
    config.set_settings(values)
    db.reset_engine()
    try:
        yield values
    finally:
        db.reset_engine()
        config.set_settings(None)


def health(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """``teamdesk-tasks health`` as the worker's probe runs it: a process of its own."""
    env = {
        **os.environ,
        "DATABASE_URL": settings.database_url,
        "REDIS_URL": settings.redis_url,
        "QUEUE_PREFIX": settings.queue_prefix,
    }
    argv = [sys.executable, "-m", "cli.main", "health", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)


def privileges(app_db: AppDatabase) -> dict[str, str]:
    return db_roles.privileges(app_db.owner_url, app_db.role)


def verifier(app_db: AppDatabase) -> str:
    return db_roles.verifier(app_db.owner_url, app_db.role)


# --- setting the role up --------------------------------------------------------------------


def test_migrate_creates_the_role_with_only_row_privileges(app_db: AppDatabase) -> None:
    assert f"app role {app_db.role}: created" in app_db.migrated
    granted = privileges(app_db)
    expected = {name: ",".join(sorted(p)) for name, p in table_privileges().items()}
    expected["task_audit_id_seq"] = "SELECT,USAGE"
    assert granted == expected
    assert granted["task_audit"] == "INSERT,SELECT"  # the audit trail is append-only
    stored = verifier(app_db)
    assert stored.startswith("SCRAM-SHA-256$") and app_db.password not in stored


def test_migrate_again_from_two_hosts_at_once_sets_the_password_and_grants_again(
    app_db: AppDatabase,
) -> None:
    before, old_verifier = privileges(app_db), verifier(app_db)
    with owner_engine(app_db.owner_url).connect() as conn:  # drift: a grant made by hand
        conn.execute(sa.text(f'GRANT TRUNCATE, TRIGGER ON tickets TO "{app_db.role}"'))
    # The same password again (the other tests' URL stays valid): a new salt, a new verifier.
    password = app_db.password
    runs = [
        migrate(app_db.owner_url, "--app-role", app_db.role, passwords=app_password(password))
        for _ in "ab"
    ]
    outputs = [finished(run) for run in runs]
    assert all(f"app role {app_db.role}: password set" in out for out in outputs)
    assert privileges(app_db) == before  # the drifted grants are gone again
    changed = verifier(app_db)
    assert changed != old_verifier and password not in changed
    kept = finished(migrate(app_db.owner_url, "--app-role", app_db.role))
    assert f"app role {app_db.role}: kept" in kept
    assert verifier(app_db) == changed


@pytest.mark.parametrize("power", ["CREATEDB", "CREATEROLE", "owner member"])
def test_a_role_with_more_than_row_privileges_is_refused(app_db: AppDatabase, power: str) -> None:
    role = f"{PREFIX}_x{uuid.uuid4().hex[:6]}"
    admin = owner_engine(app_db.owner_url)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE ROLE "{role}" NOLOGIN'))
            if power == "owner member":
                owner = conn.execute(sa.text("SELECT current_user")).scalar_one()
                conn.execute(sa.text(f'GRANT "{owner}" TO "{role}"'))
            else:
                conn.execute(sa.text(f'ALTER ROLE "{role}" {power}'))
        with pytest.raises(AppRoleRefused) as refused:
            set_up_app_role(app_db.owner_url, role, None)
        assert power.split()[-1] in refused.value.message
        assert privileges(AppDatabase(app_db.name, app_db.owner_url, role, "", "")) == {}
    finally:
        admin.dispose()
        drop_role(role, app_db.owner_url)


def test_the_migrating_role_itself_is_refused(app_db: AppDatabase) -> None:
    with pytest.raises(AppRoleRefused, match="is the migrating role"):
        set_up_app_role(app_db.owner_url, "postgres", "secret")


def test_a_missing_role_needs_a_password(app_db: AppDatabase) -> None:
    process = migrate(app_db.owner_url, "--app-role", f"{PREFIX}_nobody")
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "does not exist; set APP_DB_PASSWORD to create it" in err
    assert "Traceback" not in err


# --- what the role may not do ---------------------------------------------------------------

FORBIDDEN = [
    "CREATE TABLE intruder (id int)",
    "CREATE SCHEMA intruder",
    "CREATE FUNCTION intruder() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "CREATE INDEX ix_intruder ON tickets (title)",
    "ALTER TABLE background_tasks ADD COLUMN intruder int",
    "ALTER TABLE tickets DROP CONSTRAINT ck_tickets_status",
    "DROP TABLE tickets",
    "DROP TRIGGER background_tasks_wake ON background_tasks",
    "TRUNCATE background_tasks",
    "UPDATE task_audit SET event = 'CLAIM'",
    "DELETE FROM task_audit",
    "SELECT * FROM alembic_version",
    "SELECT * FROM owner_notes",
    "SELECT rolpassword FROM pg_authid",
    "CREATE ROLE intruder",
]


@pytest.mark.parametrize("statement", FORBIDDEN)
def test_the_role_can_do_no_ddl_and_read_nothing_beyond_its_grants(
    app_engine: sa.Engine, statement: str
) -> None:
    with pytest.raises(sa.exc.ProgrammingError) as denied, app_engine.begin() as conn:
        conn.execute(sa.text(statement))
    assert getattr(denied.value.orig, "pgcode", None) == INSUFFICIENT_PRIVILEGE, statement


def test_the_role_may_not_pass_its_grants_on(app_db: AppDatabase, app_engine: sa.Engine) -> None:
    with app_engine.begin() as conn:  # PostgreSQL answers with a warning, and grants nothing
        conn.execute(sa.text("GRANT SELECT ON tickets TO PUBLIC"))
    with owner_engine(app_db.owner_url).connect() as conn:
        assert not conn.execute(
            sa.text("SELECT has_table_privilege('public', 'tickets', 'SELECT')")
        ).scalar_one()


# --- what the processes need beyond rows ----------------------------------------------------


def test_listen_and_notify_work_as_the_role(app_db: AppDatabase, app_engine: sa.Engine) -> None:
    world = make_world(app_engine)
    listener = psycopg2.connect(app_db.app_url)
    try:
        listener.autocommit = True
        listener.cursor().execute(f"LISTEN {WAKE_CHANNEL}")
        with app_engine.begin() as conn:  # the insert trigger NOTIFYs
            service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        ready, _, _ = select.select([listener], [], [], 10)
        assert ready, "no notification within 10 s"
        listener.poll()
        assert [n.channel for n in listener.notifies] == [WAKE_CHANNEL]
    finally:
        listener.close()


def test_the_dispatcher_refreshes_statistics_as_the_role(
    app_db: AppDatabase, app_engine: sa.Engine
) -> None:
    """ANALYZE needs ownership before PostgreSQL 17; as the role the dispatcher's ANALYZE
    goes through the owner's SECURITY DEFINER function (migration 0006) and does refresh
    the statistics. (A plain ANALYZE was skipped with a warning nobody saw.)"""
    counted = sa.text(
        "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'background_tasks'"
    )
    owner = owner_engine(app_db.owner_url)

    def analyzed() -> int:
        with owner.connect() as conn:  # a new snapshot of the statistics every time
            return int(conn.execute(counted).scalar_one())

    try:
        before = analyzed()
        with app_engine.begin() as conn:
            conn.execute(dispatch.ANALYZE)
        wait_for(lambda: analyzed() > before, what="the ANALYZE to be counted")
    finally:
        owner.dispose()


# --- the cluster and the API, as the role -----------------------------------------------------


def test_export_reminder_api_and_health_work_as_the_role(
    app_db: AppDatabase, app_engine: sa.Engine
) -> None:
    world = make_world(app_engine)
    with app_engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 30)
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Printer", assignee_id=world.staff2_id
        )
    tokens = make_tokens(app_engine, world)
    staff = bearer(tokens["staff"])
    with password_redis() as redis_url, app_settings(app_db, redis_url) as settings:
        app = create_app(settings)
        try:
            with running_cluster(app), api_client(settings) as client:
                export = client.post(
                    exports_url(world.team_id), json={"scope": "TEAM", "filters": {}}, headers=staff
                )
                reminder = client.post(
                    reminders_url(world.team_id), json={"ticket_id": str(ticket)}, headers=staff
                )
                assert (export.status_code, reminder.status_code) == (201, 201)
                ids = [export.json()["id"], reminder.json()["id"]]
                for task_id in ids:
                    done = partial(completed, client, task_id, staff)
                    wait_for(done, what=f"task {task_id} COMPLETED")
                download = client.get(f"/api/tasks/{ids[0]}/csv", headers=staff)
                probe = health(settings, "--scope", "test-host")
                roles = health(settings, "--cluster")
        finally:
            app.close()
    assert download.status_code == 200
    rows = list(csv.reader(io.StringIO(download.text)))
    assert len(rows) == 1 + 31 and rows[0][:2] == ["id", "title"]  # 30 tickets + "Printer"
    assert (probe.returncode, roles.returncode) == (0, 0), probe.stdout + roles.stdout
    with app_engine.connect() as conn:
        notified = conn.execute(
            sa.text("SELECT count(*) FROM notifications WHERE ticket_id = :t"), {"t": ticket}
        ).scalar_one()
    assert notified == 1


def completed(client: TestClient, task_id: str, headers: dict[str, str]) -> bool:
    return bool(
        client.get(f"/api/tasks/{task_id}", headers=headers).json()["status"] == "COMPLETED"
    )


# --- Flower: no database at all -------------------------------------------------------------


@pytest.mark.slow
def test_flower_starts_and_serves_without_a_database_url(tmp_path: Path) -> None:
    with password_redis() as redis_url, cluster(tmp_path) as procs:
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env.update(
            REDIS_URL=redis_url,
            QUEUE_PREFIX=f"{PREFIX}-flower",
            FLOWER_BASIC_AUTH="admin:secret",
            PYTHONUNBUFFERED="1",
        )
        port = free_port()
        argv = celery_argv("flower", "--address=127.0.0.1", f"--port={port}")
        flower = Proc("flower", argv, env, tmp_path).start()
        procs.append(flower)
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthcheck"), timeout=30)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/workers")
        request.add_header("Authorization", "Basic YWRtaW46c2VjcmV0")
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        ports = {c.raddr.port for c in psutil.Process(flower.pid).net_connections() if c.raddr}
    assert 5432 not in ports  # only the broker: Flower never connects to PostgreSQL


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_the_role_purges_past_retention_only_through_the_owner_function(
    app_db: AppDatabase, app_engine: sa.Engine
) -> None:
    """The trail is append-only for the role: a DELETE is refused; the retention purge goes
    through the owner's SECURITY DEFINER function (migration 0007) and works as the role."""
    with app_engine.begin() as conn:
        purged = retention.purge_retired(conn, retention.Retention(), batch=10)
    assert purged.tasks >= 0 and purged.audit >= 0
    with app_engine.connect() as conn, pytest.raises(sa.exc.ProgrammingError) as refused:
        conn.execute(sa.text("DELETE FROM task_audit WHERE id < 0"))
    assert getattr(refused.value.orig, "pgcode", None) == INSUFFICIENT_PRIVILEGE
