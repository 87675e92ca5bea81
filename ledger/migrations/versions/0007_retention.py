"""Retention: finished tasks and the audit trail are removed after their retention.

- ``ix_background_tasks_finished``: finished rows by ``updated_at`` (when they finished),
  so the purge finds the oldest finished tasks without reading the others. Built
  ``CONCURRENTLY``: no lock that blocks writes on a large ledger.
- ``notifications.task_id`` may be NULL and is set to NULL when its task is removed: a
  notification is the user's, and outlives the task that sent it.
- ``teamdesk_purge_ledger(task_retention_s, audit_retention_s, batch)``: the application
  role may not delete audit rows (the trail is append-only for it, ledger/database_roles.py), so the
  dispatcher removes them through this function of the owner (``SECURITY DEFINER``, a
  fixed ``search_path``), which removes only what is past its retention - never less
  than a day old - and at most ``batch`` rows of each kind per call (ledger/retention.py).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

FINISHED = "status IN ('COMPLETED', 'FAILED', 'CANCELLED')"


def purge_function(schema: str) -> str:
    return f"""
        CREATE FUNCTION teamdesk_purge_ledger(
            task_retention_s double precision, audit_retention_s double precision,
            batch integer, OUT tasks integer, OUT audit integer)
        LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $$
        BEGIN
            -- The oldest audit rows by id (the order they were written in): a bounded
            -- read of the primary key's head, whatever the table's size.
            WITH head AS (
                SELECT id, at FROM {schema}.task_audit ORDER BY id LIMIT batch
            )
            DELETE FROM {schema}.task_audit a USING head
             WHERE a.id = head.id
               AND head.at < now() - make_interval(secs => greatest(audit_retention_s, 86400));
            GET DIAGNOSTICS audit = ROW_COUNT;
            -- Finished tasks past their retention, with what is left of their trail.
            WITH gone AS (
                SELECT id FROM {schema}.background_tasks
                 WHERE {FINISHED}
                   AND updated_at < now() - make_interval(secs => greatest(task_retention_s, 86400))
                 ORDER BY updated_at LIMIT batch
                   FOR UPDATE SKIP LOCKED
            ), trail AS (
                DELETE FROM {schema}.task_audit a USING gone WHERE a.task_id = gone.id
            )
            DELETE FROM {schema}.background_tasks t USING gone WHERE t.id = gone.id;
            GET DIAGNOSTICS tasks = ROW_COUNT;
        END
        $$
    """


def upgrade() -> None:
    bind = op.get_bind()
    schema = bind.execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one()
    op.alter_column("notifications", "task_id", nullable=True)
    op.drop_constraint("fk_notifications_task_id", "notifications", type_="foreignkey")
    op.execute(
        "ALTER TABLE notifications ADD CONSTRAINT fk_notifications_task_id"
        " FOREIGN KEY (task_id) REFERENCES background_tasks (id) ON DELETE SET NULL NOT VALID"
    )
    op.execute("ALTER TABLE notifications VALIDATE CONSTRAINT fk_notifications_task_id")
    op.execute(purge_function(schema))
    op.execute(
        "REVOKE EXECUTE ON FUNCTION teamdesk_purge_ledger(double precision, double precision,"
        " integer) FROM PUBLIC"
    )
    with op.get_context().autocommit_block():
        op.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_background_tasks_finished"
            f" ON background_tasks (updated_at) WHERE {FINISHED}"
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_background_tasks_finished")
    op.execute("DROP FUNCTION teamdesk_purge_ledger(double precision, double precision, integer)")
    op.drop_constraint("fk_notifications_task_id", "notifications", type_="foreignkey")
    op.create_foreign_key(
        "fk_notifications_task_id", "notifications", "background_tasks", ["task_id"], ["id"]
    )
    op.alter_column("notifications", "task_id", nullable=False)
