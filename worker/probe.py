"""``teamdesk-tasks health``: the worker container's health check (docs/design.md,
"Heartbeats"). One JSON line ``{"worker", "redis", "database", "scope"}`` (never an address
or exception text; why it failed goes to stderr), exit 0 only when the scope has a live
member and Redis and PostgreSQL answered. It never imports the Celery app or touches the
broker, so it cannot disturb a busy worker.

Both checks run at once on daemon threads; one not done by ``CHECK_DEADLINE_S`` counts as
failed (``"redis": false`` means "did not complete"). A watchdog prints what is known and
exits 1 at ``HARD_CAP_S``, should anything still hang (a frozen Redis, a stuck exit).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from teamdesk.config import Settings
from teamdesk.db import select_one
from teamdesk.heartbeat import has_heartbeat, live_members
from teamdesk.redis_client import redis_client

CHECK_DEADLINE_S = 1.25  # stop waiting for the checks (the whole probe, started: under 2 s)
OPERATION_TIMEOUT_S = 1.0  # Redis connect/read, PostgreSQL statement
HARD_CAP_S = 3.5  # watchdog, counted from the probe's start (under 4 s with interpreter start)

Outcomes = dict[str, bool]


def redis_check(settings: Settings, scope: str, timeout_s: float) -> tuple[bool, list[str]]:
    """Whether ``scope`` has a live member, and (when it has none) the scopes that do;
    raises when Redis does not answer in time."""
    client = redis_client(settings, settings.redis_url, timeout_s)
    try:
        if has_heartbeat(client, settings.queue_prefix, scope):
            return True, [scope]
        members = live_members(client, settings.queue_prefix)
        return False, sorted({member.rsplit("/", 1)[0] for member in members})
    finally:
        client.close()


def database_check(database_url: str, timeout_s: float) -> bool:
    """Whether PostgreSQL answers ``SELECT 1``; raises when it cannot be reached."""
    return select_one(database_url, timeout_s=timeout_s, application_name="teamdesk-health")


def report(outcomes: Outcomes, scope: str) -> dict[str, Any]:
    """The JSON fields; a check missing from ``outcomes`` did not complete."""
    return {
        "worker": outcomes.get("redis") is True,
        "redis": "redis" in outcomes,
        "database": outcomes.get("database") is True,
        "scope": scope,
    }


def is_healthy(fields: dict[str, Any]) -> bool:
    return bool(fields["worker"] and fields["redis"] and fields["database"])


def problems(fields: dict[str, Any], live_scopes: list[str] | None) -> list[str]:
    """Why the probe failed, one line per failed check (none when it passed)."""
    found = []
    if not fields["redis"]:
        found.append("Redis did not answer (REDIS_URL)")
    elif not fields["worker"]:
        scope = fields["scope"]
        live = ", ".join(live_scopes or []) or "none"
        found.append(
            f"no live worker in scope {scope!r}; live scopes: {live} "
            "(a worker's scope is its WORKER_INSTANCE_ID; check another with --scope)"
        )
    if not fields["database"]:
        found.append("PostgreSQL did not answer (DATABASE_URL)")
    return found


class HealthProbe:
    """One run of the health check; :meth:`emit` prints what is known, once."""

    def __init__(self, settings: Settings, scope: str, out: TextIO, err: TextIO) -> None:
        self.settings = settings
        self.scope = scope
        self._out, self._err = out, err
        self._outcomes: Outcomes = {}
        self._live_scopes: list[str] | None = None
        self._print_lock = threading.Lock()
        self._printed = False

    def run(self, deadline_s: float, timeout_s: float) -> int:
        """Run both checks at once, wait at most ``deadline_s``, print, return 0 or 1."""
        threads = [
            self._start_check("redis", lambda: self._redis_check(timeout_s)),
            self._start_check(
                "database", lambda: database_check(self.settings.database_url, timeout_s)
            ),
        ]
        deadline = time.monotonic() + deadline_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        fields = self.emit()
        return 0 if is_healthy(fields) else 1

    def _redis_check(self, timeout_s: float) -> bool:
        found, self._live_scopes = redis_check(self.settings, self.scope, timeout_s)
        return found

    def emit(self) -> dict[str, Any]:
        """Print the result line unless it was printed already; returns the fields."""
        fields = report(dict(self._outcomes), self.scope)
        if self._print_lock.acquire(timeout=0.2):
            try:
                if not self._printed:
                    self._out.write(json.dumps(fields) + "\n")
                    self._out.flush()
                    for problem in problems(fields, self._live_scopes):
                        self._err.write(f"teamdesk-tasks health: {problem}\n")
                    self._err.flush()
                    self._printed = True
            finally:
                self._print_lock.release()
        return fields

    def _start_check(self, name: str, check: Callable[[], bool]) -> threading.Thread:
        """Run ``check`` in a daemon thread; its result is recorded only if it returns."""

        def target() -> None:
            try:
                self._outcomes[name] = check()
            except Exception:  # failed; the text may hold an address, so it is dropped
                return

        thread = threading.Thread(target=target, name=f"health-{name}", daemon=True)
        thread.start()
        return thread


def health_command(
    settings: Settings,
    scope: str | None = None,
    *,
    deadline_s: float = CHECK_DEADLINE_S,
    timeout_s: float = OPERATION_TIMEOUT_S,
    hard_cap_s: float = HARD_CAP_S,
) -> int:
    """Run the probe, print its line, return 0 or 1. For the CLI process only: its
    watchdog ends the process at ``hard_cap_s``."""
    probe = HealthProbe(settings, scope or settings.worker_instance_id, sys.stdout, sys.stderr)
    _start_watchdog(hard_cap_s, probe.emit)
    return probe.run(deadline_s, timeout_s)


def _start_watchdog(cap_s: float, emit: Callable[[], object]) -> None:
    def fire() -> None:
        try:
            emit()
        finally:
            os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()
