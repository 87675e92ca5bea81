"""The migrations create exactly the schema the models describe (docs/design.md, "Ledger")."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from harness import databases
from ledger.migrate import MIGRATIONS
from ledger.models import metadata
from teamdesk.db import make_engine


def _previous_release_indexes() -> dict[str, str]:
    """The indexes only the previous release reads, kept for it by migration 0011 and
    absent from the models, which describe what head reads (docs/decisions.md, "Expand and
    contract: the previous release keeps working")."""
    path = MIGRATIONS / "versions" / "0011_previous_release_index.py"
    spec = importlib.util.spec_from_file_location("previous_release_index", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.PREVIOUS_RELEASE_INDEXES)


PREVIOUS_RELEASE_INDEXES = _previous_release_indexes()
PREVIOUS_RELEASE_REVISION = "0007"  # the schema of harness/previous_release.txt's commit


def head_diff(conn: sa.Connection) -> list[object]:
    """The migrated schema's differences from the models, but for the previous release's
    indexes (each checked by test_previous_release_indexes_are_kept_as_it_defined_them)."""
    return [
        d
        for d in compare_metadata(MigrationContext.configure(conn), metadata)
        if not (
            isinstance(d, tuple)
            and d[0] == "remove_index"
            and d[1].name in PREVIOUS_RELEASE_INDEXES
        )
    ]


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
    "export_chunks": {"task_id", "execution_id", "seq", "data"},
    "idempotency_keys": {"team_id", "key", "user_id", "fingerprint", "task_id", "run"},
}


@pytest.fixture
def empty_db() -> Iterator[str]:
    name, url = databases.empty_database(f"tdt{os.getpid()}_empty")
    yield url
    databases.drop_database(name)


def migrate(url: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url, "LOG_LEVEL": "warn", **extra_env}
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
        diff = head_diff(conn)
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


# Each index a migration builds CONCURRENTLY, as an interrupted build leaves it: present
# and invalid. A unique index over a column with duplicates fails its build the same way a
# cancelled one does (PostgreSQL keeps the index, indisvalid = false).
INTERRUPTED_BUILDS = (
    "ix_background_tasks_scheduled",
    "ix_background_tasks_ready_0008",
    "ix_background_tasks_team_exports",
)


def test_migrate_run_again_rebuilds_what_an_interrupted_build_left_invalid(
    empty_db: str,
) -> None:
    from ledger.migrate import upgrade

    upgrade(empty_db, "0007")
    engine = make_engine(empty_db)
    try:
        add_two_exports(engine)
        interrupt_builds(engine, INTERRUPTED_BUILDS)
        assert invalid_indexes(engine) == set(INTERRUPTED_BUILDS)

        done = migrate(empty_db)
        assert done.returncode == 0, done.stderr
        assert invalid_indexes(engine) == set()
        defined = index_definitions(engine)
        assert "ix_background_tasks_ready_0008" not in defined
        assert "(kind, scheduled, team_id, run_at, id)" in defined["ix_background_tasks_ready"]
        assert "(run_at) WHERE scheduled" in defined["ix_background_tasks_scheduled"]
        assert "(team_id, created_at)" in defined["ix_background_tasks_team_exports"]
        assert "(run_at) WHERE" in defined["ix_background_tasks_due"]  # migration 0011
        with engine.connect() as conn:
            diff = head_diff(conn)
        assert diff == []
    finally:
        engine.dispose()


def test_previous_release_indexes_are_kept_as_it_defined_them(empty_db: str) -> None:
    """0008 dropped ``ix_background_tasks_due``, which the previous release's dispatcher
    reads by name; 0011 builds it again exactly as that release's schema (0007) had it,
    and a build of it that was interrupted is rebuilt by the next migrate."""
    from ledger.migrate import upgrade

    upgrade(empty_db, PREVIOUS_RELEASE_REVISION)
    engine = make_engine(empty_db)
    try:
        as_released = index_definitions(engine)
        upgrade(empty_db, "0010")
        with engine.begin() as conn:  # as 0008 left them (it dropped the index)
            for name in PREVIOUS_RELEASE_INDEXES:
                conn.execute(sa.text(f"DROP INDEX IF EXISTS {name}"))
        add_two_exports(engine)
        interrupt_builds(engine, PREVIOUS_RELEASE_INDEXES)
        assert invalid_indexes(engine) == set(PREVIOUS_RELEASE_INDEXES)

        done = migrate(empty_db)
        assert done.returncode == 0, done.stderr
        assert invalid_indexes(engine) == set()
        kept = index_definitions(engine)
        for name in PREVIOUS_RELEASE_INDEXES:
            assert kept[name] == as_released[name]
    finally:
        engine.dispose()


