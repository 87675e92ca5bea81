"""Which database failures pass by themselves (``ledger.prepared.is_transient``): a claim
that fails for one of them is retried without counting an attempt; any other fails its
attempt with the cause named (tasks/execution.py). Each error here is PostgreSQL's own."""

from __future__ import annotations

import uuid

import psycopg2
import pytest
import sqlalchemy as sa

from ledger import prepared


def error_of(engine: sa.Engine, sql: str) -> sa.exc.DBAPIError:
    with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as conn:
        conn.exec_driver_sql(sql)
    return caught.value


@pytest.mark.parametrize(
    "case",
    [
        "SELECT * FROM no_such_table",
        "SELECT no_such_column FROM background_tasks",
        "SELECT no_such_function()",
    ],
)
def test_a_schema_mismatch_is_lasting(engine: sa.Engine, case: str) -> None:
    exc = error_of(engine, case)
    assert exc.orig is not None
    assert not prepared.is_transient(exc) and not prepared.is_transient(exc.orig)


def test_a_missing_prepared_statement_is_lasting(engine: sa.Engine) -> None:
    exc = error_of(engine, "EXECUTE td_prep_missing")
    assert isinstance(exc.orig, psycopg2.Error) and exc.orig.pgcode == "26000"
    assert not prepared.is_transient(exc)


def test_a_missing_permission_is_lasting(engine: sa.Engine) -> None:
    role = f"td_probe_{uuid.uuid4().hex[:12]}"  # roles are the server's, not the database's
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role}")
    try:
        exc = error_of(engine, f"SET LOCAL ROLE {role}; SELECT * FROM background_tasks")
        assert isinstance(exc.orig, psycopg2.Error) and exc.orig.pgcode == "42501"
        assert not prepared.is_transient(exc)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP ROLE {role}")


def test_a_statement_timeout_passes(engine: sa.Engine) -> None:
    exc = error_of(engine, "SET LOCAL statement_timeout = '10ms'; SELECT pg_sleep(1)")
    assert prepared.is_transient(exc)


def test_a_lock_not_available_passes(engine: sa.Engine) -> None:
    with engine.begin() as holder:
        holder.exec_driver_sql("LOCK TABLE background_tasks IN EXCLUSIVE MODE")
        exc = error_of(
            engine,
            "SET LOCAL lock_timeout = '10ms'; LOCK TABLE background_tasks IN EXCLUSIVE MODE",
        )
    assert prepared.is_transient(exc)


def test_a_terminated_session_and_a_refused_connection_pass(engine: sa.Engine) -> None:
    with engine.connect() as victim:
        pid = victim.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        with engine.begin() as other:
            other.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")
        with pytest.raises(sa.exc.DBAPIError) as caught:
            victim.exec_driver_sql("SELECT 1")
    assert prepared.is_transient(caught.value)
    with pytest.raises(psycopg2.OperationalError) as refused:
        psycopg2.connect("postgresql://postgres@127.0.0.1:1/x", connect_timeout=2)
    assert prepared.is_transient(refused.value)
    assert prepared.is_transient(ConnectionError("reset"))


def test_a_bug_is_lasting() -> None:
    assert not prepared.is_transient(TypeError("a bug"))
