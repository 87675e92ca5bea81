"""The insert trigger wakes the dispatcher only when the statement inserted a row.

``background_tasks_wake`` (migration 0004) notified once per INSERT statement, rows or
none. A creation is now one ``INSERT ... SELECT ... WHERE <the rules>`` (ledger/creation.py),
so a refused creation is an INSERT of no row: it committed a notification, and the
dispatcher filled for nothing, once per 429 during a burst of them. The trigger now reads
the statement's inserted rows (a transition table) and notifies only when there is one.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE OR REPLACE FUNCTION teamdesk_wake_dispatcher() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM inserted) THEN
                NOTIFY teamdesk_dispatch;
            END IF;
            RETURN NULL;
        END $$
    """)
    op.execute("DROP TRIGGER background_tasks_wake ON background_tasks")
    op.execute("""
        CREATE TRIGGER background_tasks_wake AFTER INSERT ON background_tasks
            REFERENCING NEW TABLE AS inserted
            FOR EACH STATEMENT EXECUTE FUNCTION teamdesk_wake_dispatcher()
    """)


def downgrade() -> None:
    op.execute("DROP TRIGGER background_tasks_wake ON background_tasks")
    op.execute("""
        CREATE OR REPLACE FUNCTION teamdesk_wake_dispatcher() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            NOTIFY teamdesk_dispatch;
            RETURN NULL;
        END $$
    """)
    op.execute("""
        CREATE TRIGGER background_tasks_wake AFTER INSERT ON background_tasks
            FOR EACH STATEMENT EXECUTE FUNCTION teamdesk_wake_dispatcher()
    """)
