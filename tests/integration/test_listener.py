"""The dispatcher's LISTEN connection (dispatcher/listener.py) against real PostgreSQL: a
(re)connect reports a wake, because whatever was notified before its LISTEN took effect
was missed; after it, a notification wakes the waiter and silence does not."""

from __future__ import annotations

import time

import sqlalchemy as sa

from dispatcher.listener import Listener
from harness.waiting import wait_for
from ledger.wake import WAKE_CHANNEL
from tests.support.dispatching import listener_backends

QUIET_S = 0.3  # a wait that must end without a wake: how long it listens


def _notify(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_notify(:channel, '')"), {"channel": WAKE_CHANNEL})


def test_every_connect_reports_a_wake_and_then_only_notifications_do(
    engine: sa.Engine, database_url: str
) -> None:
    _notify(engine)  # sent before anyone listens: gone
    listener = Listener(database_url)
    try:
        assert listener.wait(QUIET_S) is True  # connected: look at the ledger once
        assert listener.connected
        assert listener.wait(QUIET_S) is False
        _notify(engine)
        assert listener.wait(5.0) is True
        assert listener.wait(QUIET_S) is False

        assert listener_backends(engine, terminate=True) == 1
        wait_for(lambda: listener.wait(QUIET_S), what="the listener to notice its loss")
        assert not listener.connected
        _notify(engine)  # sent while nobody listens: gone
        # Polling (a wake per call) until the reconnect, no sooner than RECONNECT_AFTER_S;
        # the call that reconnects reports the wake that covers the lost notification.
        woken = [listener.wait(QUIET_S)]
        deadline = time.monotonic() + 10
        while not listener.connected and time.monotonic() < deadline:
            woken.append(listener.wait(QUIET_S))
        assert listener.connected
        assert all(woken), woken
        assert listener.wait(QUIET_S) is False
    finally:
        listener.close()
