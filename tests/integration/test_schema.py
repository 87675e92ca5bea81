"""The migrations create exactly the schema the models describe (docs/design.md, "Ledger")."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from ledger.models import metadata
from teamdesk.db import make_engine
from tests.support import databases

SPEC_COLUMNS = {
    "background_tasks": {
        "id",
        "kind",
        "team_id",
        "owner_id",
        "scope",
        "filters",
        "status",
        "run",
        "attempts",
        "progress",
        "execution_id",
        "lease_holder",
        "dispatched_at",
        "run_at",
        "recoveries",
        "last_error",
        "result_csv",
        "result_summary",
        "expires_at",
        "created_at",
        "updated_at",
    },
    "teams": {"id", "name"},
    "users": {"id", "email", "name"},
    "memberships": {"team_id", "user_id", "role"},
    "tickets": {
        "id",
        "team_id",
        "title",
        "status",
        "priority",
        "requester_id",
        "assignee_id",
        "due_at",
        "version",
        "created_at",
        "updated_at",
    },
    "notifications": {"id", "user_id", "ticket_id", "task_id", "kind", "created_at"},
    "system_events": {"id", "team_id", "ticket_id", "type", "payload", "created_at"},
    "api_tokens": {"user_id", "expires_at", "last_used_at", "revoked_at"},
    "task_audit": {"task_id", "run", "event", "execution_id"},
}


@pytest.fixture
def empty_db() -> Iterator[str]:
    name, url = databases.empty_database(f"tdt{os.getpid()}_empty")
    yield url
    databases.drop_database(name)


def migrate(url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url, "LOG_LEVEL": "warn"}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_migrate_creates_spec_tables_and_is_idempotent(empty_db: str) -> None:
    first = migrate(empty_db)
    assert first.returncode == 0, first.stderr
    assert "schema at revision" in first.stdout
    second = migrate(empty_db)
    assert second.returncode == 0 and second.stdout == first.stdout
    engine = make_engine(empty_db)
    try:
        inspector = sa.inspect(engine)
        tables = set(inspector.get_table_names()) - {"alembic_version"}
        assert tables == set(SPEC_COLUMNS)
        for table, spec_columns in SPEC_COLUMNS.items():
            columns = {c["name"] for c in inspector.get_columns(table)}
            assert spec_columns <= columns, (table, spec_columns - columns)
        uniques = {
            tuple(u["column_names"]) for u in inspector.get_unique_constraints("notifications")
        }
        assert ("task_id", "user_id") in uniques
    finally:
        engine.dispose()


def test_migrated_schema_equals_models(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def _db_checks(engine: sa.Engine) -> set[tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("""
            SELECT rel.relname, con.conname FROM pg_constraint con
              JOIN pg_class rel ON rel.oid = con.conrelid
              JOIN pg_namespace ns ON ns.oid = rel.relnamespace
             WHERE con.contype = 'c' AND ns.nspname = 'public'""")
        )
        return {(r[0], r[1]) for r in rows}


def test_check_constraints_match_models(engine: sa.Engine) -> None:
    """Alembic does not compare CHECK constraints; compare their names here."""
    expected = {
        (t.name, str(c.name))
        for t in metadata.tables.values()
        for c in t.constraints
        if isinstance(c, sa.CheckConstraint)
    }
    assert _db_checks(engine) == expected


def test_partial_indexes_match_models(engine: sa.Engine) -> None:
    inspector = sa.inspect(engine)
    for table in metadata.tables.values():
        db_indexes = {i["name"]: i for i in inspector.get_indexes(table.name)}
        for index in table.indexes:
            where = index.dialect_options["postgresql"]["where"]
            got = db_indexes[str(index.name)].get("dialect_options", {}).get("postgresql_where")
            if where is None:
                assert got is None, index.name
            else:
                assert got is not None, index.name

                def normal(text: str) -> str:
                    return text.replace("'::text", "'").replace("(", "").replace(")", "")

                assert normal(got) == normal(str(where)), index.name


def test_constraints_refuse_bad_rows(engine: sa.Engine) -> None:
    bad = [
        "UPDATE background_tasks SET status = 'DONE'",
        "UPDATE background_tasks SET progress = 101",
        "UPDATE background_tasks SET kind = 'EMAIL'",
        "UPDATE background_tasks SET execution_id = gen_random_uuid()",  # lease only when RUNNING
    ]
    with engine.begin() as conn:
        team = conn.execute(sa.text("INSERT INTO teams (name) VALUES ('t') RETURNING id")).scalar()
        user = conn.execute(
            sa.text("INSERT INTO users (email, name) VALUES ('a@b', 'a') RETURNING id")
        ).scalar()
        conn.execute(
            sa.text("""INSERT INTO background_tasks (kind, team_id, owner_id, scope,
            filters) VALUES ('EXPORT', :t, :u, 'MINE', '{}')"""),
            {"t": team, "u": user},
        )
    for statement in bad:
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text(statement))


def test_stored_csvs_are_compressed_with_lz4(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        method = conn.execute(
            sa.text(
                "SELECT attcompression FROM pg_attribute WHERE attrelid = "
                "'background_tasks'::regclass AND attname = 'result_csv'"
            )
        ).scalar_one()
    assert method == "l"
