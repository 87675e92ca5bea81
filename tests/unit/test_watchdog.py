"""tasks/watchdog.py: a watched statement silent past its limit is cancelled once, and
leaving the watch waits until that cancel has been sent."""

from __future__ import annotations

import threading

from tasks import watchdog


class Connection:
    """Stands in for psycopg2's connection: only ``cancel()`` is used, from the watchdog's
    thread; it blocks until the test lets it return, like a cancel waiting on the network."""

    def __init__(self) -> None:
        self.called = threading.Event()
        self.may_return = threading.Event()
        self.calls = 0

    def cancel(self) -> None:
        self.calls += 1
        self.called.set()
        assert self.may_return.wait(10), "the test never let the cancel return"


def test_a_silent_statement_is_cancelled_and_the_watch_ends_after_the_cancel() -> None:
    conn = Connection()
    left = threading.Event()

    def statement() -> None:
        with watchdog.watch(conn, 0.01) as watch:
            assert conn.called.wait(10), "the watchdog never cancelled"
        assert watch.fired
        left.set()

    runner = threading.Thread(target=statement)
    try:
        runner.start()
        assert conn.called.wait(10)
        assert not left.wait(0.2)  # the watch cannot end while its cancel is on its way
    finally:
        conn.may_return.set()
    runner.join(10)
    assert left.is_set() and conn.calls == 1


def test_a_statement_that_ends_in_time_is_never_cancelled() -> None:
    conn = Connection()
    conn.may_return.set()
    with watchdog.watch(conn, 3600) as watch:
        watch.touch()
    assert not watch.fired and conn.calls == 0
