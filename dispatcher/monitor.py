"""What an operator sees while the dispatcher's rounds fail: ``dispatcher.failed`` at most
once per ``FAILED_LOG_INTERVAL_S``, then ``dispatcher.recovered`` once (docs/design.md,
"Dispatch"). Only the leader runs rounds, so the throttle holds for the whole cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from teamdesk.logs import log_event

FAILED_LOG_INTERVAL_S = 30.0

# Fixed text per service: the log never carries the driver's message or a URL.
_REASONS = {
    "PostgreSQL": "the dispatcher could not reach PostgreSQL",
    "Redis": "the dispatcher could not reach Redis or the broker",
}


class FailureLog:
    """Throttled ``dispatcher.failed`` and a single ``dispatcher.recovered``."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = FAILED_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failing_since: float | None = None
        self._last_logged: float | None = None
        self._failures = 0
        self._unlogged = 0

    @property
    def failing(self) -> bool:
        return self._failing_since is not None

    def failed(self, service: str, error: str) -> bool:
        """Record a failed scan; True when this call logged ``dispatcher.failed``."""
        with self._lock:
            now = self._clock()
            self._failures += 1
            if self._failing_since is None:
                self._failing_since = now
            due = self._last_logged is None or now - self._last_logged >= self._interval_s
            if not due:
                self._unlogged += 1
                return False
            reason = _REASONS.get(service, "the dispatcher failed")
            log_event(
                self._logger,
                "dispatcher.failed",
                logging.WARNING,
                service=service,
                error=error,
                reason=reason,
                failed_scans=self._failures,
                suppressed=self._unlogged,
            )
            self._last_logged, self._unlogged = now, 0
            return True

    def succeeded(self) -> bool:
        """Record a good scan; True when it ended an outage and logged ``dispatcher.recovered``."""
        with self._lock:
            if self._failing_since is None:
                return False
            down_s = self._clock() - self._failing_since
            log_event(
                self._logger,
                "dispatcher.recovered",
                failed_scans=self._failures,
                down_s=round(down_s, 1),
            )
            self._failing_since = self._last_logged = None
            self._failures = self._unlogged = 0
            return True
