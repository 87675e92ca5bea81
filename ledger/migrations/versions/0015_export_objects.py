"""Exports' CSVs in an S3-compatible object store (docs/design.md, "Exports": "Where a CSV
is kept").

- ``background_tasks.result_object``: where the CSV is when ``EXPORT_STORE`` is an object
  store: ``s3://BUCKET/KEY``, set by the fenced completion with ``result_key`` (the
  execution that uploaded it), ``result_sha256`` and ``result_bytes``; NULL when the CSV
  is in ``export_chunks``. The key names the task and the execution and ends in 128
  random bits: nobody can name an object without reading it here, and the API's role
  may not read this column.
- ``ix_background_tasks_objects_expiring`` (expires_at) over rows naming an object: the
  dispatcher's expiry step deletes the object, then forgets it.
- ``teamdesk_export_object_v1(token_hash, task_id)``: the object of a kept CSV, given only
  to a live token whose user may see the task now (the rule of
  ``teamdesk_export_chunk_v1``, 0014); NULL otherwise, and when the CSV is not in an
  object store. ``SECURITY DEFINER``, a fixed ``search_path``, no ``EXECUTE`` for
  ``PUBLIC``.

Additive only: the previous release neither reads nor writes any of it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.index_build import create_index_concurrently

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

SIGNATURE = "teamdesk_export_object_v1(text, uuid)"


def export_object(schema: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION teamdesk_export_object_v1(p_token_hash text, p_task_id uuid)
        RETURNS text
        LANGUAGE sql STABLE SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $$
            SELECT t.result_object FROM {schema}.background_tasks t
              JOIN {schema}.api_tokens k
                ON k.token_hash = p_token_hash AND k.revoked_at IS NULL
               AND k.expires_at > now()
              JOIN {schema}.memberships m ON m.team_id = t.team_id AND m.user_id = k.user_id
             WHERE t.id = p_task_id AND t.kind = 'EXPORT' AND t.status = 'COMPLETED'
               AND t.expires_at > now()
               AND CASE WHEN t.scope = 'TEAM' THEN m.role = 'STAFF'
                        ELSE t.owner_id = k.user_id END
        $$
    """


def upgrade() -> None:
    bind = op.get_bind()
    schema = bind.execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute("ALTER TABLE background_tasks ADD COLUMN IF NOT EXISTS result_object text")
    op.execute(export_object(schema))
    op.execute(f"REVOKE EXECUTE ON FUNCTION {SIGNATURE} FROM PUBLIC")
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "ix_background_tasks_objects_expiring",
            "ON background_tasks (expires_at) WHERE result_object IS NOT NULL",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_background_tasks_objects_expiring")
    op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
    op.execute("ALTER TABLE background_tasks DROP COLUMN result_object")
