"""The application's database role and the machinery that grants it and the API's
(ledger/api_database_role.py): the one place their grants are written (docs/design.md, "Processes";
deploy/security.md, "The database roles").

Grants are re-applied at every run, not left to ``ALTER DEFAULT PRIVILEGES``, which would
follow whichever role creates any table and block dropping the role. ``TEMP`` (``PUBLIC``'s)
is left alone: it changes no schema. Identifiers are quoted by ``psycopg2.sql``, never formatted in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg2 import errors, sql
from psycopg2.extensions import encrypt_password
from sqlalchemy.engine import Connection

from ledger.artifacts import CHUNK_FUNCTION, CHUNK_SIGNATURE, OBJECT_FUNCTION, OBJECT_SIGNATURE
from ledger.errors import LedgerError
from ledger.models import metadata
from ledger.retention import PURGE_FUNCTION
from ledger.retention import SIGNATURE as PURGE_SIGNATURE
from ledger.tokens import RESOLVE_FUNCTION, RESOLVE_SIGNATURE

ROLE_LOCK = 748_201_114  # pg_advisory_xact_lock key for the roles' grants (app and API)
ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
APP_PASSWORD_VAR = "APP_DB_PASSWORD"

TABLE_PRIVILEGES = frozenset({"SELECT", "INSERT", "UPDATE", "DELETE"})
GRANTABLE = TABLE_PRIVILEGES | {"USAGE"}  # rows; sequences
READ_WRITE = ("SELECT", "INSERT", "UPDATE", "DELETE")
APPEND_ONLY = ("SELECT", "INSERT")
APPEND_ONLY_TABLES = frozenset({"task_audit"})
SEQUENCE_PRIVILEGES = ("USAGE", "SELECT")
ANALYZE_FUNCTION = "teamdesk_analyze_ledger"  # ledger/dispatch.py ANALYZE calls it

# The owner's SECURITY DEFINER functions and their argument types: every role's EXECUTE on
# each is granted or revoked at every run.
OWNER_FUNCTIONS: Mapping[str, str] = {
    ANALYZE_FUNCTION: "",
    PURGE_FUNCTION: PURGE_SIGNATURE,
    RESOLVE_FUNCTION: RESOLVE_SIGNATURE,
    CHUNK_FUNCTION: CHUNK_SIGNATURE,
    OBJECT_FUNCTION: OBJECT_SIGNATURE,
}

# The attributes that would make the role more than a user of the tables.
ROLE_POWERS = """
    SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls
      FROM pg_roles WHERE rolname = %s
"""
POWER_NAMES = ("SUPERUSER", "CREATEROLE", "CREATEDB", "REPLICATION", "BYPASSRLS")

# The sequences behind the tables' identity and serial columns.
OWNED_SEQUENCES = """
    SELECT n.nspname, s.relname, s.oid FROM pg_depend d
      JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
      JOIN pg_namespace n ON n.oid = s.relnamespace
     WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
       AND d.deptype IN ('a', 'i') AND d.refobjid = ANY(%s::oid[])
     ORDER BY 1, 2