def test_no_revision_leaves_out_what_the_previous_release_reads(empty_db: str) -> None:
    """Each revision after the previous release's schema keeps what that release reads.
    One migrate applies revision after revision beside its running processes, so an index
    dropped and brought back by a later revision of the same run is missing in between:
    on a large ledger for as long as the concurrent builds in between take."""
    from alembic.script import ScriptDirectory

    from ledger.migrate import alembic_config, upgrade

    upgrade(empty_db, PREVIOUS_RELEASE_REVISION)
    script = ScriptDirectory.from_config(alembic_config(empty_db))
    later = [r.revision for r in script.walk_revisions(PREVIOUS_RELEASE_REVISION, "head")]
    engine = make_engine(empty_db)
    try:
        for revision in reversed(later):
            upgrade(empty_db, revision)
            missing = set(PREVIOUS_RELEASE_INDEXES) - set(index_definitions(engine))
            assert not missing, f"after revision {revision}: {sorted(missing)}"
    finally:
        engine.dispose()


def add_two_exports(engine: sa.Engine) -> None:
    """Two rows alike, so a unique index over their ``kind`` cannot be built."""
    with engine.begin() as conn:
        team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES ('t') RETURNING id")
        ).scalar_one()
        owner = conn.execute(
            sa.text("INSERT INTO users (email, name) VALUES ('u@x', 'u') RETURNING id")
        ).scalar_one()
        conn.execute(
            sa.text(
                "INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)"
                " SELECT 'EXPORT', :t, :o, 'TEAM', '{}' FROM generate_series(1, 2)"
            ),
            {"t": team, "o": owner},
        )


def interrupt_builds(engine: sa.Engine, names: Iterable[str]) -> None:
    """Leave each index of ``names`` as an interrupted concurrent build does (see
    :data:`INTERRUPTED_BUILDS`); needs :func:`add_two_exports`' rows."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for name in names:
            with pytest.raises(sa.exc.IntegrityError):
                conn.execute(
                    sa.text(f"CREATE UNIQUE INDEX CONCURRENTLY {name} ON background_tasks (kind)")
                )


def index_definitions(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'background_tasks'"
            )
        ).all()
    return {str(name): str(text) for name, text in rows}


def invalid_indexes(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE NOT i.indisvalid"
            )
        )
        return {str(name) for (name,) in rows}


def test_a_failed_migration_statement_says_so_and_running_again_completes(
    empty_db: str,
) -> None:
    """A lock held elsewhere (a long transaction on the ledger) makes 0008's ALTER TABLE
    give up (lock_timeout): migrate says a statement failed - not that the database is
    unreachable - and once the lock is gone, the same command completes."""
    from ledger.migrate import current_revision, upgrade

    upgrade(empty_db, "0007")
    engine = make_engine(empty_db)
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("LOCK TABLE background_tasks IN ACCESS SHARE MODE"))
            failed = migrate(empty_db, PGOPTIONS="-c lock_timeout=200")
            holder.rollback()
        assert failed.returncode == 1
        assert failed.stderr.startswith(
            "teamdesk-tasks migrate: a migration statement failed: canceling statement due to"
            " lock timeout; running migrate again is safe"
        ), failed.stderr
        assert "check DATABASE_URL" not in failed.stderr
        assert current_revision(empty_db) == "0007"
        done = migrate(empty_db)
        assert done.returncode == 0, done.stderr
        assert invalid_indexes(engine) == set()
    finally:
        engine.dispose()
