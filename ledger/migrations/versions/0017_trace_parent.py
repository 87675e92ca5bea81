"""The trace a task's run belongs to (docs/design.md, "Tracing"; teamdesk/tracing.py).

- ``background_tasks.trace_parent``: the W3C ``traceparent`` of the span that created the
  task or opened its run (a retry), written with the row when tracing is on, NULL when it
  is off. The dispatcher, which publishes the run later, continues that trace.

Additive only: the previous release neither reads nor writes it.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: a catalog change only, no table rewrite.
    op.execute("ALTER TABLE background_tasks ADD COLUMN IF NOT EXISTS trace_parent text")


def downgrade() -> None:
    # Never part of a rollout: rolling back is code only, the previous release runs on
    # this schema (CHANGELOG.md, "Upgrading"). Only once no process of this version runs.
    op.execute("ALTER TABLE background_tasks DROP COLUMN trace_parent")
