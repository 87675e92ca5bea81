"""Per-test PostgreSQL databases cloned from one migrated template (fast and isolated);
:class:`Databases` hands a test's database to the next test when it can be made what a
fresh clone is again (cheaper than a clone; the comment above it says when).

The template also grants the API's database role (ledger/api_database_role.py) to :data:`API_ROLE`,
a role of this test run (roles are cluster-wide; :func:`drop_api_role` removes it once
the template is gone), so every clone carries its grants and the in-process API of the
tests connects as it (their ``api_client``, in the tests' support package).
"""

from __future__ import annotations

import contextlib
import os
import time
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


def _connect(name: str, **options: object) -> sa.Engine:
    return sa.create_engine(
        sqlalchemy_url(_with_db(ADMIN_URL, name)), poolclass=sa.pool.NullPool, **options
    )


# --- per-test databases: a clone, or one a finished test left as a clone would be ---------
#
# A clone costs the server ~0.3 s of system CPU (a few hundred files created and fsynced;
# STRATEGY FILE_COPY costs the same), and it was half of the integration tier's time on
# 2 cores. So a database a test used goes to the next test when, and only when, it is
# again what a fresh clone is: nobody connected to it; renamed (a straggler with its old
# URL gets "does not exist", as after a drop); not one row of its catalogs written or
# removed since it was handed out (no DDL, GRANT, trigger switched off, large object...);
# no setting, prepared transaction or slot of its own; the template's rows unchanged.
# Then the tables the test wrote are truncated, the sequences set back, its planner
# statistics and counters removed. Anything else drops it; the next test gets a clone.

# The catalogs of one database (shared ones, pg_database..., are checked apart), less the
# statistics, which the reset itself clears.
_CATALOGS = """
SELECT c.oid::regclass::text FROM pg_class c
WHERE c.relnamespace = 'pg_catalog'::regnamespace AND c.relkind = 'r' AND NOT c.relisshared
  AND c.relname NOT IN ('pg_statistic', 'pg_statistic_ext_data') ORDER BY 1"""
# Each table of ours, and whether anything was ever written to it (a rolled-back row too).
_TABLES = """
SELECT c.oid::regclass::text, pg_relation_size(c.oid) > 0 OR c.reltuples >= 0 FROM pg_class c
WHERE c.relkind IN ('r', 'p', 'm') AND c.relnamespace NOT IN
  ('pg_catalog'::regnamespace, 'information_schema'::regnamespace, 'pg_toast'::regnamespace)"""
_SEQUENCES = """
SELECT format('%I.%I', schemaname, sequencename), last_value, start_value FROM pg_sequences"""
_OWN_STATE = """
SELECT d.datallowconn AND d.datconnlimit = -1 AND d.datacl IS NULL
   AND NOT EXISTS (SELECT FROM pg_db_role_setting s WHERE s.setdatabase = d.oid)
   AND NOT EXISTS (SELECT FROM pg_prepared_xacts x WHERE x.database = d.datname)
   AND NOT EXISTS (SELECT FROM pg_replication_slots r WHERE r.database = d.datname)
FROM pg_database d WHERE d.datname = current_database()"""
# The next transaction id to be assigned: whatever a test writes later has one at least as high.
_NEXT_XID = "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
_SESSIONS = "SELECT pid FROM pg_stat_activity WHERE datname = :name AND pid <> pg_backend_pid()"
_TERMINATE = f"SELECT pg_terminate_backend(pid) FROM ({_SESSIONS}) s"
_QUIET_WITHIN_S = 5.0
_FIRST_USER_OID = 16384  # PostgreSQL's FirstNormalObjectId: the template's own objects


def _content(conn: sa.Connection, table: str) -> str:
    rows = f"SELECT md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM {table} t"
    return str(conn.execute(sa.text(rows)).scalar_one())


