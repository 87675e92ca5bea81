"""The previous release keeps working: ``ix_background_tasks_due`` is back.

Migration 0008 as first written dropped ``ix_background_tasks_due`` (its work went to
``ix_background_tasks_scheduled``), but the release before it (0.9, commit b3ecb40,
migrations up to 0007) still names it: its dispatcher's statistics check reads the index's
row estimate (``CAST('ix_background_tasks_due' AS regclass)``, ledger/dispatch.py
``STATISTICS_DRIFT`` of that release), and an unknown relation is not an error its loop
survives, so its beat died at its next scan once head's migrate ran beside it - and in
Kubernetes, where the migration Job runs before the rollout, crash-looped until the new
beat was up (docs/decisions.md, "Expand and contract: the previous release keeps working").

This revision re-creates the index exactly as the previous release defined it (migration
0001): ``(run_at) WHERE status = 'WAITING' AND dispatched_at IS NULL``, built
``CONCURRENTLY`` (no lock that blocks writes on a large ledger) and idempotently (an
interrupted build is rebuilt by the next run: ledger/index_build.py). No statement of
head reads it; it costs one index entry per ready row, as it did before 0008.

It exists only for the previous release. Drop it in a later release, once no supported
version reads it (the first release whose previous release is 1.0.0 or later), with a
revision of its own - never by editing this one. It is the only object that release names
and head had removed: 0008 to 0010 otherwise only added (two columns, nullable or with a
default, a trigger that keeps one of them, a check constraint that only that trigger's
writes meet, indexes) or re-defined under the same name (``ix_background_tasks_ready``,
``teamdesk_wake_dispatcher()``), which the previous release reads by statement, not by
name.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

from ledger.index_build import create_index_concurrently

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# The previous release's names, with their definitions as that release wrote them. Only
# the previous release reads them (tests/integration/test_schema.py knows them too).
PREVIOUS_RELEASE_INDEXES = {
    "ix_background_tasks_due": (
        "ON background_tasks (run_at) WHERE status = 'WAITING' AND dispatched_at IS NULL"
    ),
}


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for name, definition in PREVIOUS_RELEASE_INDEXES.items():
            create_index_concurrently(name, definition)


def downgrade() -> None:
    # 0008's downgrade creates the index again, so leaving 0011 drops it.
    with op.get_context().autocommit_block():
        for name in PREVIOUS_RELEASE_INDEXES:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
