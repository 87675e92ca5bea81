"""Alembic environment: online migrations only (docs/design.md, "Processes"), serialised by
a transaction-level advisory lock that a second connection holds in an open transaction
while the revisions run on the first; behind PgBouncer a session-level lock's unlock may
land on another server session (docs/decisions.md, "Issue 34: smaller items")."""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import context

from ledger.migrate import MIGRATION_LOCK
from ledger.models import metadata

LOCK_POLL_S = 0.5  # a migrate waiting for another one's lock tries again this often

# Taken in the guard's transaction, which then sits idle while the migrations run: a
# server-wide idle_in_transaction_session_timeout must not end it (and the lock) early.
TRY_LOCK = sa.text(
    "SELECT set_config('idle_in_transaction_session_timeout', '0', true),"
    " pg_try_advisory_xact_lock(:k)"
)


def take_lock(guard: sa.Connection) -> None:
    """Hold the migration lock in ``guard``'s transaction, waiting for another migrate to
    end. Each try is a transaction of its own: waiting inside one holds a snapshot, which
    the running migrate's ``CREATE INDEX CONCURRENTLY`` would wait for, a cycle PostgreSQL
    cannot see."""
    while not guard.execute(TRY_LOCK, {"k": MIGRATION_LOCK}).one()[1]:
        guard.rollback()
        time.sleep(LOCK_POLL_S)


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("sqlalchemy.url is not set")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as guard:
            take_lock(guard)  # held until guard's transaction ends
            with engine.connect() as connection:
                context.configure(
                    connection=connection, target_metadata=metadata, transaction_per_migration=True
                )
                with context.begin_transaction():
                    context.run_migrations()
                connection.commit()
            guard.commit()  # releases the lock, on the server session that took it
    finally:
        engine.dispose()


run_migrations_online()
