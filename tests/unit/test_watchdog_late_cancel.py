"""tasks/watchdog.py: a cancel whose deadline passes just as its statement returns is not
sent once the caller has disarmed the watch, so it cannot reach the caller's next
statement (an export's completion, on the same connection).

The gate holds the watchdog at that moment (``watchdog.before_cancel``: the deadline has
passed, nothing is sent yet) while the statement returns and the caller leaves the watch.
Before, the watchdog had already committed to the cancel there (the watch was marked
fired): it sent it after the statement had returned, the caller waiting for it as it left
(for as long as the gate held it), where nothing but the server's ignoring a cancel that
finds its session idle kept it off the next statement."""

from __future__ import annotations

import threading
from typing import Any

from tasks import watchdog
from teamdesk import hooks

GATE_S = 2.0  # how long the gate holds the watchdog at most (the old code waits it out)


class Connection:
    """Stands in for psycopg2's connection; notes the cancels sent after its statement
    had returned (pointless at best; at worst on their way to the next statement)."""

    def __init__(self) -> None:
        self.returned = threading.Event()  # the watched statement returned
        self.left = threading.Event()  # ... and its caller left the watch
        self.cancels = 0
        self.late_cancels = 0

    def cancel(self) -> None:
        self.cancels += 1
        if self.returned.is_set():
            self.late_cancels += 1


def test_a_deadline_that_passes_as_the_statement_returns_sends_no_cancel() -> None:
    conn = Connection()
    at_deadline = threading.Event()

    def gate(watch: Any) -> None:
        if watch.conn is conn:
            at_deadline.set()
            conn.left.wait(GATE_S)  # the statement returns and its caller leaves the watch

    with hooks.installed("watchdog.before_cancel", gate):
        with watchdog.watch(conn, 0.01) as watch:
            assert at_deadline.wait(10), "the deadline never passed"
            conn.returned.set()
        conn.left.set()  # the caller is out: its next statement may go now
        # The watchdog goes on past the gate; a later watch shows it has.
        done = threading.Event()
        went_on = hooks.installed("watchdog.before_cancel", lambda watch: done.set())
        with went_on, watchdog.watch(Connection(), 0.01):
            assert done.wait(10)
    assert (conn.cancels, conn.late_cancels, watch.fired) == (0, 0, False)


def test_a_cancel_being_sent_holds_the_disarm_until_it_has_been_sent() -> None:
    """The other order: the cancel is on its way when the statement returns; disarming
    waits for it, so it has been sent before the caller's next statement."""
    sending, may_return = threading.Event(), threading.Event()
    disarmed = threading.Event()

    class Slow:
        def cancel(self) -> None:
            sending.set()
            assert may_return.wait(10)

    def caller() -> None:
        with watchdog.watch(Slow(), 0.01) as watch:
            assert sending.wait(10)
            assert watch.disarm()  # it was sent
        disarmed.set()

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert sending.wait(10)
        assert not disarmed.wait(0.2)  # still being sent: the disarm waits
    finally:
        may_return.set()
    thread.join(10)
    assert disarmed.is_set()
