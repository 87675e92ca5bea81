"""Alembic environment: online migrations only, serialised by an advisory lock so two
``teamdesk-tasks migrate`` runs started together (two containers) cannot collide.

The lock is transaction-level (``pg_advisory_xact_lock``), held by a transaction of its
own on a second connection that stays open while the migrations run on the first (each
revision in its own transaction, a concurrent index build outside any). A session-level
lock taken in one transaction and released in another is not safe behind PgBouncer in
transaction pooling: the unlock may land on another server session (the lock leaks until
PgBouncer closes the one that holds it, and every later migrate waits for it), and the
work may run on a session that never held it. An open transaction keeps its server
session, and it ends - the lock with it - when the migrations end, fail, or the process
dies (ledger/migrate.py, ``MIGRATION_LOCK``).

A migrate that finds the lock taken tries again every ``LOCK_POLL_S``, each try a short
transaction of its own, rather than wait inside one: a statement waiting for a lock holds
a snapshot, and ``CREATE INDEX CONCURRENTLY`` in the running migrate waits for every
transaction with an older one to end - which would never happen (each would wait for the
other, and PostgreSQL cannot see the cycle, which passes through the first migrate's
process)."""

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
    end (outside any transaction: see the module's docstring)."""
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
