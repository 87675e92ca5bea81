"""Apply the Alembic revisions in ``ledger/migrations``, then set up the application's and
the API's database roles when they are named (``teamdesk-tasks migrate [--app-role NAME]
[--api-role NAME]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext

from ledger.api_database_role import grant_api_role, grant_api_role_with_previous
from ledger.database_roles import AppRoleReport, grant_app_role
from teamdesk.db import sqlalchemy_url

MIGRATIONS = Path(__file__).with_name("migrations")
# pg_advisory_xact_lock key of "teamdesk-tasks migrate", held while the revisions run
# (ledger/migrations/env.py: a transaction-level lock, so it is sound behind PgBouncer).
MIGRATION_LOCK = 748_201_113


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    url = sqlalchemy_url(database_url)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the schema to ``revision``; running it again changes nothing."""
    command.upgrade(alembic_config(database_url), revision)


def current_revision(database_url: str) -> str | None:
    engine = sa.create_engine(sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def set_up_app_role(database_url: str, role: str, password: str | None) -> AppRoleReport:
    """Create or update the application role and re-apply its grants (ledger/database_roles.py),
    in one transaction, as the role of ``database_url`` (the schema's owner)."""
    engine = sa.create_engine(sqlalchemy_url(database_url), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            return grant_app_role(conn, role, password)
    finally:
        engine.dispose()


ROLE_KINDS = {
    "app": grant_app_role,
    "api": grant_api_role,
    "api+previous": grant_api_role_with_previous,
}


def set_up_roles(
    database_url: str, roles: Sequence[tuple[str, str, str | None]]
) -> list[AppRoleReport]:
    """Create or update each ``(kind, role, password)`` (kind ``app``: ledger/database_roles.py,
    ``api``: ledger/api_database_role.py) and re-apply its grants, all in one transaction, as the
    role of ``database_url`` (the schema's owner): both or neither."""
    engine = sa.create_engine(sqlalchemy_url(database_url), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            return [ROLE_KINDS[kind](conn, role, password) for kind, role, password in roles]
    finally:
        engine.dispose()
