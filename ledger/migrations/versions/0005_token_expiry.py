"""API tokens expire and can be revoked; their last use is recorded.

- ``expires_at`` (NOT NULL): every token has an end. Tokens created before this revision
  get 90 days from the upgrade, so no client loses its token the moment it runs.
- ``revoked_at``: set by ``teamdesk-tasks token revoke ID`` (and by demo-seed for its own
  earlier tokens); a revoked token is refused like an unknown one.
- ``last_used_at``: written at most once a minute per token (ledger/tokens.py).
- ``ix_api_tokens_user_id``: ``token list EMAIL`` reads one user's tokens.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

EXISTING_TOKENS_TTL = "90 days"


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "api_tokens", sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("api_tokens", sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(f"UPDATE api_tokens SET expires_at = now() + interval '{EXISTING_TOKENS_TTL}'")
    op.alter_column("api_tokens", "expires_at", nullable=False)
    op.create_index("ix_api_tokens_user_id", "api_tokens", ["user_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_api_tokens_user_id", table_name="api_tokens")
    op.drop_column("api_tokens", "revoked_at")
    op.drop_column("api_tokens", "last_used_at")
    op.drop_column("api_tokens", "expires_at")
