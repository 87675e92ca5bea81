"""Idempotency keys (docs/design.md, "Idempotent requests"; ledger/idempotency.py).

- ``idempotency_keys`` (team_id, key) → the request's fingerprint (SHA-256 of its route,
  its user and its body), the task it created or retried and that run; kept 24 hours
  (``created_at``, the database's clock). The primary key is what makes concurrent
  requests with one key create one task: the second insert of a key waits for the first
  and fails, its task with it, in the same statement.
- ``ix_idempotency_keys_created_at``: the dispatcher's purge walks the expired ones.

No foreign key to the task: a key lives a day, a task at least a day (ledger/retention.py),
and a cascade from every task the retention removes would need one more index.

Additive only: the previous release neither reads nor writes it.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE IF NOT EXISTS idempotency_keys (
            team_id uuid NOT NULL,
            key text NOT NULL,
            user_id uuid NOT NULL,
            fingerprint bytea NOT NULL,
            task_id uuid NOT NULL,
            run integer NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT pk_idempotency_keys PRIMARY KEY (team_id, key)
        )
    """)
    # A new, empty table: no CONCURRENTLY needed.
    op.execute(
        "CREATE INDEX IF NOT EXISTS ix_idempotency_keys_created_at ON idempotency_keys (created_at)"
    )


def downgrade() -> None:
    # Never part of a rollout: rolling back is code only, the previous release runs on
    # this schema (CHANGELOG.md, "Upgrading"). Only once no process of this version runs.
    op.execute("DROP TABLE idempotency_keys")
