"""The API's database role (docs/design.md, "Processes"): what the internet-facing process
may do to the database, narrower than the application role the workers and the
dispatcher use (ledger/roles.py, whose machinery sets it up the same way).

``teamdesk-tasks migrate --api-role NAME`` runs :func:`grant_api_role` as the schema's
owner (password: ``API_DB_PASSWORD``, sent as a SCRAM verifier), in the transaction and
under the advisory lock of the application role's grants, re-applying them at every run.
The grants are exactly the statements the API runs (api/tasks.py, api/health.py and the
ledger functions they call):

- ``api_tokens``: ``SELECT`` (the bearer lookup, ledger/tokens.py ``RESOLVE_TOKEN``) and
  ``UPDATE`` of ``last_used_at`` only (its touch; ``FOR UPDATE ... SKIP LOCKED`` needs an
  ``UPDATE`` privilege, this column's is enough). Creating, listing and revoking tokens
  are operators' commands (``teamdesk-tasks token``), run as the application role;
- ``background_tasks``: ``SELECT`` (read, list, the quota's counts, where a CSV is);
  ``INSERT`` of the columns a creation writes only (:data:`CREATED_COLUMNS`: every other
  column takes its default, so a row the API inserts is WAITING with no result); ``UPDATE``
  of the columns a retry and a cancel write only (:data:`REOPENED_COLUMNS`): never a
  CSV, its key, checksum or size, so no statement of this role can plant or swap what a
  download serves; no ``DELETE``;
- ``export_chunks``: ``SELECT`` (the download streams them, api/downloads.py); no write;
- ``task_audit``: ``INSERT`` only (the ``RETRY`` and ``CANCEL`` rows; it reads none);
- ``memberships``: ``SELECT`` (who may see or create what, ledger/permissions.py);
- ``tickets``: ``SELECT`` of ``id`` and ``team_id`` only (a reminder's ticket belongs to
  the team): the API never reads a ticket's content;
- ``users``, ``teams``, ``notifications``, ``system_events``: nothing. Foreign keys are
  checked with the owner's rights, so inserting a task needs no access to ``teams`` or
  ``users``;
- no sequence (``task_audit.id`` is an identity column: its inserts need none), no
  ``EXECUTE`` on the dispatcher's ANALYZE and purge functions.

A table missing from :data:`API_TABLES` gets nothing (tests/unit/test_api_role.py makes a
new table of ``ledger.models`` choose). Like the application role it must not be the
migrating role, own the tables, hold role attributes or be able to do more to a table
through another role (a member of the application role is refused).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.engine import Connection

from ledger.roles import AppRoleReport, Privilege, RoleSpec, grant_role

API_PASSWORD_VAR = "API_DB_PASSWORD"

SELECT = Privilege("SELECT")

# What a creation writes (ledger/creation.py, ``_INSERT``).
CREATED_COLUMNS = ("kind", "team_id", "owner_id", "scope", "filters", "run_at")
# What a retry and a cancel write (ledger/service.py, ``RETRY`` and ``_CANCEL``).
REOPENED_COLUMNS = (
    "run",
    "status",
    "progress",
    "attempts",
    "last_error",
    "execution_id",
    "lease_holder",
    "dispatched_at",
    "result_summary",
    "expires_at",
    "recoveries",
    "run_at",
    "run_opened_at",
    "updated_at",
)

API_TABLES: Mapping[str, tuple[Privilege, ...]] = {
    "api_tokens": (SELECT, Privilege("UPDATE", ("last_used_at",))),
    "background_tasks": (
        SELECT,
        Privilege("INSERT", CREATED_COLUMNS),
        Privilege("UPDATE", REOPENED_COLUMNS),
    ),
    "export_chunks": (SELECT,),
    "task_audit": (Privilege("INSERT"),),
    "memberships": (SELECT,),
    "tickets": (Privilege("SELECT", ("id", "team_id")),),
    "users": (),
    "teams": (),
    "notifications": (),
    "system_events": (),
}

API_ROLE = RoleSpec(API_PASSWORD_VAR, API_TABLES, sequences=False, functions=False)


def grant_api_role(conn: Connection, role: str, password: str | None) -> AppRoleReport:
    """Create ``role`` (or set its password) and give it exactly the API's grants, in the
    caller's transaction; refused like ledger.roles.grant_app_role."""
    return grant_role(conn, role, password, API_ROLE)
