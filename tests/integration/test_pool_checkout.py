"""What a pooled connection costs, and what replaces the pre-ping (teamdesk/db.py).

A checkout sends nothing: a connection the server hung up on while it sat in the pool
is told by its socket (``hung_up``) and replaced before anything is sent on it. An
execution's connection returns to its pool without a statement either (the pool is in
autocommit from the start). Each test reads what the server last ran on that backend
(``pg_stat_activity.query``) to see what was sent.
"""

from __future__ import annotations

from collections.abc import Iterator

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
    with engine.connect() as admin:
        assert admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    # The signal is sent; the session has ended once its backend is gone.
    wait_for(lambda: _gone(engine, pid), what="the terminated backend to exit")
    with single.connect() as conn:  # no error: a new connection
        assert _pid(conn) != pid
        assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1


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