"""


class AppRoleRefused(LedgerError):
    """The application role cannot be set up with least privilege."""


@dataclass(frozen=True)
class AppRoleReport:
    role: str
    created: bool
    password_set: bool
    tables: int  # tables the role holds a privilege on
    sequences: int
    functions: int  # the owner's functions it may execute


@dataclass(frozen=True)
class Privilege:
    """One privilege on a table (or sequence), on all of it or (``columns``) on those
    columns only."""

    name: str
    columns: tuple[str, ...] = ()

    def sql(self) -> sql.Composable:
        if self.name not in GRANTABLE:
            raise ValueError(f"not a grantable privilege: {self.name}")
        if not self.columns:
            return sql.SQL(self.name)
        listed = sql.SQL(", ").join(sql.Identifier(c) for c in self.columns)
        return sql.SQL("{} ({})").format(sql.SQL(self.name), listed)


@dataclass(frozen=True)
class RoleSpec:
    """What a role may do: ``tables`` maps each project table to its privileges (a table
    missing from it gets none); ``sequences``: USAGE, SELECT on the tables' sequences;
    ``functions``: the owner's functions (of :data:`OWNER_FUNCTIONS`) it may EXECUTE; it
    may execute none of the others."""

    password_var: str
    tables: Mapping[str, tuple[Privilege, ...]]
    sequences: bool
    functions: frozenset[str]


@dataclass(frozen=True)
class _Relation:
    schema: str
    name: str
    oid: int

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)


def valid_role_name(name: str) -> bool:
    """Lower-case letters, digits and ``_``; not a ``pg_`` role (reserved by PostgreSQL)."""
    return bool(ROLE_NAME.fullmatch(name)) and not name.startswith("pg_")


def table_privileges() -> dict[str, tuple[str, ...]]:
    """Each project table and what the application role may do to its rows."""
    return {
        table.name: APPEND_ONLY if table.name in APPEND_ONLY_TABLES else READ_WRITE
        for table in metadata.sorted_tables
    }


def app_role_spec() -> RoleSpec:
    """The application role's grants: every table's rows, its sequences, the functions."""
    tables = {
        name: tuple(Privilege(p) for p in privileges)
        for name, privileges in table_privileges().items()
    }
    return RoleSpec(APP_PASSWORD_VAR, tables, sequences=True, functions=frozenset(OWNER_FUNCTIONS))


def grant_app_role(conn: Connection, role: str, password: str | None) -> AppRoleReport:
    """Create ``role`` (or set its password) and give it exactly the application's grants,
    in the caller's transaction. Raises :class:`AppRoleRefused` when the role would hold
    more than that (it is the migrating role, a member of the owner, a superuser...)."""
    return grant_role(conn, role, password, app_role_spec())


def grant_role(conn: Connection, role: str, password: str | None, spec: RoleSpec) -> AppRoleReport:
    """Create ``role`` (or set its password) and give it exactly ``spec``'s grants, in the
    caller's transaction, under the roles' advisory lock; refused like
    :func:`grant_app_role`."""
    if not valid_role_name(role):
        raise AppRoleRefused(f"{role!r} is not a valid role name (a-z, 0-9, _)")
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None, "an open connection"
    cur: Any = dbapi.cursor()
    cur.execute("SELECT pg_advisory_xact_lock(%s), current_user", (ROLE_LOCK,))
    if cur.fetchone()[1] == role:
        raise AppRoleRefused(f"role {role} is the migrating role: name another one")
    tables = _tables(cur)
    created = _ensure_login(cur, role, password, spec.password_var)
    _refuse_powers(cur, role, tables)
    sequences = _owned_sequences(cur, tables)
    _grant(cur, role, tables, sequences, spec)
    _refuse_inherited(cur, role, tables, spec)
    _refuse_ddl(cur, role, sorted({t.schema for t in tables}))
    granted = sum(1 for t in tables if spec.tables.get(t.name))
    return AppRoleReport(
        role,
        created,
        bool(password),
        granted,
        len(sequences) if spec.sequences else 0,
        len(spec.functions),
    )


def _tables(cur: Any) -> list[_Relation]:
    found = []
    for name in table_privileges():
        cur.execute(
            "SELECT n.nspname, c.relname, c.oid FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
            (name,),
        )
        row = cur.fetchone()
        if row is None:
            raise AppRoleRefused(f"table {name} does not exist: the migrations did not run")
        found.append(_Relation(*row))
    return found


def _ensure_login(cur: Any, role: str, password: str | None, password_var: str) -> bool:
    """Create the role with ``password``, or set an existing role's password when one is
    given (without one, an existing role keeps its password). True when created."""
    cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
    exists = cur.fetchone() is not None
    if not exists and not password:
        raise AppRoleRefused(f"role {role} does not exist; set {password_var} to create it")
    if not password:
        return False
    verifier = encrypt_password(password, role, cur.connection, "scram-sha-256")
    statement = sql.SQL(
        "ALTER ROLE {} WITH LOGIN PASSWORD {}"
        if exists
        else "CREATE ROLE {} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
        "NOBYPASSRLS PASSWORD {}"
    ).format(sql.Identifier(role), sql.Literal(verifier))
    try:
        cur.execute(statement)
    except errors.InsufficientPrivilege:
        raise AppRoleRefused(
            f"the migrating role may not create or alter role {role} (it needs CREATEROLE): "
            f"create the role beforehand and run migrate without {password_var}"
        ) from None
    return not exists


def _refuse_powers(cur: Any, role: str, tables: Sequence[_Relation]) -> None:
    cur.execute(ROLE_POWERS, (role,))
    powers = cur.fetchone()
    held = [name for name, has in zip(POWER_NAMES, powers, strict=True) if has]
    if held:
        raise AppRoleRefused(f"role {role} has {', '.join(held)}: not least-privileged")
    cur.execute(
        "SELECT bool_or(pg_has_role(%s, relowner, 'MEMBER')) FROM pg_class"
        " WHERE oid = ANY(%s::oid[])",
        (role, [t.oid for t in tables]),
    )
    if cur.fetchone()[0]:
        raise AppRoleRefused(f"role {role} owns the tables, or is a member of their owner")


def _owned_sequences(cur: Any, tables: Sequence[_Relation]) -> list[_Relation]:
    cur.execute(OWNED_SEQUENCES, ([t.oid for t in tables],))
    return [_Relation(*row) for row in cur.fetchall()]


def _grant(
    cur: Any,
    role: str,
    tables: Sequence[_Relation],
    sequences: Sequence[_Relation],
    spec: RoleSpec,
) -> None:
    """Everything the role may do, replacing whatever it had on these objects."""
    who = sql.Identifier(role)
    cur.execute("SELECT current_database()")
    database = sql.Identifier(cur.fetchone()[0])
    cur.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(database, who))
    for schema in sorted({t.schema for t in tables}):
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), who))
    for table in tables:
        _replace(cur, "TABLE", table, spec.tables.get(table.name, ()), who)
    sequence_privileges = tuple(Privilege(p) for p in SEQUENCE_PRIVILEGES) if spec.sequences else ()
    for sequence in sequences:
        _replace(cur, "SEQUENCE", sequence, sequence_privileges, who)
    for schema in sorted({t.schema for t in tables}):
        for function, signature in OWNER_FUNCTIONS.items():
            action = "GRANT EXECUTE ON FUNCTION {}.{}({}) TO {}"
            if function not in spec.functions:
                action = "REVOKE EXECUTE ON FUNCTION {}.{}({}) FROM {}"
            cur.execute(
                sql.SQL(action).format(
                    sql.Identifier(schema), sql.Identifier(function), sql.SQL(signature), who
                )
            )


def _replace(
    cur: Any,
    kind: str,
    relation: _Relation,
    privileges: Iterable[Privilege],
    who: sql.Identifier,
) -> None:
    """REVOKE ALL (column privileges included), then GRANT exactly ``privileges`` (the
    same transaction: no gap); none: the role keeps nothing on it."""
    on = sql.SQL(kind)
    cur.execute(sql.SQL("REVOKE ALL ON {} {} FROM {}").format(on, relation.ident, who))
    granted = [p.sql() for p in privileges]
    if granted:
        listed = sql.SQL(", ").join(granted)
        cur.execute(sql.SQL("GRANT {} ON {} {} TO {}").format(listed, on, relation.ident, who))


def _refuse_inherited(cur: Any, role: str, tables: Sequence[_Relation], spec: RoleSpec) -> None:
    """What the role may do to each table in the end, through the roles it is a member of
    and PUBLIC included, is no more than ``spec`` grants it."""
    for table in tables:
        granted = {p.name for p in spec.tables.get(table.name, ()) if not p.columns}
        for privilege in sorted(TABLE_PRIVILEGES - granted):
            cur.execute("SELECT has_table_privilege(%s, %s, %s)", (role, table.oid, privilege))
            if cur.fetchone()[0]:
                raise AppRoleRefused(
                    f"role {role} may {privilege} table {table.name} through another role "
                    "or PUBLIC: revoke that membership or grant"
                )


def _refuse_ddl(cur: Any, role: str, schemas: Iterable[str]) -> None:
    """What the role may do in the end, through PUBLIC or other roles included: connect
    and use the schema, create nothing in it or in the database."""
    cur.execute(
        "SELECT has_database_privilege(%(r)s, current_database(), 'CONNECT'),"
        " has_database_privilege(%(r)s, current_database(), 'CREATE')",
        {"r": role},
    )
    connect, create_schema = cur.fetchone()
    if not connect:
        raise AppRoleRefused(
            f"role {role} may not connect to the database, and the migrating role cannot "
            "grant it: GRANT CONNECT as the database's owner"
        )
    if create_schema:
        raise AppRoleRefused(
            f"role {role} may create schemas: REVOKE CREATE ON DATABASE from it and PUBLIC"
        )
    for schema in schemas:
        cur.execute(
            "SELECT has_schema_privilege(%(r)s, %(s)s, 'USAGE'),"
            " has_schema_privilege(%(r)s, %(s)s, 'CREATE')",
            {"r": role, "s": schema},
        )
        usage, create = cur.fetchone()
        if not usage:
            raise AppRoleRefused(f"role {role} may not use schema {schema}: GRANT USAGE on it")
        if create:
            raise AppRoleRefused(
                f"role {role} may create objects in schema {schema} (PUBLIC may, before "
                f"PostgreSQL 15): REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC as its owner"
            )
