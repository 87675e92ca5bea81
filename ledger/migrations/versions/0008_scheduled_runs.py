"""Scheduled runs leave the ready set: a fill walks only the teams that have a due run.

A WAITING, unpublished run whose ``run_at`` is still ahead is *scheduled*. Before this
revision it sat in ``ix_background_tasks_ready`` beside the runs that are due, and the
round-robin's loose index scan visited every team whose oldest run was scheduled before
passing it over: with 100,000 teams holding a reminder for tomorrow, one fill walked
100,000 index entries (docs/design.md, "Dispatch").

- ``background_tasks.scheduled``: kept by the row trigger ``background_tasks_scheduled``
  (``teamdesk_mark_scheduled``), which sets it on every insert and on every update that
  writes ``status``, ``run_at`` or ``dispatched_at``: true exactly when the row is WAITING,
  unpublished and ``run_at`` is ahead of the database's clock. Time only makes a scheduled
  row due, so the dispatcher *promotes* due rows (``scheduled = false``) at each fill,
  in the fill's transaction (ledger/dispatch.py ``WINDOW_STATE``); the check constraint
  ``scheduled_waiting`` keeps a scheduled row WAITING and unpublished whatever writes it.
- ``ix_background_tasks_ready`` becomes (kind, scheduled, team_id, run_at, id): the
  round-robin walks the ``scheduled = false`` range only, and the quota's count
  (ledger/quota.py) still reads each team's unpublished rows from it, in two ranges.
  Same predicate, so no row enters an index it was not in before.
- ``ix_background_tasks_scheduled`` (run_at) over scheduled rows takes over
  ``ix_background_tasks_due``'s work: the promotion's range scan and the next due time.
  ``ix_background_tasks_due`` itself stays: the previous release reads it by name, and a
  release drops nothing the one before it reads (migration 0011, docs/decisions.md,
  "Expand and contract: the previous release keeps working").

The indexes are built ``CONCURRENTLY`` (no lock that blocks writes on a large ledger); the
new ready index is built beside the old one and takes its name once it is valid. A run
that was interrupted can be run again: an invalid leftover is rebuilt
(ledger/index_build.py).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

from ledger.index_build import create_index_concurrently

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

READY = "status = 'WAITING' AND dispatched_at IS NULL"
CHECK = "ck_background_tasks_scheduled_waiting"

MARK_SCHEDULED = """
    CREATE OR REPLACE FUNCTION teamdesk_mark_scheduled() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        NEW.scheduled := NEW.status = 'WAITING' AND NEW.dispatched_at IS NULL
                         AND NEW.run_at > now();
        RETURN NEW;
    END $$
"""


def upgrade() -> None:
    op.execute(
        "ALTER TABLE background_tasks"
        " ADD COLUMN IF NOT EXISTS scheduled boolean NOT NULL DEFAULT false"
    )
    op.execute(MARK_SCHEDULED)
    op.execute("DROP TRIGGER IF EXISTS background_tasks_scheduled ON background_tasks")
    op.execute(
        "CREATE TRIGGER background_tasks_scheduled"
        " BEFORE INSERT OR UPDATE OF status, run_at, dispatched_at ON background_tasks"
        " FOR EACH ROW EXECUTE FUNCTION teamdesk_mark_scheduled()"
    )
    op.execute(f"UPDATE background_tasks SET scheduled = true WHERE {READY} AND run_at > now()")
    op.execute(f"ALTER TABLE background_tasks DROP CONSTRAINT IF EXISTS {CHECK}")
    op.execute(
        f"ALTER TABLE background_tasks ADD CONSTRAINT {CHECK}"
        f" CHECK (NOT scheduled OR ({READY})) NOT VALID"
    )
    op.execute(f"ALTER TABLE background_tasks VALIDATE CONSTRAINT {CHECK}")
    with op.get_context().autocommit_block():
        # The old ready index is dropped only once its replacement is built and valid; an
        # interrupted run leaves the old one in place, and running again completes it.
        create_index_concurrently(
            "ix_background_tasks_scheduled", "ON background_tasks (run_at) WHERE scheduled"
        )
        create_index_concurrently(
            "ix_background_tasks_ready_0008",
            f"ON background_tasks (kind, scheduled, team_id, run_at, id) WHERE {READY}",
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_background_tasks_ready")
        op.execute("ALTER INDEX ix_background_tasks_ready_0008 RENAME TO ix_background_tasks_ready")


def downgrade() -> None:
    op.execute(
        "CREATE INDEX IF NOT EXISTS ix_background_tasks_due"
        f" ON background_tasks (run_at) WHERE {READY}"
    )
    op.execute("DROP INDEX ix_background_tasks_ready")
    op.execute(
        "CREATE INDEX ix_background_tasks_ready"
        f" ON background_tasks (kind, team_id, run_at, id) WHERE {READY}"
    )
    op.execute("DROP INDEX ix_background_tasks_scheduled")
    op.execute(f"ALTER TABLE background_tasks DROP CONSTRAINT {CHECK}")
    op.execute("DROP TRIGGER background_tasks_scheduled ON background_tasks")
    op.execute("DROP FUNCTION teamdesk_mark_scheduled()")
    op.execute("ALTER TABLE background_tasks DROP COLUMN scheduled")
