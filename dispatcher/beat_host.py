"""celery beat runs the dispatcher: its scheduler, :class:`DispatchingScheduler`, schedules no
Celery task and runs the dispatcher loop for a bounded time at each ``tick`` (docs/design.md,
"Dispatch" and "Shutdown"). A stop signal only asks; ``SystemExit`` is raised between two
ticks. Run it under a supervisor anyway: a bug ends it with exit 1.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from celery.beat import Scheduler

from dispatcher.context import Cluster
from dispatcher.leader import leader_ttl_s
from dispatcher.ledger_gauges import LedgerGauges
from dispatcher.loop import DispatchLoop
from dispatcher.metrics import serve_once
from teamdesk import s3_store, tracing_setup
from teamdesk.config import Settings, get_settings

SCHEDULER = "dispatcher.beat_host:DispatchingScheduler"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
MAX_TICK_BUDGET_S = 1.0  # one tick works at most this long (and a third of the lock's TTL)


def tick_budget_s(settings: Settings) -> float:
    return min(MAX_TICK_BUDGET_S, leader_ttl_s(settings) / 3)


def beat_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for beat: run the dispatcher instead of a schedule."""
    return {
        "beat_scheduler": SCHEDULER,
        "beat_schedule": {},
        "beat_max_loop_interval": tick_budget_s(settings),
    }


class DispatchingScheduler(Scheduler):
    """A beat scheduler with no entries whose tick is the dispatcher loop."""

    _loop: DispatchLoop | None = None
    _stop_asked = False

    def setup_schedule(self) -> None:
        self.data: dict[str, Any] = {}
        s3_store.store_or_exit(get_settings(), "celery beat")  # its purge uses EXPORT_STORE
        tracing_setup.configure("dispatcher")  # OTEL_* asks for traces (teamdesk/tracing.py)
        if threading.current_thread() is threading.main_thread():  # not beat inside a worker
            for stop_signal in STOP_SIGNALS:  # after Celery's, which this replaces
                signal.signal(stop_signal, self.ask_stop)

    def ask_stop(self, *_: Any) -> None:
        """A stop signal: the tick running ends, the next raises ``SystemExit``."""
        self._stop_asked = True

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._stop_asked:
            raise SystemExit()
        if self._loop is None:
            self._loop = loop = DispatchLoop(Cluster(self.app, get_settings()))
            serve_once(loop.cluster.settings, LedgerGauges(loop.cluster, loop.metrics.leading))
        wait = self._loop.run_for(tick_budget_s(self._loop.cluster.settings))
        if self._stop_asked:
            raise SystemExit()
        return wait

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        super().close()

    @property
    def info(self) -> str:
        return "dispatcher (leader lock on REDIS_URL)"
