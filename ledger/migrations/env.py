"""Alembic environment: online migrations only, serialised by an advisory lock so two
``teamdesk-tasks migrate`` runs started together (two containers) cannot collide."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from ledger.models import metadata

MIGRATION_LOCK = 748_201_113  # pg_advisory_lock key for "teamdesk-tasks migrate"


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("sqlalchemy.url is not set")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        connection.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
        connection.commit()
        try:
            context.configure(
                connection=connection, target_metadata=metadata, transaction_per_migration=True
            )
            with context.begin_transaction():
                context.run_migrations()
            connection.commit()
        finally:
            connection.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
            connection.commit()
    engine.dispose()


run_migrations_online()
