"""Blocking checks run in daemon threads, each answer bounded by a deadline (health probes).

A frozen PostgreSQL can hold a socket read longer than any client-side timeout covers,
so the request stops waiting at the deadline and the thread is left to finish on its
own. The threads are daemons, so a hung one never delays the process's exit, and at most
:data:`MAX_CHECKS_IN_FLIGHT` run at once: past that a check fails at once instead of
piling more threads onto a stuck server.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

MAX_CHECKS_IN_FLIGHT = 4

T = TypeVar("T")


class CheckFailed(Exception):
    """The check did not complete: an error, the deadline, or too many checks in flight."""


class BoundedChecks:
    def __init__(self, max_in_flight: int = MAX_CHECKS_IN_FLIGHT) -> None:
        self._slots = threading.BoundedSemaphore(max_in_flight)

    async def run(self, check: Callable[[], T], deadline_s: float) -> T:
        """``check()``'s result, or CheckFailed (its cause set) when it raised or overran."""
        if not self._slots.acquire(blocking=False):
            raise CheckFailed("too many checks in flight")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        thread = threading.Thread(
            target=self._run_and_report, args=(check, loop, future), daemon=True
        )
        try:
            thread.start()
        except RuntimeError:
            self._slots.release()
            raise
        try:
            return await asyncio.wait_for(future, deadline_s)
        except Exception as exc:
            raise CheckFailed(type(exc).__name__) from exc

    def _run_and_report(
        self, check: Callable[[], T], loop: asyncio.AbstractEventLoop, future: asyncio.Future[T]
    ) -> None:
        try:
            outcome: tuple[str, Any] = ("result", check())
        except Exception as exc:
            outcome = ("error", exc)
        finally:
            self._slots.release()
        # RuntimeError: the loop closed while the check ran, so nobody is waiting.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future[Any], outcome: tuple[str, Any]) -> None:
    if future.done():  # the caller stopped waiting at its deadline
        return
    kind, value = outcome
    if kind == "result":
        future.set_result(value)
    else:
        future.set_exception(value)
