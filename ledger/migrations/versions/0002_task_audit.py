"""Task audit trail: one append-only row per change of a task's lease or run.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "task_audit",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("run", sa.Integer(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("execution_id", sa.UUID(), nullable=True),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "event IN ('CLAIM', 'COMPLETE', 'WAIT', 'FAIL', 'RECOVER', 'RECONCILE', 'CANCEL', "
            "'RETRY')",
            name=op.f("ck_task_audit_event"),
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["background_tasks.id"], name=op.f("fk_task_audit_task_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_audit")),
    )
    op.create_index("ix_task_audit_task_id", "task_audit", ["task_id", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_task_audit_task_id", table_name="task_audit")
    op.drop_table("task_audit")
