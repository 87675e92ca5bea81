"""The worker bootstep that keeps a worker process's liveness in Redis (see liveness.py)."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from teamdesk.config import get_settings
from worker.liveness import Liveness, held_delivery_tags, renew_interval_s

_current: Liveness | None = None


def current_liveness() -> Liveness | None:
    """This process's liveness, once the worker built it (None outside a worker)."""
    return _current


class LivenessStep(bootsteps.StartStopStep):
    """Renews the heartbeat member and message visibility on the worker's timer.

    The member is chosen when the worker is built, before the pool forks, so the pool's
    children record it in every claim (``lease_holder``) and the dispatcher can tell
    when the process holding a lease is gone.
    """

    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, teamdesk_renew_visibility: bool = True, **kwargs: Any) -> None:
        global _current
        super().__init__(parent, **kwargs)
        self.liveness = Liveness(
            get_settings(), held_delivery_tags, renew_visibility=teamdesk_renew_visibility
        )
        self.tref: Any = None
        _current = self.liveness
        from tasks import queueing

        queueing.set_lease_holder(self.liveness.member)

    def start(self, parent: Any) -> None:
        self.liveness.tick()
        interval = renew_interval_s(self.liveness.settings)
        self.tref = parent.timer.call_repeatedly(interval, self.liveness.tick, priority=10)

    def stop(self, parent: Any) -> None:
        from tasks import queueing

        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        self.liveness.stop()
        queueing.set_lease_holder(None)

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)
