"""Dispatch from the ledger: the indexes the round-robin selection and the in-flight count
walk, and a statement-level trigger that wakes the dispatcher when tasks are inserted.

- ``ix_background_tasks_ready`` (kind, team_id, run_at, id) over WAITING rows not yet
  published: the loose index scan over busy teams and each team's oldest due rows.
- ``ix_background_tasks_inflight`` (team_id, kind) over RUNNING rows and published WAITING
  rows: each team's and each queue's in-flight count.
- ``background_tasks_wake``: ``NOTIFY teamdesk_dispatch`` once per INSERT statement (a
  10,000-row insert sends one notification). The payload is empty: a notification only
  says "look at the ledger".

Both indexes hold only live rows, and their predicate columns are already indexed, so
updates that were HOT stay HOT.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

READY = "status = 'WAITING' AND dispatched_at IS NULL"
INFLIGHT = "status = 'RUNNING' OR (status = 'WAITING' AND dispatched_at IS NOT NULL)"


def upgrade() -> None:
    op.create_index(
        "ix_background_tasks_ready",
        "background_tasks",
        ["kind", "team_id", "run_at", "id"],
        unique=False,
        postgresql_where=sa.text(READY),
    )
    op.create_index(
        "ix_background_tasks_inflight",
        "background_tasks",
        ["team_id", "kind"],
        unique=False,
        postgresql_where=sa.text(INFLIGHT),
    )
    op.execute("""
        CREATE FUNCTION teamdesk_wake_dispatcher() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            NOTIFY teamdesk_dispatch;
            RETURN NULL;
        END $$
    """)
    op.execute("""
        CREATE TRIGGER background_tasks_wake AFTER INSERT ON background_tasks
            FOR EACH STATEMENT EXECUTE FUNCTION teamdesk_wake_dispatcher()
    """)


def downgrade() -> None:
    op.execute("DROP TRIGGER background_tasks_wake ON background_tasks")
    op.execute("DROP FUNCTION teamdesk_wake_dispatcher()")
    op.drop_index("ix_background_tasks_inflight", table_name="background_tasks")
    op.drop_index("ix_background_tasks_ready", table_name="background_tasks")
