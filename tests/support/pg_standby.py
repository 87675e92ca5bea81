"""A streaming standby of a private PostgreSQL (soak/postgres.py), for failover tests.

``pg_basebackup -R -X stream`` copies the primary's data directory and writes
``standby.signal`` and ``primary_conninfo``; the copy then starts on a free 127.0.0.1 port
of its own and streams the primary's WAL (asynchronous replication, PostgreSQL's default:
no ``synchronous_standby_names``). ``pg_ctl promote`` turns it into a primary. Like
:class:`~soak.postgres.SoakPostgres`, every binary runs as the ``postgres`` user when the
test runs as root. The primary needs nothing beyond initdb's defaults: ``wal_level =
replica``, ``max_wal_senders = 10`` and a ``host replication all 127.0.0.1/32 trust``
line in its ``pg_hba.conf``. :func:`two_host_url` names both in libpq's form, the way
``DATABASE_URL`` lists a primary and its standbys (docs/design.md, "Topologies").
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg2
import sqlalchemy as sa

from harness.waiting import wait_for
from soak.postgres import START_TIMEOUT_S, SUPERUSER, SoakPostgres
from teamdesk.db import make_engine

STREAMING_TIMEOUT_S = 30.0
REPLAY_TIMEOUT_S = 10.0  # detects a standby that stopped streaming
SLOT = "teamdesk_standby"  # keeps the WAL the standby still needs on the primary


def _scalar(url: str, sql: str) -> Any:
    """The one value ``sql`` returns (None for a command) on a new autocommit connection
    to ``url``."""
    conn = psycopg2.connect(url, connect_timeout=2)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(sql)
            row = cur.fetchone() if cur.description is not None else None
            return None if row is None else row[0]
    finally:
        conn.close()


class Standby(SoakPostgres):
    """A hot standby of ``primary``, made by ``pg_basebackup`` instead of ``initdb``."""

    def __init__(self, workdir: Path, primary: SoakPostgres) -> None:
        super().__init__(workdir)
        self.primary = primary

    def create(self) -> None:
        """Copy the primary (its databases as they are now) and start streaming from it."""
        self._own_home()
        self._run(
            "pg_basebackup", "-D", str(self.data), "-R", "-X", "stream", "-c", "fast",
            "-C", "-S", SLOT, "-h", "127.0.0.1", "-p", str(self.primary.port),
            "-U", SUPERUSER, "--no-sync",
        )  # fmt: skip
        self.start()

    def _own_home(self) -> None:
        """The home directory, the postgres user's when we are root (as SoakPostgres.create
        does for the primary's)."""
        self.home.mkdir(parents=True)
        if self.as_root:
            os.chmod(self.home.parent, 0o711)
            entry = pwd.getpwnam(SUPERUSER)
            os.chown(self.home, entry.pw_uid, entry.pw_gid)

    def streaming(self) -> bool:
        """Whether the primary reports this standby's WAL receiver as streaming."""
        state = _scalar(
            self.primary.admin_url,
            "SELECT r.state FROM pg_stat_replication r JOIN pg_replication_slots s "
            f"ON s.active_pid = r.pid WHERE s.slot_name = '{SLOT}'",
        )
        return bool(state == "streaming")

    def in_recovery(self) -> bool:
        return bool(_scalar(self.admin_url, "SELECT pg_is_in_recovery()"))

    def has_replayed(self, lsn: str) -> bool:
        """Whether this standby has replayed the primary's WAL up to ``lsn``."""
        behind = _scalar(
            self.admin_url, f"SELECT pg_wal_lsn_diff('{lsn}', pg_last_wal_replay_lsn())"
        )
        return behind is not None and behind <= 0

    def catch_up(self) -> None:
        """Until this standby has replayed everything the primary committed so far, the
        asynchronous commits included."""
        lsn = primary_committed_lsn(self.primary)
        wait_for(lambda: self.has_replayed(lsn), REPLAY_TIMEOUT_S, what="the standby's replay")

    def sessions(self, application_name: str) -> int:
        """This server's sessions of ``application_name``."""
        count = _scalar(
            self.admin_url,
            f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{application_name}'",
        )
        return int(count)

    def stop_streaming(self) -> None:
        """Stop receiving the primary's WAL (``primary_conninfo`` emptied, the WAL receiver
        gone): what the primary writes from now on never reaches this server."""
        _scalar(self.admin_url, "ALTER SYSTEM SET primary_conninfo = ''")
        _scalar(self.admin_url, "SELECT pg_reload_conf()")
        wait_for(
            lambda: _scalar(self.admin_url, "SELECT count(*) FROM pg_stat_wal_receiver") == 0,
            STREAMING_TIMEOUT_S,
            what="the standby's WAL receiver to stop",
        )

    @contextmanager
    def engine(self, database: str) -> Iterator[sa.Engine]:
        """An engine on this server alone (read only until the promotion)."""
        engine = make_engine(self.url(database))
        try:
            yield engine
        finally:
            engine.dispose()

    def promote(self) -> None:
        """``pg_ctl promote``, waiting until the server has left recovery."""
        self._run("pg_ctl", "promote", "-D", str(self.data), "-w", "-t", str(START_TIMEOUT_S))


def primary_committed_lsn(primary: SoakPostgres) -> str:
    """Where the primary's WAL is flushed to once everything committed so far is, the
    asynchronous commits included: a transaction that wrote WAL (here a logical message)
    commits by flushing all the WAL before it. Neither the insert position (WAL that no
    commit follows may stay unflushed, and unstreamed, while nothing commits) nor a
    transaction that only took an xid (it wrote no WAL: its commit does not wait for the
    flush) would do."""
    conn = psycopg2.connect(primary.admin_url, connect_timeout=2)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_logical_emit_message(true, 'teamdesk-test', 'flush')")
        conn.commit()
        return str(_scalar(primary.admin_url, "SELECT pg_current_wal_flush_lsn()"))
    finally:
        conn.close()


def two_host_url(primary: SoakPostgres, standby: Standby, database: str) -> str:
    """libpq's list, the primary first; only a server that takes writes is accepted."""
    hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
    return f"postgresql://{SUPERUSER}@{hosts}/{database}?target_session_attrs=read-write"


@contextmanager
def private_primary() -> Iterator[SoakPostgres]:
    """A private PostgreSQL (as tests/process/test_pg_restart.py runs one), removed when
    the block ends, whatever happened."""
    workdir = Path(tempfile.mkdtemp(prefix="td-primary-"))
    postgres = SoakPostgres(workdir)
    try:
        postgres.create()
        yield postgres
    finally:
        postgres.destroy()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def streaming_standby(primary: SoakPostgres) -> Iterator[Standby]:
    """A standby of ``primary``, streaming before the block starts; stopped and removed
    when it ends, whatever happened."""
    workdir = Path(tempfile.mkdtemp(prefix="td-standby-"))
    standby = Standby(workdir, primary)
    try:
        standby.create()
        wait_for(standby.streaming, STREAMING_TIMEOUT_S, what="the standby to stream")
        yield standby
    finally:
        standby.destroy()
        shutil.rmtree(workdir, ignore_errors=True)
