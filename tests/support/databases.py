"""Per-test PostgreSQL databases cloned from one migrated template (fast and isolated)."""

from __future__ import annotations

import os
import uuid
from urllib.parse import urlsplit, urlunsplit

import sqlalchemy as sa

from ledger.migrate import upgrade
from teamdesk.db import sqlalchemy_url

ADMIN_URL = os.environ.get(
    "TEST_ADMIN_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


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
    return name


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
