"""The database roles migrate sets up (ledger/database_roles.py,
ledger/api_database_role.py), as tests look at them: ``teamdesk-tasks migrate`` as a
process of its own, what a role was granted (tables, columns, functions), its stored
verifier, and dropping it again (roles are cluster-wide)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

import sqlalchemy as sa

from harness import databases
from teamdesk.db import sqlalchemy_url

PASSWORD_VARS = ("APP_DB_PASSWORD", "API_DB_PASSWORD")
INSUFFICIENT_PRIVILEGE = "42501"


def migrate(
    url: str, *args: str, passwords: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """``teamdesk-tasks migrate`` as the operator runs it; ``passwords`` by variable
    (``APP_DB_PASSWORD``, ``API_DB_PASSWORD``), none inherited from this process."""
    env = {k: v for k, v in os.environ.items() if k not in PASSWORD_VARS}
    env.update({"DATABASE_URL": url, "LOG_LEVEL": "warn", **(passwords or {})})
    argv = [sys.executable, "-m", "cli.main", "migrate", *args]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finished(process: subprocess.Popen[str]) -> str:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, out + err
    return out


def owner_engine(url: str) -> sa.Engine:
    return sa.create_engine(
        sqlalchemy_url(url), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )


def drop_role(role: str, database_url: str | None = None) -> None:
    """Revoke what the role holds in the database, then drop it (cluster-wide)."""
    admin = owner_engine(database_url or databases.ADMIN_URL)
    with admin.connect() as conn:
        exists = conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role})
        if exists.first() is not None:
            conn.execute(sa.text(f'DROP OWNED BY "{role}"'))
            conn.execute(sa.text(f'DROP ROLE "{role}"'))
    admin.dispose()


TABLE_GRANTS = sa.text("""
    SELECT c.relname, string_agg(a.privilege_type, ',' ORDER BY a.privilege_type)
      FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
     WHERE a.grantee = to_regrole(:r) GROUP BY c.relname""")

COLUMN_GRANTS = sa.text("""
    SELECT c.relname || '.' || t.attname,
           string_agg(a.privilege_type, ',' ORDER BY a.privilege_type)
      FROM pg_attribute t JOIN pg_class c ON c.oid = t.attrelid
     CROSS JOIN LATERAL aclexplode(t.attacl) a
     WHERE a.grantee = to_regrole(:r) GROUP BY 1""")

FUNCTION_GRANTS = sa.text("""
    SELECT p.proname FROM pg_proc p CROSS JOIN LATERAL aclexplode(p.proacl) a
     WHERE a.grantee = to_regrole(:r) ORDER BY 1""")


def privileges(owner_url: str, role: str) -> dict[str, str]:
    """What ``role`` was granted on tables and sequences, by name (``"INSERT,SELECT"``)."""
    with owner_engine(owner_url).connect() as conn:
        return {name: granted for name, granted in conn.execute(TABLE_GRANTS, {"r": role})}


def column_privileges(owner_url: str, role: str) -> dict[str, str]:
    """What ``role`` was granted on single columns, by ``table.column``."""
    with owner_engine(owner_url).connect() as conn:
        return {name: granted for name, granted in conn.execute(COLUMN_GRANTS, {"r": role})}


def executable_functions(owner_url: str, role: str) -> list[str]:
    """The functions ``role`` was granted EXECUTE on."""
    with owner_engine(owner_url).connect() as conn:
        return [name for (name,) in conn.execute(FUNCTION_GRANTS, {"r": role})]


def verifier(owner_url: str, role: str) -> str:
    with owner_engine(owner_url).connect() as conn:
        query = sa.text("SELECT rolpassword FROM pg_authid WHERE rolname = :r")
        return str(conn.execute(query, {"r": role}).scalar_one())


def role_url(owner_url: str, role: str, password: str) -> str:
    """``owner_url``'s database, as ``role``."""
    server = sa.engine.make_url(sqlalchemy_url(owner_url))
    port = server.port or 5432
    return f"postgresql://{role}:{password}@{server.host}:{port}/{server.database}"
