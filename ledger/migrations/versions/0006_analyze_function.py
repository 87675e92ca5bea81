"""The dispatcher refreshes the ledger's statistics through a function of the owner.

``ANALYZE`` needs the table's ownership before PostgreSQL 17, and every process but
``migrate`` runs as the application role (ledger/database_roles.py): as that role the server
skipped the dispatcher's ``ANALYZE background_tasks`` with a warning nobody saw, and a
burst of tasks waited for autovacuum's statistics. ``teamdesk_analyze_ledger()`` runs
that one statement with its owner's rights (``SECURITY DEFINER``, a fixed
``search_path``); only roles granted ``EXECUTE`` may call it (the application role is).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    # The function's search_path leaves the tables' schema out (no object of another
    # schema can stand in for the table), so the table is named with its schema.
    schema = bind.execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(f"""
        CREATE FUNCTION teamdesk_analyze_ledger() RETURNS void
        LANGUAGE sql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $$ ANALYZE {schema}.background_tasks $$
    """)
    op.execute("REVOKE EXECUTE ON FUNCTION teamdesk_analyze_ledger() FROM PUBLIC")


def downgrade() -> None:
    op.execute("DROP FUNCTION teamdesk_analyze_ledger()")
