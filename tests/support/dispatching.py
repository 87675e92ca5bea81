"""The real dispatcher loop in a thread of the test process (leader lock, LISTEN, window).

``running_dispatcher(app)`` runs :class:`dispatcher.loop.DispatchLoop` the way beat does
(``run_for`` in a loop) until the block ends, then stops it and releases its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from celery import Celery

from dispatcher.context import Cluster
from dispatcher.listener import APPLICATION_NAME
from dispatcher.loop import DispatchLoop
from teamdesk.config import Settings, get_settings
from tests.support.workers import running_worker

TICK_S = 0.2  # short ticks, so the thread notices the stop quickly


def listener_backends(engine: sa.Engine, terminate: bool = False) -> int:
    """The dispatcher's LISTEN connections to ``engine``'s database: how many there are,
    or with ``terminate``, how many were cut (``pg_terminate_backend``)."""
    counted = "pg_terminate_backend(pid)" if terminate else "*"
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    f"SELECT count({counted}) FROM pg_stat_activity "
                    "WHERE application_name = :app AND datname = current_database()"
                ),
                {"app": APPLICATION_NAME},
            ).scalar_one()
        )


@contextmanager
def running_dispatcher(app: Celery, settings: Settings | None = None) -> Iterator[DispatchLoop]:
    loop = DispatchLoop(Cluster(app, settings or get_settings()))
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                pause = loop.run_for(TICK_S)
                if pause:
                    stop.wait(pause)
        except BaseException as exc:  # reported by the test, not swallowed
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-dispatcher", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        stop.set()
        thread.join(timeout=10)
        loop.close()
    assert not thread.is_alive(), "the dispatcher thread did not stop"
    if errors:
        raise errors[0]


@contextmanager
def running_cluster(app: Celery, **worker_options: Any) -> Iterator[DispatchLoop]:
    """An in-process worker (``running_worker``) and the dispatcher: tasks created in the
    ledger run without the test publishing anything. The worker starts first, so its
    heartbeat (and the window it offers) is there when the dispatcher's first scan runs."""
    with running_worker(app, **worker_options), running_dispatcher(app) as loop:
        yield loop
