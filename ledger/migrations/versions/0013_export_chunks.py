"""Exports' CSVs in bounded chunks beside the ledger row (docs/design.md, "Exports").

- ``export_chunks`` (task_id, execution_id, seq, data): the CSV an execution wrote, in
  pieces of at most ``ledger.artifacts.CHUNK_BYTES`` (lz4-compressed like
  ``result_csv`` was, 0003). The worker writes them while its read streams; the API reads
  them one at a time. Keyed by the execution, so a replaced or late execution can never
  write into the chunks of another; deleted with their task (``ON DELETE CASCADE``).
- ``background_tasks.result_key``: the execution whose chunks are the CSV, set by the
  fenced completion with ``result_sha256`` (of the whole CSV); only those chunks are ever
  served. ``result_bytes`` (0009) is their size. ``result_csv`` stays for the CSVs the
  previous release writes and for those stored before this revision (served until they
  expire); nothing of this release writes it.
- ``ix_export_chunks_created_at`` over each execution's first chunk: the retention
  step's walk for orphans (chunks of executions that never completed).
- ``ix_background_tasks_results_expiring`` (expires_at) over rows holding chunks: the
  dispatcher's expiry step, as ``ix_background_tasks_expiring`` is for ``result_csv``.

Additive only: the previous release neither reads nor writes any of it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

from ledger.index_build import create_index_concurrently

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # background_tasks first, in one statement: its strongest lock is taken once and
    # before anything else. Taking it after the foreign key below (which takes a weaker
    # one) would upgrade a lock held while the running processes hold theirs: a deadlock
    # with a reminder's transaction (seen by tests/process/test_upgrade.py).
    op.execute(
        "ALTER TABLE background_tasks ADD COLUMN IF NOT EXISTS result_key uuid,"
        " ADD COLUMN IF NOT EXISTS result_sha256 text"
    )
    op.execute("""
        CREATE TABLE IF NOT EXISTS export_chunks (
            task_id uuid NOT NULL,
            execution_id uuid NOT NULL,
            seq integer NOT NULL,
            data bytea NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT pk_export_chunks PRIMARY KEY (task_id, execution_id, seq),
            CONSTRAINT fk_export_chunks_task_id FOREIGN KEY (task_id)
                REFERENCES background_tasks (id) ON DELETE CASCADE,
            CONSTRAINT ck_export_chunks_seq CHECK (seq >= 0)
        )
    """)
    op.execute("ALTER TABLE export_chunks ALTER COLUMN data SET COMPRESSION lz4")
    # A new, empty table: no CONCURRENTLY needed.
    op.execute(
        "CREATE INDEX IF NOT EXISTS ix_export_chunks_created_at"
        " ON export_chunks (created_at) WHERE seq = 0"
    )
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "ix_background_tasks_results_expiring",
            "ON background_tasks (expires_at) WHERE result_key IS NOT NULL",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_background_tasks_results_expiring")
    op.execute("ALTER TABLE background_tasks DROP COLUMN result_sha256")
    op.execute("ALTER TABLE background_tasks DROP COLUMN result_key")
    op.execute("DROP TABLE export_chunks")
