"""Daily export quota: the CSV bytes each export stored, and a team's exports by creation.

- ``background_tasks.result_bytes``: the size of the CSV an export's completion stored
  (UTF-8 bytes, as downloaded), NULL for every other row. A team's exports of the last
  24 hours are summed against ``TEAM_EXPORT_BYTES_PER_DAY`` at each new export
  (ledger/quota.py); the compressed CSV itself is never read for it.
- ``ix_background_tasks_team_exports`` (team_id, created_at) over exports only: the
  quota's count and sum read a team's last 24 hours of exports, not its reminders. Built
  ``CONCURRENTLY``: no lock that blocks writes on a large ledger (an interrupted build is
  rebuilt by the next run: ledger/index_build.py).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

from ledger.index_build import create_index_concurrently

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE background_tasks ADD COLUMN IF NOT EXISTS result_bytes bigint")
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "ix_background_tasks_team_exports",
            "ON background_tasks (team_id, created_at) WHERE kind = 'EXPORT'",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_background_tasks_team_exports")
    op.execute("ALTER TABLE background_tasks DROP COLUMN result_bytes")
