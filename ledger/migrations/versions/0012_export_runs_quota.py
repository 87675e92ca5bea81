"""The daily export quota counts runs where they run: ``run_opened_at``.

- ``background_tasks.run_opened_at``: when the row's current run was opened - its creation,
  or the manual retry that opened it (``ledger/service.py`` ``RETRY``). The daily export
  quota (ledger/quota.py) counts and sums a team's exports whose current run opened in
  the last 24 hours, so a retry of an export created on an earlier day counts on the day
  it runs (before, the quota counted by ``created_at`` and such a retry counted nowhere).
  Nullable with a default of ``now()``: adding it rewrites nothing, and every insert,
  the previous release's included, fills it. The exports of the last day are filled from
  ``created_at``; older rows stay NULL, which no window reads.
- ``ix_background_tasks_team_export_runs`` (team_id, run_opened_at) over exports: the
  quota's read, as ``ix_background_tasks_team_exports`` was. That one stays while the
  previous release (whose quota reads by ``created_at``) is supported; a later revision
  drops it. Built ``CONCURRENTLY`` (ledger/index_build.py).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

from ledger.index_build import create_index_concurrently

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # One statement, one take of the table's lock: the running processes' statements wait
    # for it only that long (a catalog change, no rewrite).
    op.execute(
        "ALTER TABLE background_tasks ADD COLUMN IF NOT EXISTS run_opened_at timestamptz,"
        " ALTER COLUMN run_opened_at SET DEFAULT now()"
    )
    with op.get_context().autocommit_block():
        # After the lock is released, in a transaction of its own (row locks only).
        op.execute(
            "UPDATE background_tasks SET run_opened_at = created_at"
            " WHERE run_opened_at IS NULL AND kind = 'EXPORT'"
            " AND created_at > now() - interval '1 day'"
        )
        create_index_concurrently(
            "ix_background_tasks_team_export_runs",
            "ON background_tasks (team_id, run_opened_at) WHERE kind = 'EXPORT'",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_background_tasks_team_export_runs")
    op.execute("ALTER TABLE background_tasks DROP COLUMN run_opened_at")
