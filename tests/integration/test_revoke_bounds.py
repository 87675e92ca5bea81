"""A revoke's cancel (worker/revokes.py) runs on the worker's event loop, so its every
wait is bounded on the worker's side: a PostgreSQL that stops answering after the
connect (frozen, or the network dropped) costs the loop a few seconds, not the minutes
TCP takes to give up.

Before, the cancel's only bounds were the server's (``connect_timeout`` for the connect,
``statement_timeout`` for the statement): a server that accepted the connection and then
never answered held the event loop - no acknowledgement, no delivery - until the
connection died."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from harness.factories import World, audit_events, task_row
from harness.waiting import wait_for
from tasks import delivery
from teamdesk import config
from teamdesk.config import Settings
from tests.support.dispatch_scan import waiting_rows
from tests.support.freezable_proxy import freezable_proxy
from tests.support.mute_proxy import mute_proxy
from worker import revokes

STATEMENT_TIMEOUT_S = 0.5  # the server's bound in these tests (5 s in a worker)
SLACK_S = 2.0  # threads, a loaded machine


def revoked(task_id: uuid.UUID) -> delivery.Delivery:
    """The message of run 0 of ``task_id``, as a revoke names it."""
    return delivery.parse((str(task_id), 0, datetime.now(UTC).isoformat()), {})


def cancel_in_thread(message: delivery.Delivery) -> tuple[threading.Thread, float]:
    thread = threading.Thread(target=revokes.cancel_revoked, args=(message, False), daemon=True)
    started = time.monotonic()
    thread.start()
    return thread, started


def revoked_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "task.revoked"]


@pytest.fixture(autouse=True)
def short_statements(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(revokes, "STATEMENT_TIMEOUT_S", STATEMENT_TIMEOUT_S)


def test_a_cancel_returns_within_its_bound_when_the_database_stops_answering(
    engine: sa.Engine, world: World, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    (task_id,) = waiting_rows(engine, world, 1)
    caplog.set_level(logging.INFO, logger="teamdesk.worker")
    bound = revokes.CONNECT_TIMEOUT_S + STATEMENT_TIMEOUT_S + 1.0 + SLACK_S
    with mute_proxy(settings.database_url) as proxy:
        config.set_settings(
            settings.with_overrides(database_url=proxy.url_for(settings.database_url))
        )
        thread, started = cancel_in_thread(revoked(task_id))
        thread.join(bound)
        returned = not thread.is_alive()
        elapsed = time.monotonic() - started
        muted = proxy.muted
    thread.join(10)  # the proxy closed: the connection is gone, whatever the code waits on
    assert muted >= 1, "the cancel never logged in"
    assert returned, f"the cancel still waited after {bound} s"
    assert elapsed >= STATEMENT_TIMEOUT_S  # it did wait for the answer, for its bound
    (line,) = revoked_lines(caplog)
    assert line.levelno == logging.WARNING and line.cancelled is False  # type: ignore[attr-defined]
    assert task_row(engine, task_id)["status"] == "WAITING"


def test_a_cancel_cancels_its_run_and_wakes_the_dispatcher(
    engine: sa.Engine, world: World, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    (task_id,) = waiting_rows(engine, world, 1)
    caplog.set_level(logging.INFO, logger="teamdesk.worker")
    with engine.connect() as listener:
        listener.execute(sa.text("LISTEN teamdesk_dispatch"))
        listener.commit()
        revokes.cancel_revoked(revoked(task_id), False)
        dbapi: Any = listener.connection.dbapi_connection
        wait_for(lambda: dbapi.poll() or dbapi.notifies, timeout=10, what="the wake-up")
        notified = [n.channel for n in dbapi.notifies]
    assert task_row(engine, task_id)["status"] == "CANCELLED"
    assert audit_events(engine, task_id)[-1] == "CANCEL"
    assert notified == ["teamdesk_dispatch"]
    (line,) = revoked_lines(caplog)
    assert line.cancelled is True  # type: ignore[attr-defined]

    revokes.cancel_revoked(revoked(task_id), False)  # ended: nothing more
    assert revoked_lines(caplog)[-1].cancelled is False  # type: ignore[attr-defined]
    assert audit_events(engine, task_id).count("CANCEL") == 1


def test_a_cancel_goes_on_to_the_next_host_when_the_first_never_answers(
    engine: sa.Engine, world: World, settings: Settings
) -> None:
    """``DATABASE_URL`` lists a primary and its standbys: a first host that accepts and
    never answers gets CONNECT_TIMEOUT_S, then the next is tried, as libpq does."""
    (task_id,) = waiting_rows(engine, world, 1)
    real = make_url(settings.database_url)
    with freezable_proxy(settings.database_url) as frozen:
        frozen.freeze()
        hosts = f"127.0.0.1:{frozen.port},{real.host}:{real.port or 5432}"
        listed = f"postgresql://{real.username}@{hosts}/{real.database}"
        config.set_settings(settings.with_overrides(database_url=listed))
        started = time.monotonic()
        revokes.cancel_revoked(revoked(task_id), False)
        elapsed = time.monotonic() - started
        assert frozen.held == 1
    assert task_row(engine, task_id)["status"] == "CANCELLED"
    assert elapsed < revokes.CONNECT_TIMEOUT_S + SLACK_S
