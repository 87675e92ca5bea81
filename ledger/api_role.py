"""The API's database role (docs/design.md, "Processes"): what the internet-facing process
may do to the database, narrower than the application role the workers and the
dispatcher use (ledger/roles.py, whose machinery sets it up the same way).

``teamdesk-tasks migrate --api-role NAME`` runs :func:`grant_api_role` as the schema's
owner (password: ``API_DB_PASSWORD``, sent as a SCRAM verifier), in the transaction and
under the advisory lock of the application role's grants, re-applying them at every run.
The grants are exactly the statements the API runs (api/tasks.py, api/health.py and the
ledger functions they call):

- ``api_tokens``: nothing. A bearer token is resolved through the owner's
  ``teamdesk_resolve_token_v1`` (migration 0014, ledger/tokens.py ``RESOLVE_TOKEN``),
  which also records its use: the role cannot read the hashes of tokens it was not shown.
  Creating, listing and revoking tokens are operators' commands (``teamdesk-tasks
  token``), run as the application role;
- ``background_tasks``: ``SELECT`` of every column but ``result_csv`` and
  ``result_object`` (read, list, the quota's counts, where a CSV is); ``INSERT`` of the
  columns a creation writes only (:data:`CREATED_COLUMNS`: every other column takes its
  default, so a row the API inserts is WAITING with no result); ``UPDATE`` of the
  columns a retry and a cancel write only (:data:`REOPENED_COLUMNS`): never a CSV, its
  key, checksum, size or object, so no statement of this role can plant or swap what a
  download serves; no ``DELETE``;
- ``export_chunks``: nothing. A download reads each chunk through the owner's
  ``teamdesk_export_chunk_v1`` (ledger/artifacts.py ``READ_CHUNK``), which gives it only
  for a live token whose user may see the task now (ledger/permissions.py ``may_see``),
  as it does a CSV an earlier release stored in ``result_csv``; the object of a CSV an
  object store keeps is asked of ``teamdesk_export_object_v1`` the same way (its key ends
  in 128 random bits: the API's store credentials need ``GetObject`` only, never a
  listing, deploy/README.md). A compromised API can
  still queue work in any member's name (within the team's quotas), but it reads no CSV
  except those the tokens presented to it may download;
- ``idempotency_keys``: ``SELECT``, ``INSERT`` and ``DELETE`` (ledger/idempotency.py: a
  creation's or retry's key, read when it is sent again, and its expired row removed
  before the key is taken again); no ``UPDATE``;
- ``task_audit``: ``INSERT`` only (the ``RETRY`` and ``CANCEL`` rows; it reads none);
- ``memberships``: ``SELECT`` (who may see or create what, ledger/permissions.py);
- ``tickets``: ``SELECT`` of ``id`` and ``team_id`` only (a reminder's ticket belongs to
  the team): the API never reads a ticket's content;
- ``users``, ``teams``, ``notifications``, ``system_events``: nothing. Foreign keys are
  checked with the owner's rights, so inserting a task needs no access to ``teams`` or
  ``users``;
- no sequence (``task_audit.id`` is an identity column: its inserts need none);
  ``EXECUTE`` on the three functions above only, not on the dispatcher's ANALYZE and purge.

A table missing from :data:`API_TABLES` gets nothing (tests/unit/test_api_role.py makes a
new table of ``ledger.models`` choose). Like the application role it must not be the
migrating role, own the tables, hold role attributes or be able to do more to a table
through another role (a member of the application role is refused).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.engine import Connection

from ledger.artifacts import CHUNK_FUNCTION, OBJECT_FUNCTION
from ledger.models import background_tasks
from ledger.roles import AppRoleReport, Privilege, RoleSpec, grant_role
from ledger.tokens import RESOLVE_FUNCTION

API_PASSWORD_VAR = "API_DB_PASSWORD"

SELECT = Privilege("SELECT")

# What a creation writes (ledger/creation.py, ``_INSERT``).
CREATED_COLUMNS = ("kind", "team_id", "owner_id", "scope", "filters", "run_at", "trace_parent")
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
    "trace_parent",
)

# What the API reads of a task: everything but a CSV an earlier release stored in the row
# and where an object store keeps one (its key is a capability: downloads ask for it
# through the owner's function).
UNREAD_COLUMNS = frozenset({"result_csv", "result_object"})
READ_COLUMNS = tuple(c.name for c in background_tasks.columns if c.name not in UNREAD_COLUMNS)

API_TABLES: Mapping[str, tuple[Privilege, ...]] = {
    "api_tokens": (),
    "background_tasks": (
        Privilege("SELECT", READ_COLUMNS),
        Privilege("INSERT", CREATED_COLUMNS),
        Privilege("UPDATE", REOPENED_COLUMNS),
    ),
    "export_chunks": (),
    "idempotency_keys": (SELECT, Privilege("INSERT"), Privilege("DELETE")),
    "task_audit": (Privilege("INSERT"),),
    "memberships": (SELECT,),
    "tickets": (Privilege("SELECT", ("id", "team_id")),),
    "users": (),
    "teams": (),
    "notifications": (),
    "system_events": (),
}

API_ROLE = RoleSpec(
    API_PASSWORD_VAR,
    API_TABLES,
    sequences=False,
    functions=frozenset({RESOLVE_FUNCTION, CHUNK_FUNCTION, OBJECT_FUNCTION}),
)


# What the previous release's API (1.0.0) reads that this one does not: its token lookup
# (SELECT on api_tokens, UPDATE of last_used_at) and the CSV in the row. Granted only with
# ``migrate --previous-api-grants``, for a rolling upgrade: the 1.0 API keeps answering
# until it is replaced, then a plain ``migrate --api-role`` takes them back (CHANGELOG.md,
# "Upgrading"; docs/decisions.md, "Expand and contract").
PREVIOUS_API_TABLES: Mapping[str, tuple[Privilege, ...]] = {
    **API_TABLES,
    "api_tokens": (SELECT, Privilege("UPDATE", ("last_used_at",))),
    "background_tasks": (
        Privilege("SELECT", (*READ_COLUMNS, "result_csv")),
        *API_TABLES["background_tasks"][1:],  # its writes: this version's
    ),
}
PREVIOUS_API_ROLE = RoleSpec(
    API_PASSWORD_VAR, PREVIOUS_API_TABLES, sequences=False, functions=API_ROLE.functions
)


def grant_api_role(conn: Connection, role: str, password: str | None) -> AppRoleReport:
    """Create ``role`` (or set its password) and give it exactly the API's grants, in the
    caller's transaction; refused like ledger.roles.grant_app_role."""
    return grant_role(conn, role, password, API_ROLE)


def grant_api_role_with_previous(
    conn: Connection, role: str, password: str | None
) -> AppRoleReport:
    """:func:`grant_api_role`, plus what the previous release's API reads
    (:data:`PREVIOUS_API_TABLES`), for the time of a rolling upgrade."""
    return grant_role(conn, role, password, PREVIOUS_API_ROLE)
