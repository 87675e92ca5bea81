"""Building an index ``CONCURRENTLY`` inside a migration, so that a run that was
interrupted (cancelled, timed out, the server restarted) can simply be run again.

``CREATE INDEX CONCURRENTLY`` that fails or is cancelled leaves its index behind, marked
invalid (``pg_index.indisvalid = false``): the planner never uses it, yet ``IF NOT
EXISTS`` sees it and builds nothing, so a second ``migrate`` would report success with
the index still unusable. :func:`create_index_concurrently` drops such a leftover first
and checks that the index it leaves is valid; the caller's next step (dropping the index
it replaces) runs only then.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.errors import LedgerError

INDEX_VALID = sa.text("""
    SELECT i.indisvalid FROM pg_index i
      JOIN pg_class c ON c.oid = i.indexrelid
      JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.relname = :name AND n.nspname = current_schema()
""")


class IndexBuildFailed(LedgerError):
    """An index built CONCURRENTLY did not come out valid."""


def index_valid(name: str) -> bool | None:
    """Whether the index ``name`` is valid; None when there is none."""
    value = op.get_bind().execute(INDEX_VALID, {"name": name}).scalar()
    return None if value is None else bool(value)


def create_index_concurrently(name: str, definition: str) -> None:
    """``CREATE INDEX CONCURRENTLY name definition`` (``ON table (...) WHERE ...``), run
    inside the migration's ``autocommit_block``: an invalid leftover of an interrupted
    build is dropped first, a valid index of that name is kept, and the index must be
    valid afterwards, or :class:`IndexBuildFailed` says to run the migration again."""
    if index_valid(name) is False:
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} {definition}")
    if index_valid(name) is not True:
        raise IndexBuildFailed(
            f"index {name} was not built (an interrupted concurrent build leaves it "
            "invalid); run migrate again: it drops the invalid index and builds it anew"
        )
