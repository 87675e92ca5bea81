"""The API reads tokens and CSVs only through two functions of the owner (docs/design.md,
"Processes": "The API's role").

- ``teamdesk_resolve_token_v1(token_hash, touch_every_s)``: the live token with this
  hash and its user (revoked and expired tokens give no row, by the database's clock),
  recording the use as ``ledger.tokens.RESOLVE_TOKEN`` did. The API role loses ``SELECT``
  on ``api_tokens``: it can no longer read the hashes of tokens it has not been shown.
- ``teamdesk_export_chunk_v1(token_hash, task_id, csv_key, seq)``: chunk ``seq`` of a
  kept CSV, given only to a live token whose user may see the task now (the rule of
  ``ledger.permissions.may_see``: a TEAM export to the team's staff, a MINE export to its
  creator while a member). ``csv_key`` is the execution the completion named
  (``result_key``), NULL for a CSV the previous release stored in ``result_csv``, which
  is cut into chunks of the same size here. The API role loses ``SELECT`` on
  ``export_chunks`` and on ``background_tasks.result_csv``: a compromised API reads no
  CSV but those its callers' tokens may download.

Both are ``SECURITY DEFINER`` with a fixed ``search_path`` and the schema written in, and
``EXECUTE`` is revoked from ``PUBLIC``; ``migrate --app-role``/``--api-role`` grant them
(ledger/database_roles.py). Versioned names: a later change of either is a new function beside this
one (expand and contract), so a process of the previous release keeps calling its own.

Additive only: the previous release neither calls nor needs them.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

CHUNK_BYTES = 1 << 20  # ledger.artifacts.CHUNK_BYTES when this revision was written


def resolve_token(schema: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION teamdesk_resolve_token_v1(
            p_token_hash text, p_touch_every_s double precision)
        RETURNS TABLE (token_id uuid, token_user_id uuid)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $$
        BEGIN
            -- A row another request is touching right now is skipped, never waited for.
            RETURN QUERY
            WITH live AS (
                SELECT k.id, k.user_id FROM {schema}.api_tokens k
                 WHERE k.token_hash = p_token_hash AND k.revoked_at IS NULL
                   AND k.expires_at > now()
            ), stale AS (
                SELECT k.id FROM {schema}.api_tokens k JOIN live ON live.id = k.id
                 WHERE k.last_used_at IS NULL
                    OR k.last_used_at < now() - make_interval(secs => p_touch_every_s)
                   FOR UPDATE OF k SKIP LOCKED
            ), touched AS (
                UPDATE {schema}.api_tokens k SET last_used_at = now()
                 WHERE k.id IN (SELECT stale.id FROM stale)
            )
            SELECT live.id, live.user_id FROM live;
        END
        $$
    """


def export_chunk(schema: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION teamdesk_export_chunk_v1(
            p_token_hash text, p_task_id uuid, p_csv_key uuid, p_seq integer)
        RETURNS bytea
        LANGUAGE plpgsql STABLE SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $$
        DECLARE
            piece bytea;
        BEGIN
            -- The CSV is kept, it is the one the caller asked for, and the token's user
            -- may see its task now (ledger.permissions.may_see).
            PERFORM FROM {schema}.background_tasks t
              JOIN {schema}.api_tokens k
                ON k.token_hash = p_token_hash AND k.revoked_at IS NULL
               AND k.expires_at > now()
              JOIN {schema}.memberships m ON m.team_id = t.team_id AND m.user_id = k.user_id
             WHERE t.id = p_task_id AND t.kind = 'EXPORT' AND t.status = 'COMPLETED'
               AND t.expires_at > now() AND t.result_key IS NOT DISTINCT FROM p_csv_key
               AND CASE WHEN t.scope = 'TEAM' THEN m.role = 'STAFF'
                        ELSE t.owner_id = k.user_id END;
            IF NOT FOUND OR p_seq < 0 THEN
                RETURN NULL;
            END IF;
            IF p_csv_key IS NOT NULL THEN
                SELECT c.data INTO piece FROM {schema}.export_chunks c
                 WHERE c.task_id = p_task_id AND c.execution_id = p_csv_key AND c.seq = p_seq;
                RETURN piece;
            END IF;
            -- A CSV the previous release stored in the row, in pieces of the same size.
            SELECT substring(convert_to(t.result_csv, 'UTF8')
                             FROM p_seq * {CHUNK_BYTES} + 1 FOR {CHUNK_BYTES})
              INTO piece FROM {schema}.background_tasks t WHERE t.id = p_task_id;
            RETURN nullif(piece, ''::bytea);
        END
        $$
    """


SIGNATURES = (
    "teamdesk_resolve_token_v1(text, double precision)",
    "teamdesk_export_chunk_v1(text, uuid, uuid, integer)",
)


def upgrade() -> None:
    bind = op.get_bind()
    schema = bind.execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(resolve_token(schema))
    op.execute(export_chunk(schema))
    for signature in SIGNATURES:
        op.execute(f"REVOKE EXECUTE ON FUNCTION {signature} FROM PUBLIC")


def downgrade() -> None:
    for signature in SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
