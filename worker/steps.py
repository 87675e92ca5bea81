"""The worker bootstep that keeps a worker process's liveness in Redis (see liveness.py)."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from dispatcher.heartbeat import WorkerSlots
from teamdesk.config import get_settings
from worker.liveness import Liveness, held_delivery_tags, renew_interval_s

_current: Liveness | None = None
_holder: str | None = None

WAKE_S = 0.1


def _noop() -> None:
    """Nothing: the timer exists to bound the event loop's sleep (see LivenessStep.start)."""


def current_liveness() -> Liveness | None:
    """This process's liveness, once the worker built it (None outside a worker)."""
    return _current


def lease_holder() -> str | None:
    """The heartbeat member this worker process records in every claim it makes (None
    outside a worker, or once the step stopped: the staleness rule alone applies then)."""
    return _holder


def _consumes(worker: Any) -> WorkerSlots:
    """The task queues this worker consumes (after ``-Q``) and its pool size: the
    dispatcher sizes each queue's window from what live workers offer."""
    try:
        queues = tuple(sorted(worker.app.amqp.queues.consume_from))
    except AttributeError:
        queues = ()
    return WorkerSlots(queues, int(getattr(worker, "concurrency", 0) or 0))


class LivenessStep(bootsteps.StartStopStep):
    """Renews the heartbeat member and message visibility on the worker's timer.

    The member is chosen when the worker is built, before the pool forks, so the pool's
    children record it in every claim (``lease_holder``) and the dispatcher can tell
    when the process holding a lease is gone.
    """

    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, teamdesk_renew_visibility: bool = True, **kwargs: Any) -> None:
        global _current, _holder
        super().__init__(parent, **kwargs)
        self.liveness = Liveness(
            get_settings(),
            held_delivery_tags,
            renew_visibility=teamdesk_renew_visibility,
            consumes=_consumes(parent),
        )
        self.tref: Any = None
        self.wake: Any = None
        _current = self.liveness
        _holder = self.liveness.member  # chosen before the pool forks: children inherit it

    def start(self, parent: Any) -> None:
        self.liveness.tick()
        interval = renew_interval_s(self.liveness.settings)
        self.tref = parent.timer.call_repeatedly(interval, self.liveness.tick, priority=10)
        # The worker's event loop sleeps until its next timer, up to 1 s, and a signal
        # does not cut that sleep short; a no-op timer every WAKE_S makes a SIGTERM start
        # the drain within WAKE_S instead (an idle worker then exits about 0.8 s sooner).
        self.wake = parent.timer.call_repeatedly(WAKE_S, _noop, priority=0)

    def stop(self, parent: Any) -> None:
        global _holder
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        if self.wake is not None:
            self.wake.cancel()
            self.wake = None
        self.liveness.stop()
        _holder = None

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)
