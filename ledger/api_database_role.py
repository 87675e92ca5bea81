"""The API's database role: exactly the statements the API runs, narrower than the
application role whose machinery sets it up (ledger/database_roles.py; docs/design.md,
"Processes"; its grants: deploy/security.md, "The database roles").

No ``UPDATE`` on ``idempotency_keys``; foreign keys are checked with the owner's rights,
so inserting a task needs nothing on ``teams`` or ``users``; ``task_audit.id`` is an
identity column, so no sequence. The API's store credentials need ``GetObject`` only,
never a listing (object keys end in 128 random bits; deploy/security.md, "Object store").
A table missing from :data:`API_TABLES` gets nothing (tests/unit/test_api_role_grants.py makes
a new table of ``ledger.models`` choose).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.engine import Connection

from ledger.artifacts import CHUNK_FUNCTION, OBJECT_FUNCTION
from ledger.database_roles import AppRoleReport, Privilege, RoleSpec, grant_role
from ledger.models import background_tasks
from ledger.tokens import RESOLVE_FUNCTION

API_PASSWORD_VAR = "API_DB_PASSWORD"

SELECT = Privilege("SELECT")

# What a creation writes (ledger/creation.py, ``_CREATE``).
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

# A CSV in the row, and an object's key (a capability: downloads ask the owner's function).
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


# What the 1.0.0 API reads that this one does not (its token lookup, the CSV in the row),
# granted only with ``migrate --previous-api-grants`` during a rolling upgrade (CHANGELOG.md,
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
    caller's transaction; refused like ledger.database_roles.grant_app_role."""
    return grant_role(conn, role, password, API_ROLE)


def grant_api_role_with_previous(
    conn: Connection, role: str, password: str | None
) -> AppRoleReport:
    """:func:`grant_api_role`, plus what the previous release's API reads
    (:data:`PREVIOUS_API_TABLES`), for the time of a rolling upgrade."""
    return grant_role(conn, role, password, PREVIOUS_API_ROLE)
