"""``teamdesk-tasks migrate``'s lock (ledger/migrations/env.py), behind a real PgBouncer
in transaction pooling and direct: it is held while the revisions run and gone when
migrate ends, whatever server sessions the pooler gave its transactions, and a second
migrate waits for the first, then finds nothing left to do.

Before, migrate took a session-level advisory lock in one transaction and released it in
another, and PgBouncer hands a client's next transaction the server session released last.
So when another client took the lock's session in between, the unlock ran on another one:
the lock stayed held after migrate had ended (every later migrate would wait for it until
PgBouncer closed that server connection). And a second migrate given the lock's session
took the lock again (a session's advisory locks are re-entrant) and migrated beside the
first."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa

from harness import databases
from harness.databases import through
from harness.processes import ROOT
from harness.waiting import wait_for
from ledger.migrate import MIGRATION_LOCK, current_revision, upgrade
from tests.support.pgbouncer import pgbouncer

HELD = """
    SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
      WHERE l.locktype = 'advisory' AND l.granted = %(granted)s AND d.datname = %(db)s
       AND l.classid = 0 AND l.objid = %(key)s AND l.objsubid = 1
"""


@pytest.fixture
def empty_db(services: None) -> Iterator[str]:
    name, url = databases.empty_database(f"tdt{os.getpid()}_migrate_pgb")
    yield url
    databases.drop_database(name)


def locks_held(direct_url: str, granted: bool = True) -> int:
    """Granted migration locks on this database (or awaited ones), read on a direct
    connection."""
    conn = psycopg2.connect(direct_url)
    try:
        with conn.cursor() as cur:
            name = direct_url.rpartition("/")[2]
            cur.execute(HELD, {"db": name, "key": MIGRATION_LOCK, "granted": granted})
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def locks_awaited(direct_url: str) -> bool:
    """Is a session waiting in PostgreSQL for the migration lock?"""
    return locks_held(direct_url, granted=False) > 0


def is_lock(statement: str) -> bool:
    return "advisory" in statement and "unlock" not in statement


class Interloper:
    """Another client of the same PgBouncer. At migrate's first statement after the lock
    it opens a transaction and keeps it (so it holds whatever server session PgBouncer
    hands it: the one that last ran a transaction, the lock's, while that is free), and
    notes how many migration locks are held at that moment."""

    def __init__(self, pooled_url: str, direct_url: str) -> None:
        self.pooled_url, self.direct_url = pooled_url, direct_url
        self.conn: Any = None
        self.held_during_work: int | None = None
        self.locked = False

    def before_execute(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if is_lock(statement):
            self.locked = True
        elif self.locked and self.conn is None:
            self.conn = psycopg2.connect(self.pooled_url)
            with self.conn.cursor() as cur:
                cur.execute("SELECT 1")  # in a transaction now: its server stays with it
            self.held_during_work = locks_held(self.direct_url)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def test_the_migration_lock_is_held_while_migrating_and_released_behind_pgbouncer(
    empty_db: str,
) -> None:
    with pgbouncer(pool_size=4) as port:
        pooled = through(empty_db, port)
        interloper = Interloper(pooled, empty_db)
        sa.event.listen(sa.Engine, "before_cursor_execute", interloper.before_execute)
        try:
            upgrade(pooled)
            assert interloper.held_during_work == 1, "the lock was not held while migrating"
            assert locks_held(empty_db) == 0, "migrate ended with its lock still held"
        finally:
            sa.event.remove(sa.Engine, "before_cursor_execute", interloper.before_execute)
            interloper.close()
        assert current_revision(pooled) is not None
        assert locks_held(empty_db) == 0


# The second migrate runs in a process of its own (alembic's ``context`` and ``op`` are
# one per process) and prints what it sends: "lock" for a try of the lock, "sql" else.
SECOND = """
import sys
import sqlalchemy as sa
from ledger.migrate import upgrade

def sent(_conn, _cursor, statement, *_args):
    lock = "advisory" in statement and "unlock" not in statement
    print("lock" if lock else "sql", flush=True)

sa.event.listen(sa.Engine, "before_cursor_execute", sent)
upgrade(sys.argv[1])
print("done", flush=True)
"""


class FirstMigrate:
    """A migrate in a thread whose work (its first statement after its lock) waits until
    the test lets it go on."""

    def __init__(self, pooled_url: str) -> None:
        self.pooled_url = pooled_url
        self.tried = False
        self.working = threading.Event()
        self.go_on = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="first-migrate", daemon=True)

    def before_execute(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if threading.current_thread() is not self.thread:
            return
        if is_lock(statement):
            self.tried = True
        elif self.tried and not self.working.is_set():
            self.working.set()
            assert self.go_on.wait(30), "the test never let the first migrate go on"

    def _run(self) -> None:
        try:
            upgrade(self.pooled_url)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


class SecondMigrate:
    """The second migrate's process and what it has sent so far."""

    def __init__(self, pooled_url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", SECOND, pooled_url],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.sent: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.sent.append(line.strip())

    def got_in(self) -> bool:
        """Did it send anything after a try of the lock (its work)?"""
        return "sql" in self.sent[self.sent.index("lock") :] if "lock" in self.sent else False

    def waits(self) -> bool:
        """Was its try refused, and it tried again (it waits outside any statement)?"""
        return self.sent.count("lock") >= 2 and not self.got_in()


@contextmanager
def reached_through(url: str, pooler: bool) -> Iterator[str]:
    """``url`` itself, or through a PgBouncer in transaction pooling."""
    if not pooler:
        yield url
        return
    with pgbouncer(pool_size=4) as port:
        yield through(url, port)


@pytest.mark.parametrize("pooler", [True, False], ids=["pgbouncer", "direct"])
def test_a_second_migrate_waits_for_the_first_and_both_succeed(empty_db: str, pooler: bool) -> None:
    """Direct, it failed too, differently: the second waited for the lock inside a
    statement, holding a snapshot, and the first's concurrent index build waited for that
    snapshot: PostgreSQL saw the cycle and failed the first migrate (deadlock detected),
    and the second then failed on the revision the first had left half done."""
    with reached_through(empty_db, pooler) as url:
        first = FirstMigrate(url)
        sa.event.listen(sa.Engine, "before_cursor_execute", first.before_execute)
        second: SecondMigrate | None = None
        try:
            first.thread.start()
            assert first.working.wait(30), "the first migrate never got its lock"
            second = SecondMigrate(url)
            wait_for(
                lambda: second.got_in() or second.waits() or locks_awaited(empty_db),
                timeout=30,
                what="the second migrate to wait for the lock (or to get in)",
            )
            assert not second.got_in(), "both migrates got in at once"
            first.go_on.set()
            first.thread.join(60)
            assert second.process.wait(60) == 0
            second.reader.join(10)
        finally:
            first.go_on.set()
            sa.event.remove(sa.Engine, "before_cursor_execute", first.before_execute)
            if second is not None and second.process.poll() is None:
                second.process.kill()
                second.process.wait(10)
        assert not first.thread.is_alive() and first.errors == []
        assert second.got_in() and second.sent[-1] == "done"
        assert current_revision(url) is not None
        assert locks_held(empty_db) == 0