class _Template:
    """What a fresh clone of the template holds, read once from the template."""

    def __init__(self, conn: sa.Connection) -> None:
        self.catalogs = list(conn.execute(sa.text(_CATALOGS)).scalars())
        self.rows = self.catalog_rows(conn, 0)[0]
        filled = [t for t, written in conn.execute(sa.text(_TABLES)) if written]
        self.filled = {t: _content(conn, t) for t in filled}
        self.sequences = {n: (v, s) for n, v, s in conn.execute(sa.text(_SEQUENCES))}

    def catalog_rows(self, conn: sa.Connection, since: int) -> tuple[int, bool]:
        """The catalogs' row count, and whether a row has an xmin from ``since`` on."""
        each = " UNION ALL ".join(
            f"SELECT count(*), coalesce(bool_or(xmin::text::bigint >= :since), false) FROM {c}"
            for c in self.catalogs
        )
        query = f"SELECT sum(count)::bigint, bool_or(coalesce) FROM ({each}) c"
        count, written = conn.execute(sa.text(query), {"since": since & 0xFFFFFFFF}).one()
        return int(count), bool(written)

    def is_clone(self, conn: sa.Connection, since: int) -> bool:
        """Nothing but rows of the tables changed since ``since`` (and no xmin wrapped)."""
        if conn.execute(sa.text(_NEXT_XID)).scalar_one() >> 32 != since >> 32:
            return False
        if not conn.execute(sa.text(_OWN_STATE)).scalar_one():
            return False
        if self.catalog_rows(conn, since) != (self.rows, False):
            return False
        return all(_content(conn, t) == digest for t, digest in self.filled.items())

    def reset(self, conn: sa.Connection) -> bool:
        """Empty the tables written to, set the sequences back, forget the statistics;
        False if that emptied a table the template has rows in."""
        written = [t for t, w in conn.execute(sa.text(_TABLES)) if w]
        if emptied := [t for t in written if t not in self.filled]:
            # CASCADE: with the tables that refer to them (empty or not, TRUNCATE wants them)
            conn.execute(sa.text(f"TRUNCATE {', '.join(emptied)} CASCADE"))
        for name, value, start in conn.execute(sa.text(_SEQUENCES)).all():
            was = self.sequences[name][0]
            if value != was:
                conn.execute(
                    sa.text("SELECT setval(:name, :value, :called)"),
                    {
                        "name": name,
                        "value": start if was is None else was,
                        "called": was is not None,
                    },
                )
        user = {"user": _FIRST_USER_OID}
        conn.execute(sa.text("DELETE FROM pg_statistic WHERE starelid >= :user"), user)
        conn.execute(sa.text("DELETE FROM pg_statistic_ext_data WHERE stxoid >= :user"), user)
        return all(_content(conn, t) == digest for t, digest in self.filled.items())


class Databases:
    """The per-test databases of one test session, cloned from ``template``."""

    def __init__(self, template: str, prefix: str) -> None:
        self.template, self.prefix = template, prefix
        engine = _connect(template)
        with engine.connect() as conn:
            self._clone = _Template(conn)
        engine.dispose()
        self._spares: list[tuple[str, int]] = []  # (name, the xid it was handed out at)
        self._out: dict[str, int] = {}

    def take(self) -> tuple[str, str]:
        """A database as a fresh clone of the template is; returns (name, url)."""
        if self._spares:
            name, since = self._spares.pop()
        else:
            name, _ = clone_database(self.template, self.prefix)
            since = _next_xid(admin_engine())
        self._out[name] = since
        return name, _with_db(ADMIN_URL, name)

    def give_back(self, name: str) -> None:
        """Keep ``name`` for the next test if it can be made a clone again, else drop it."""
        since, spare = self._out.pop(name), f"{self.prefix}_{uuid.uuid4().hex[:10]}"
        try:
            kept = _quiet_and_renamed(name, spare) and self._reset(spare, since)
        except sa.exc.DBAPIError:
            kept = False
        if not kept:
            drop_database(name)
            drop_database(spare)

    def _reset(self, name: str, since: int) -> bool:
        engine = _connect(name)
        try:
            with engine.connect() as conn:
                with conn.begin() as transaction:
                    if not (self._clone.is_clone(conn, since) and self._clone.reset(conn)):
                        transaction.rollback()
                        return False
                conn.execute(sa.text("SELECT pg_stat_reset()"))  # the counters a test may read
                self._spares.append((name, int(conn.execute(sa.text(_NEXT_XID)).scalar_one())))
                conn.commit()
            return True
        finally:
            engine.dispose()

    def close(self) -> None:
        for name in [*self._out, *(n for n, _ in self._spares)]:
            drop_database(name)
        self._out.clear()
        self._spares.clear()


def _next_xid(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        xid = int(conn.execute(sa.text(_NEXT_XID)).scalar_one())
    engine.dispose()
    return xid


def _quiet_and_renamed(name: str, new_name: str) -> bool:
    """End the sessions on ``name`` (the test's workers, pools, stragglers), then rename it;
    False when a session stays or comes back."""
    engine = admin_engine()
    try:
        with engine.connect() as conn:
            deadline = time.monotonic() + _QUIET_WITHIN_S
            while conn.execute(sa.text(_TERMINATE), {"name": name}).first() is not None:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
            conn.execute(sa.text(f'ALTER DATABASE "{name}" RENAME TO "{new_name}"'))
        return True
    finally:
        engine.dispose()
