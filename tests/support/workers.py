"""In-process Celery workers on the real broker (``celery.contrib.testing``)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker

from tasks.names import EXPORTS_QUEUE, REMINDERS_QUEUE

POLL_S = 0.1


@contextmanager
def running_worker(
    app: Celery,
    *,
    pool: str = "threads",
    concurrency: int = 2,
    queues: tuple[str, ...] = (EXPORTS_QUEUE, REMINDERS_QUEUE),
    **kwargs: Any,
) -> Iterator[Any]:
    """An in-process worker. Its broker connection polls every POLL_S: a stop waits for
    the BRPOP in flight (kombu reads its answer before closing the channel), 1 s by
    default - most of an in-process test's stop."""
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "polling_interval": POLL_S,
    }
    with start_worker(
        app,
        pool=pool,
        concurrency=concurrency,
        perform_ping_check=False,
        queues=list(queues),
        loglevel="WARNING",
        shutdown_timeout=30,
        **kwargs,
    ) as worker:
        yield worker


class EventLog:
    """Captures the cluster's Celery events in a thread, the way Flower receives them."""

    READY_TIMEOUT_S = 10.0

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self.state = app.events.State()
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)
            self.state.event(event)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self._on_event})
            self.ready.set()
            try:
                # Receiver.capture, checking should_stop every POLL_S instead of every 1 s.
                for _ in self._receiver.consume(wakeup=False, safety_interval=POLL_S):
                    pass
            except Exception:
                if not getattr(self._receiver, "should_stop", False):
                    raise

    def __enter__(self) -> EventLog:
        self._thread.start()
        assert self.ready.wait(self.READY_TIMEOUT_S), "event receiver did not start"
        # Wait until the receiver's subscription is live (events sent before it are not
        # delivered to it): it sees an event of its own, of a type no test counts.
        probe = uuid.uuid4().hex
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        try:
            with self.app.events.default_dispatcher() as dispatcher:
                while not self.of_type("eventlog-ready", probe):
                    assert time.monotonic() < deadline, "event receiver never saw its own event"
                    dispatcher.send("eventlog-ready", uuid=probe)
                    time.sleep(0.05)  # then send again: polling with a deadline
        except BaseException:
            self.__exit__()  # stop the receiver: the with-block's exit will not run
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=10)

    def of_type(self, type_: str, uuid: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [
                e
                for e in self.events
                if e.get("type") == type_ and (uuid is None or e.get("uuid") == uuid)
            ]
