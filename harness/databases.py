"""Per-test PostgreSQL databases cloned from one migrated template (fast and isolated).

The template also grants the API's database role (ledger/api_role.py) to :data:`API_ROLE`,
a role of this test run (roles are cluster-wide; :func:`drop_api_role` removes it once
the template is gone), so every clone carries its grants and the in-process API of the
tests connects as it (their ``api_client``, in the tests' support package).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from urllib.parse import urlsplit, urlunsplit

import sqlalchemy as sa

from ledger.migrate import set_up_roles, upgrade
from teamdesk.db import sqlalchemy_url

ADMIN_URL = os.environ.get(
    "TEST_ADMIN_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
# The API's role for this run (the server trusts local connections: the password is
# only needed to create it).
API_ROLE = f"tdt_api_{os.getpid()}_{uuid.uuid4().hex[:6]}"


def through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by 127.0.0.1:``port`` (a proxy or a pooler
    in front of the test database)."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))


def _with_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


def admin_engine() -> sa.Engine:
    return sa.create_engine(
        sqlalchemy_url(ADMIN_URL), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )


def create_template(prefix: str) -> str:
    """Create and migrate a template database; returns its name."""
    name = f"{prefix}_tmpl"
    engine = admin_engine()
    with engine.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    upgrade(_with_db(ADMIN_URL, name))
    set_up_roles(_with_db(ADMIN_URL, name), [("api", API_ROLE, uuid.uuid4().hex)])
    return name


def as_api_role(url: str) -> str:
    """``url`` connecting as :data:`API_ROLE` when it names a database of this server as
    the admin user (a test clone); any other URL as it is."""
    parts, admin = urlsplit(url), urlsplit(ADMIN_URL)
    if (parts.hostname, parts.port, parts.username) != (admin.hostname, admin.port, admin.username):
        return url
    netloc = f"{API_ROLE}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def drop_api_role() -> None:
    """Drop :data:`API_ROLE` (best effort: a database left behind that still grants it
    keeps it)."""
    engine = admin_engine()
    with engine.connect() as conn, contextlib.suppress(sa.exc.DBAPIError):
        conn.execute(sa.text(f'DROP ROLE IF EXISTS "{API_ROLE}"'))
    engine.dispose()


def clone_database(template: str, prefix: str) -> tuple[str, str]:
    """A fresh database copied from ``template``; returns (name, url)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    engine = admin_engine()
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    engine.dispose()
    return name, _with_db(ADMIN_URL, name)


def empty_database(prefix: str) -> tuple[str, str]:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    engine = admin_engine()
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return name, _with_db(ADMIN_URL, name)


def drop_database(name: str) -> None:
    engine = admin_engine()
    with engine.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()
