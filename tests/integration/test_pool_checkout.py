"""What a pooled connection costs, and what replaces the pre-ping (teamdesk/db.py).

A checkout sends nothing: a connection the server hung up on while it sat in the pool
is told by its socket (``hung_up``) and replaced before anything is sent on it. An
execution's connection returns to its pool without a statement either (the pool is in
autocommit from the start). Each test reads what the server last ran on that backend
(``pg_stat_activity.query``) to see what was sent.
"""

from __future__ import annotations

import gc
import os
import resource
import select
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from harness.waiting import wait_for
from teamdesk import db
from teamdesk.config import Settings

MARK = "SELECT 'teamdesk-pool-mark'"


@pytest.fixture
def single(database_url: str) -> Iterator[sa.Engine]:
    """One pooled connection, reused at every checkout."""
    engine = db.make_engine(database_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _last_query(admin: sa.Engine, pid: int) -> str:
    with admin.connect() as conn:
        query = conn.execute(
            sa.text("SELECT query FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar_one()
    return str(query)


def _readable(dbapi: Any) -> bool:
    poller = select.poll()
    poller.register(dbapi.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _gone(admin: sa.Engine, pid: int) -> bool:
    with admin.connect() as conn:
        found = conn.execute(
            sa.text("SELECT 1 FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).first()
    return found is None


def _pid(conn: sa.Connection) -> int:
    return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def test_a_checkout_sends_nothing(single: sa.Engine, engine: sa.Engine) -> None:
    with single.connect() as conn:
        pid = _pid(conn)
        conn.exec_driver_sql(MARK)
        conn.rollback()
    with single.connect() as conn:
        assert _last_query(engine, pid) == "ROLLBACK"  # no SELECT 1 came before
        assert _pid(conn) == pid


def test_a_connection_terminated_in_the_pool_is_replaced_before_use(
    single: sa.Engine, engine: sa.Engine
) -> None:
    with single.connect() as conn:
        pid = _pid(conn)
        dbapi = conn.connection.dbapi_connection
    with engine.connect() as admin:
        assert admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    # The gate: the server's last word (its FATAL) has reached the pooled connection. The
    # close may still be on its way: the notice alone must be enough.
    wait_for(lambda: _readable(dbapi), what="the terminated session's last message")
    with single.connect() as conn:  # no error: a new connection
        assert _pid(conn) != pid
        assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1


def test_a_connection_whose_server_closed_the_socket_is_replaced_before_use(
    single: sa.Engine, engine: sa.Engine
) -> None:
    with single.connect() as conn:
        pid = _pid(conn)
    with engine.connect() as admin:
        assert admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    wait_for(lambda: _gone(engine, pid), what="the terminated backend to exit")
    with single.connect() as conn:
        assert _pid(conn) != pid


def test_a_notification_waiting_on_a_pooled_connection_does_not_drop_it(
    single: sa.Engine, engine: sa.Engine
) -> None:
    with single.connect() as conn:
        pid = _pid(conn)
        conn.exec_driver_sql("LISTEN teamdesk_pool_test")
        conn.commit()
    with engine.begin() as other:
        other.exec_driver_sql("NOTIFY teamdesk_pool_test")
    with single.connect() as conn:
        assert _pid(conn) == pid
        conn.exec_driver_sql("UNLISTEN *")
        conn.commit()


def test_an_execution_connection_returns_to_its_pool_without_a_statement(
    settings: Settings, engine: sa.Engine
) -> None:
    """Before, an execution switched a pooled connection to autocommit for its checkout,
    and SQLAlchemy sent ``SET default_transaction_isolation TO DEFAULT`` at its return."""
    execution = db.get_execution_engine()
    with execution.connect() as conn:
        pid = _pid(conn)
        conn.exec_driver_sql(MARK)
    assert _last_query(engine, pid) == MARK
    with execution.connect() as conn:  # and it is reused, still in autocommit
        assert _pid(conn) == pid
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None and dbapi.autocommit


def test_a_connection_numbered_past_1024_is_checked_like_any_other(database_url: str) -> None:
    """A process with many files open (an API replica with many clients) gets socket
    numbers past select()'s limit of 1024: the check must not take those for hung up
    (select raised ValueError, every checkout reconnected, and then failed)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"this process may open {soft} files only")
    engine = db.make_engine(database_url, pool_size=1, max_overflow=0)
    gc.collect()  # no finalizer may free a low number between the padding and the connect
    gc.disable()
    padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with engine.connect() as conn:
            gc.enable()
            pid = _pid(conn)
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None and dbapi.fileno() >= 1024
        assert not db.hung_up(dbapi)
        with engine.connect() as conn:
            assert _pid(conn) == pid  # the same connection, not a new one
    finally:
        gc.enable()
        engine.dispose()
        for fd in padding:
            os.close(fd)
