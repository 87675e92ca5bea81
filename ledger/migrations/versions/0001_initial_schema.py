"""Initial schema: the ledger and business tables, their constraints and the dispatcher's indexes.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 10:55:34.993419
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_teams")),
    )
    op.create_table(
        "users",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("email", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("email", name=op.f("uq_users_email")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("token_hash", sa.Text(), nullable=False),
        sa.Column("user_id", sa.UUID(), nullable=False),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_api_tokens_user_id")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "background_tasks",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("team_id", sa.UUID(), nullable=False),
        sa.Column("owner_id", sa.UUID(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("filters", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.Text(), server_default="WAITING", nullable=False),
        sa.Column("run", sa.Integer(), server_default="0", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("progress", sa.Integer(), server_default="0", nullable=False),
        sa.Column("execution_id", sa.UUID(), nullable=True),
        sa.Column("lease_holder", sa.Text(), nullable=True),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "run_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("recoveries", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("result_csv", sa.Text(), nullable=True),
        sa.Column("result_summary", sa.Text(), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "kind = 'EXPORT' OR scope = 'TEAM'", name=op.f("ck_background_tasks_reminder_scope")
        ),
        sa.CheckConstraint("kind IN ('EXPORT', 'REMINDER')", name=op.f("ck_background_tasks_kind")),
        sa.CheckConstraint("scope IN ('TEAM', 'MINE')", name=op.f("ck_background_tasks_scope")),
        sa.CheckConstraint(
            "status = 'RUNNING' OR execution_id IS NULL",
            name=op.f("ck_background_tasks_lease_only_running"),
        ),
        sa.CheckConstraint(
            "status IN ('WAITING', 'RUNNING', 'COMPLETED', 'FAILED', 'CANCELLED')",
            name=op.f("ck_background_tasks_status"),
        ),
        sa.CheckConstraint("progress BETWEEN 0 AND 100", name=op.f("ck_background_tasks_progress")),
        sa.CheckConstraint(
            "run >= 0 AND attempts >= 0 AND recoveries >= 0",
            name=op.f("ck_background_tasks_counters"),
        ),
        sa.ForeignKeyConstraint(
            ["owner_id"], ["users.id"], name=op.f("fk_background_tasks_owner_id")
        ),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_background_tasks_team_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_background_tasks")),
    )
    op.create_index(
        "ix_background_tasks_dispatched",
        "background_tasks",
        ["dispatched_at"],
        unique=False,
        postgresql_where=sa.text("status = 'WAITING' AND dispatched_at IS NOT NULL"),
    )
    op.create_index(
        "ix_background_tasks_due",
        "background_tasks",
        ["run_at"],
        unique=False,
        postgresql_where=sa.text("status = 'WAITING' AND dispatched_at IS NULL"),
    )
    op.create_index(
        "ix_background_tasks_expiring",
        "background_tasks",
        ["expires_at"],
        unique=False,
        postgresql_where=sa.text("result_csv IS NOT NULL"),
    )
    op.create_index(
        "ix_background_tasks_running",
        "background_tasks",
        ["updated_at"],
        unique=False,
        postgresql_where=sa.text("status = 'RUNNING'"),
    )
    op.create_index(
        "ix_background_tasks_team_created",
        "background_tasks",
        ["team_id", "created_at"],
        unique=False,
    )
    op.create_table(
        "memberships",
        sa.Column("team_id", sa.UUID(), nullable=False),
        sa.Column("user_id", sa.UUID(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("role IN ('STAFF', 'CUSTOMER')", name=op.f("ck_memberships_role")),
        sa.ForeignKeyConstraint(["team_id"], ["teams.id"], name=op.f("fk_memberships_team_id")),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_memberships_user_id")),
        sa.PrimaryKeyConstraint("team_id", "user_id", name=op.f("pk_memberships")),
    )
    op.create_index("ix_memberships_user_id", "memberships", ["user_id"], unique=False)
    op.create_table(
        "tickets",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("team_id", sa.UUID(), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="OPEN", nullable=False),
        sa.Column("priority", sa.Text(), server_default="NORMAL", nullable=False),
        sa.Column("requester_id", sa.UUID(), nullable=False),
        sa.Column("assignee_id", sa.UUID(), nullable=True),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("version", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "priority IN ('LOW', 'NORMAL', 'HIGH', 'URGENT')", name=op.f("ck_tickets_priority")
        ),
        sa.CheckConstraint(
            "status IN ('OPEN', 'PENDING', 'RESOLVED', 'CLOSED')", name=op.f("ck_tickets_status")
        ),
        sa.CheckConstraint("version >= 0", name=op.f("ck_tickets_version")),
        sa.ForeignKeyConstraint(["assignee_id"], ["users.id"], name=op.f("fk_tickets_assignee_id")),
        sa.ForeignKeyConstraint(
            ["requester_id"], ["users.id"], name=op.f("fk_tickets_requester_id")
        ),
        sa.ForeignKeyConstraint(["team_id"], ["teams.id"], name=op.f("fk_tickets_team_id")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tickets")),
    )
    op.create_index(
        "ix_tickets_team_created", "tickets", ["team_id", "created_at", "id"], unique=False
    )
    op.create_table(
        "notifications",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("user_id", sa.UUID(), nullable=False),
        sa.Column("ticket_id", sa.UUID(), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("kind", sa.Text(), server_default="TICKET_REMINDER", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["background_tasks.id"], name=op.f("fk_notifications_task_id")
        ),
        sa.ForeignKeyConstraint(
            ["ticket_id"], ["tickets.id"], name=op.f("fk_notifications_ticket_id")
        ),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_notifications_user_id")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notifications")),
        sa.UniqueConstraint("task_id", "user_id", name="uq_notifications_task_user"),
    )
    op.create_table(
        "system_events",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("team_id", sa.UUID(), nullable=False),
        sa.Column("ticket_id", sa.UUID(), nullable=True),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column(
            "payload",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["team_id"], ["teams.id"], name=op.f("fk_system_events_team_id")),
        sa.ForeignKeyConstraint(
            ["ticket_id"], ["tickets.id"], name=op.f("fk_system_events_ticket_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_system_events")),
    )
    op.create_index("ix_system_events_ticket_id", "system_events", ["ticket_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_system_events_ticket_id", table_name="system_events")
    op.drop_table("system_events")
    op.drop_table("notifications")
    op.drop_index("ix_tickets_team_created", table_name="tickets")
    op.drop_table("tickets")
    op.drop_index("ix_memberships_user_id", table_name="memberships")
    op.drop_table("memberships")
    op.drop_index("ix_background_tasks_team_created", table_name="background_tasks")
    op.drop_index(
        "ix_background_tasks_running",
        table_name="background_tasks",
        postgresql_where=sa.text("status = 'RUNNING'"),
    )
    op.drop_index(
        "ix_background_tasks_expiring",
        table_name="background_tasks",
        postgresql_where=sa.text("result_csv IS NOT NULL"),
    )
    op.drop_index(
        "ix_background_tasks_due",
        table_name="background_tasks",
        postgresql_where=sa.text("status = 'WAITING' AND dispatched_at IS NULL"),
    )
    op.drop_index(
        "ix_background_tasks_dispatched",
        table_name="background_tasks",
        postgresql_where=sa.text("status = 'WAITING' AND dispatched_at IS NOT NULL"),
    )
    op.drop_table("background_tasks")
    op.drop_table("api_tokens")
    op.drop_table("users")
    op.drop_table("teams")
